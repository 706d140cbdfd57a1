"""`tunelab webui` over real HTTP on 127.0.0.1: who may connect, which paths, a second launch, a crashed run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.webui.server import QUICK_FORM, basic, call, run_cli, wait_for, webui_server

pytest.importorskip("fastapi", reason="tunelab webui needs the webui extra (fastapi, uvicorn)")
pytestmark = pytest.mark.slow  # every test runs `tunelab` processes (the server, its runs): not make test-fast's


def test_non_loopback_address_needs_credentials(tmp_path):
    result = run_cli(["webui", "--host", "0.0.0.0"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "tunelab: error: --host 0.0.0.0: the web UI starts and stops training runs and reads files, so any address "
        "other than loopback needs --auth user:password or --token TOKEN"
    )


def test_credentials_are_checked_on_every_request(tmp_path):
    with webui_server(tmp_path, ["--auth", "ann:secret", "--token", "t0k"]) as url:
        assert call(f"{url}/")[0] == 401
        assert call(f"{url}/api/runs")[0] == 401
        assert call(f"{url}/api/runs", headers=basic("ann:wrong"))[0] == 401
        assert call(f"{url}/api/runs", headers={"Authorization": "Bearer nope"})[0] == 401
        assert call(f"{url}/api/runs", headers=basic("ann:secret")) == (200, {"runs": []})
        assert call(f"{url}/api/runs", headers={"Authorization": "Bearer t0k"}) == (200, {"runs": []})
        assert call(f"{url}/api/runs?token=t0k") == (200, {"runs": []})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("webui-root")
    with webui_server(root) as url:
        yield url, root


def test_without_credentials_only_loopback_names_are_answered(server):
    url, _ = server
    port = url.rsplit(":", 1)[1]
    assert call(f"{url}/api/runs", headers={"Host": f"localhost:{port}"})[0] == 200
    status, text = call(f"{url}/api/runs", headers={"Host": f"rebound.example:{port}"})
    assert (status, text) == (403, "tunelab webui: open it as http://127.0.0.1:PORT/ or http://localhost:PORT/\n")


def test_paths_outside_the_allowed_roots_are_refused(server, tmp_path):
    url, root = server
    outside = tmp_path / "elsewhere"
    status, answer = call(f"{url}/api/check", {**QUICK_FORM, "output_dir": str(outside)})
    assert (status, answer["ok"], answer["key"]) == (200, False, "output_dir")
    assert answer["message"] == (f"output_dir: {outside} is outside the folders this UI may use ({root}); start "
                                 "tunelab webui with --root FOLDER to allow another")
    # `..` and symlinks are resolved before the check
    (root / "link").symlink_to(tmp_path)
    status, answer = call(f"{url}/api/check", {**QUICK_FORM, "output_dir": "link/run"})
    assert answer["message"].startswith(f"output_dir: link/run is outside the folders this UI may use")
    status, answer = call(f"{url}/api/check", {**QUICK_FORM, "dataset_dir": "../.."})
    assert (answer["key"], answer["message"].split(":")[0]) == ("dataset_dir", "dataset_dir")
    status, answer = call(f"{url}/api/run?dir=/etc")
    assert status == 400 and answer["error"].startswith("dir: /etc is outside the folders this UI may use")
    status, answer = call(f"{url}/api/chat", {"dir": "/", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and answer["error"].startswith("dir: / is outside the folders this UI may use")


def test_check_reports_the_cli_message_beside_its_field(server):
    url, _ = server
    status, answer = call(f"{url}/api/check", {**QUICK_FORM, "output_dir": "saves/a", "cutoff_len": "-3"})
    assert answer == {"ok": False, "message": "cutoff_len must be at least 2, got -3", "key": "cutoff_len",
                      "yaml": answer["yaml"]}
    status, answer = call(f"{url}/api/check", {**QUICK_FORM, "output_dir": "saves/a", "other": "max_new_tokens: 16"})
    assert (answer["ok"], answer["message"]) == (True, "the config passes the checks of tunelab train")
    assert answer["yaml"].splitlines()[:2] == ["stage: sft", "model_name_or_path: tiny"]  # the form's order
    assert answer["yaml"].splitlines()[-1] == "max_new_tokens: 16"


def test_a_second_launch_into_a_live_run_is_refused_and_stop_sends_sigterm(server):
    url, root = server
    form = {**QUICK_FORM, "max_steps": "1000", "output_dir": "saves/live"}
    status, first = call(f"{url}/api/launch", form)
    assert status == 200, first
    try:
        status, second = call(f"{url}/api/launch", form)
        assert status == 409
        assert second["key"] == "output_dir"
        assert second["error"].startswith(f"output_dir: {root / 'saves/live'} already has a live run (pid {first['pid']},")
        status, runs = call(f"{url}/api/runs")
        assert [(r["name"], r["state"]) for r in runs["runs"]] == [("saves/live", "running")]
        assert call(f"{url}/api/stop", {"dir": "saves/live"}) == (200, {"dir": str(root / "saves/live"), "signal": "SIGTERM"})
        state = wait_for(lambda: call(f"{url}/api/run?dir=saves/live")[1]["state"] != "running", 240, "the run to end")
        assert call(f"{url}/api/run?dir=saves/live")[1]["state"] == "stopped"
    finally:
        try:
            os.kill(first["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_crashed_run_shows_its_error_line(server):
    url, root = server
    data = root / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "rows.jsonl", "formatting": "alpaca"}}))
    (data / "rows.jsonl").write_text('{"broken": \n')  # passes the checks (the file exists), fails when read
    form = {**QUICK_FORM, "dataset": "mine", "dataset_dir": "data", "max_steps": "2", "output_dir": "saves/crash"}
    status, answer = call(f"{url}/api/launch", form)
    assert status == 200, answer
    run = wait_for(lambda: (r := call(f"{url}/api/run?dir=saves/crash")[1])["state"] != "running" and r, 240,
                   "the run to fail")
    assert (run["state"], run.get("exit_code")) == ("crashed", 2), run
    assert run["error"] == "tunelab: error: data/rows.jsonl:1: Expecting value; fix or remove that line"


def test_runs_started_elsewhere_show_up_from_their_files(server):
    url, root = server
    run = root / "cli-runs" / "sorted"
    run.mkdir(parents=True)
    records = [{"step": 1, "max_steps": 2, "loss": 3.5}, {"step": 2, "max_steps": 2, "loss": 2.25}]
    (run / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3')
    (run / "all_results.json").write_text(json.dumps({"train_loss": 2.8}))
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / "tunelab_manifest.json").write_text("{}")
    status, answer = call(f"{url}/api/run?dir=cli-runs/sorted")
    assert status == 200
    assert (answer["name"], answer["state"], answer["step"], answer["max_steps"]) == ("cli-runs/sorted", "finished", 2, 2)
    assert answer["log"] == records  # the line still being written is left for the next read
    assert answer["checkpoints"] == [{"name": "checkpoint-2", "step": 2, "complete": True}]
    assert answer["metrics"] == {"train_loss": 2.8}
    assert "cli-runs/sorted" in [r["name"] for r in call(f"{url}/api/runs")[1]["runs"]]


def test_dataset_names_come_from_the_registry(server):
    url, root = server
    (root / "sets").mkdir()
    (root / "sets" / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "rows.jsonl"}}))
    status, answer = call(f"{url}/api/datasets")
    assert status == 200 and "demo_sort" in answer["names"] and "mine" not in answer["names"]
    assert call(f"{url}/api/datasets?dataset_dir=sets")[1]["names"][-1] == "mine"
    status, answer = call(f"{url}/api/datasets?dataset_dir=/etc")
    assert status == 400 and answer["error"].startswith("dataset_dir: /etc is outside the folders this UI may use")


def test_a_yaml_fills_the_form_and_a_broken_one_says_where(server):
    url, _ = server
    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    status, answer = call(f"{url}/api/yaml", {"text": quickstart.read_text(encoding="utf-8")})
    assert status == 200
    assert (answer["form"]["dataset"], answer["form"]["cutoff_len"], answer["form"]["other"]) == (
        "demo_sort", "64", "eval_generation: true\neval_generation_samples: 200\nmax_new_tokens: 16\n")
    status, answer = call(f"{url}/api/yaml", {"text": "stage: sft\ncutoff_len: [64\n"})
    assert status == 400 and answer["error"].startswith("YAML: line 3: not valid YAML")


def test_the_page_renders_each_field_from_its_option(server):
    url, _ = server
    status, page = call(f"{url}/")
    assert status == 200
    assert ('<div class="field" id="row-lora_rank" title="LoRA rank r." '
            'data-shows-for=\'{"finetuning_type": ["", "lora"]}\'>') in page
    assert '<div class="field" id="row-packing" title="Pack several examples' in page  # no shows-for: always shown
    assert 'name="logging_steps" type="text" placeholder="10" inputmode="decimal"' in page
    assert '<option value="">(default: sft)</option><option value="pt">pt</option>' in page
