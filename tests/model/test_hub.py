"""Models by Hugging Face Hub id (tunelab/hub.py), against a Hub cache laid out in huggingface_hub's own format.

Offline (HF_HUB_OFFLINE=1) the real resolution path runs: huggingface_hub's snapshot_download reads refs/ and
snapshots/ of the cache. The Hub's refusals (gated, unknown repo, unknown revision, bad token) come from a small
HTTP server on 127.0.0.1 answering with the Hub's error headers; an unreachable Hub is a closed port.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.hub_cache import config_outcomes, folder_files, hub_env, lay_out, resolve_outcomes, run_python, run_tunelab
from tunelab.hub import is_repo_id, snapshot_containing, snapshot_of

MAIN = hashlib.sha1(b"main").hexdigest()  # the commit refs/main names
V1 = hashlib.sha1(b"v1").hexdigest()  # an older commit, tagged v1: another model (Qwen2)
PICKLED = hashlib.sha1(b"pickled").hexdigest()
CUSTOM = hashlib.sha1(b"custom").hexdigest()
PARTIAL = hashlib.sha1(b"partial").hexdigest()
DATA = hashlib.sha1(b"data").hexdigest()


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama_dir, tiny_qwen2_dir) -> Path:
    """A Hub cache: org/tiny (main: Llama, v1: Qwen2), org/pickled (pytorch_model.bin only), org/custom (its own
    modelling code), and the dataset org/reverse."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    lay_out(cache, "org/tiny", folder_files(tiny_llama_dir), MAIN)
    lay_out(cache, "org/tiny", folder_files(tiny_qwen2_dir), V1, refs=("v1",))

    pickled = folder_files(tiny_llama_dir, skip=("model.safetensors",))
    bin_file = cache.parent / "pytorch_model.bin"
    torch.save(load_file(tiny_llama_dir / "model.safetensors"), bin_file)
    lay_out(cache, "org/pickled", pickled | {"pytorch_model.bin": bin_file}, PICKLED)
    lay_out(cache, "org/shadowed", pickled | {"pytorch_model.bin": bin_file}, PICKLED)

    custom = json.loads((tiny_llama_dir / "config.json").read_text())
    custom.update(model_type="tiny_custom", auto_map={"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    lay_out(cache, "org/custom", folder_files(tiny_llama_dir) | {
        "config.json": json.dumps(custom), "modeling_tiny.py": "raise SystemExit('custom code ran')\n",
    }, CUSTOM)

    # Cached in part: a tokenizer run fetched all but the weights; a download stopped after one of two shards.
    lay_out(cache, "org/noweights", folder_files(tiny_llama_dir, skip=("model.safetensors",)), PARTIAL)
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    lay_out(cache, "org/sharded", folder_files(tiny_llama_dir, skip=("model.safetensors",)) | {
        "model.safetensors.index.json": json.dumps(index),
        "model-00001-of-00002.safetensors": tiny_llama_dir / "model.safetensors",
    }, PARTIAL)

    rows = [{"instruction": f"w{i} w{i + 1}", "output": f"w{i + 1} w{i}"} for i in range(3, 40)]
    lay_out(cache, "org/reverse", {"data/train.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}, DATA,
            repo_type="dataset")
    return cache


def write_config(folder: Path, **options) -> Path:
    config = {"model_name_or_path": "org/tiny", "template": "chatml", "dataset": "demo_reverse",
              "output_dir": str(folder / "out"), **options}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.yaml").write_text(yaml.safe_dump(config))
    return folder / "cfg.yaml"


def snapshot(cache: Path, repo_id: str, commit: str) -> str:
    return str(cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit)


# ---- the names ----------------------------------------------------------------------------------------------


def test_repo_ids_and_cache_folders():
    assert [is_repo_id(s) for s in ("Qwen/Qwen2.5-0.5B-Instruct", "org/name", "gpt2", "./org/name", "/abs/path",
                                    "a/b/c", "org/na--me")] == [True, True, False, False, False, False, False]
    folder = Path("/c/hub/models--Qwen--Qwen2.5-0.5B/snapshots") / MAIN
    found = snapshot_of(folder)
    assert (found.repo_id, found.commit, found.repo_type, found.cache_dir) == (
        "Qwen/Qwen2.5-0.5B", MAIN, "model", Path("/c/hub"))
    data = snapshot_containing(Path("/c/hub/datasets--org--data/snapshots") / DATA / "data" / "train.jsonl")
    assert (data.repo_id, data.commit, data.repo_type) == ("org/data", DATA, "dataset")
    assert snapshot_of("/work/saves/run1") is None
    assert snapshot_containing("/work/saves/run1/adapter_model.safetensors") is None


# ---- config time, offline --------------------------------------------------------------------------------------


@pytest.mark.slow  # a fresh interpreter (Hub variables are read at import): not make test-fast's
def test_hub_ids_resolve_offline_and_fail_in_one_line(hub, tmp_path, tiny_llama_dir):
    cfg = str(write_config(tmp_path / "run"))
    shutil.copytree(tiny_llama_dir, tmp_path / "run" / "org" / "shadowed")  # a folder spelled like a cached Hub id
    local_bin = tmp_path / "local-bin"
    shutil.copytree(tiny_llama_dir, local_bin, ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save(load_file(tiny_llama_dir / "model.safetensors"), local_bin / "pytorch_model.bin")
    outcomes = config_outcomes({
        "main": (cfg, []),
        "tag": (cfg, ["model_revision=v1"]),
        "commit": (cfg, [f"model_revision={V1}"]),
        "missing": (cfg, ["model_name_or_path=org/missing"]),
        "missing revision": (cfg, ["model_revision=v2"]),
        "pickle": (cfg, ["model_name_or_path=org/pickled"]),
        "pickle allowed": (cfg, ["model_name_or_path=org/pickled", "allow_pickle_weights=true"]),
        "local pickle": (cfg, [f"model_name_or_path={local_bin}"]),
        "remote code": (cfg, ["model_name_or_path=org/custom"]),
        "typo, id-like": (cfg, ["model_name_or_path=saves/typo"]),
        "typo, a path": (cfg, ["model_name_or_path=./saves/typo"]),
        "local folder wins": (cfg, ["model_name_or_path=org/shadowed"]),  # the cached one has only pickle weights
    }, hub_env(hub), tmp_path / "run")
    assert outcomes == {
        "main": f"ok {snapshot(hub, 'org/tiny', MAIN)}",
        "tag": f"ok {snapshot(hub, 'org/tiny', V1)}",
        "commit": f"ok {snapshot(hub, 'org/tiny', V1)}",
        "missing": f"model_name_or_path: org/missing is no local folder, not in the Hugging Face cache ({hub}), and "
                   "HF_HUB_OFFLINE is set; fetch it with `hf download org/missing` or unset HF_HUB_OFFLINE",
        "missing revision": f"model_name_or_path: org/tiny is no local folder, not in the Hugging Face cache ({hub}) "
                            "at revision 'v2', and HF_HUB_OFFLINE is set; fetch it with `hf download org/tiny "
                            "--revision v2` or unset HF_HUB_OFFLINE",
        "pickle": "model_name_or_path: org/pickled has only pickle weights (pytorch_model.bin), which can run code "
                  "when loaded; tunelab reads safetensors: use a safetensors copy of the model, or set "
                  "allow_pickle_weights: true if you trust its source",
        "pickle allowed": f"ok {snapshot(hub, 'org/pickled', PICKLED)}",
        "local pickle": f"model_name_or_path: {local_bin} has only pickle weights (pytorch_model.bin), which can run "
                        "code when loaded; tunelab reads safetensors: use a safetensors copy of the model, or set "
                        "allow_pickle_weights: true if you trust its source",
        "remote code": f"model_name_or_path: {snapshot(hub, 'org/custom', CUSTOM)} needs its own modelling code "
                       "(modeling_tiny.py), which tunelab runs only with trust_remote_code: true; read that code "
                       "first, then set trust_remote_code: true",
        "typo, id-like": f"model_name_or_path: saves/typo is no local folder, not in the Hugging Face cache ({hub}), "
                         "and HF_HUB_OFFLINE is set; fetch it with `hf download saves/typo` or unset HF_HUB_OFFLINE",
        "typo, a path": "model_name_or_path: saves/typo is not a folder; point it at a local Hugging Face model folder",
        "local folder wins": "ok org/shadowed",
    }


@pytest.mark.slow  # a fresh interpreter (Hub variables are read at import): not make test-fast's
def test_weights_missing_from_the_cache_fail_when_the_model_loads(hub, tmp_path):
    """Offline, the config checks pass on a cache holding all but the weights (`tunelab data` needs no more);
    loading the model names what is missing."""
    outcomes = run_python("""
import json
from tunelab.errors import TunelabError
from tunelab.hub import fetch_weights, resolve_model

def outcome(name):
    folder = resolve_model(name, "model_name_or_path")
    try:
        fetch_weights(folder)
        return "ok"
    except TunelabError as exc:
        return str(exc)

print(json.dumps({name: outcome(name) for name in ("org/tiny", "org/noweights", "org/sharded")}))
""", hub_env(hub), tmp_path)
    fix = f"fetch it with `hf download {{}} --revision {PARTIAL}` or unset HF_HUB_OFFLINE"
    assert outcomes == {
        "org/tiny": "ok",
        "org/noweights": f"model_name_or_path: org/noweights (commit {PARTIAL}) has no model.safetensors or "
                         f"adapter_model.safetensors in the Hugging Face cache ({hub}); {fix.format('org/noweights')}",
        "org/sharded": f"model_name_or_path: org/sharded: model-00002-of-00002.safetensors is not in the Hugging Face "
                       f"cache ({hub}) at revision '{PARTIAL}'; {fix.format('org/sharded')}",
    }


# ---- the Hub's answers, over HTTP --------------------------------------------------------------------------------


class HubRefusals(http.server.BaseHTTPRequestHandler):
    """Answers every request the way the Hub refuses it: status and X-Error-Code by the repo in the path."""

    def do_GET(self):
        if "/org/gated/" in self.path:
            status, code = 401, "GatedRepo"
        elif "/revision/v9" in self.path:
            status, code = 404, "RevisionNotFound"
        elif "/org/locked/" in self.path:
            status, code = 401, None  # a token the Hub does not accept
        else:
            status, code = 404, "RepoNotFound"
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "refused"}')

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubRefusals)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.slow  # a fresh interpreter (Hub variables are read at import): not make test-fast's
def test_the_hubs_refusals_are_one_line_each(hub, tmp_path, refusing_hub):
    key = {"key": "model_name_or_path"}
    outcomes = resolve_outcomes({
        "gated": {"name": "org/gated", **key},
        "no such repo": {"name": "org/missing", **key},
        "no such revision": {"name": "org/missing", "revision": "v9", **key},
        "bad token": {"name": "org/locked", **key},
        "cached, Hub refusing": {"name": "org/tiny", **key},
    }, hub_env(hub, offline=False, HF_ENDPOINT=refusing_hub), tmp_path)
    assert outcomes == {
        "gated": f"model_name_or_path: org/gated is gated on the Hugging Face Hub: accept its terms on "
                 f"{refusing_hub}/org/gated, then set HF_TOKEN (or run `hf auth login`)",
        "no such repo": "model_name_or_path: org/missing is no local folder, not a model on the Hugging Face Hub "
                        "(a private one needs HF_TOKEN)",
        "no such revision": "model_revision: 'v9' is not a branch, tag or commit of org/missing on the Hugging Face Hub",
        "bad token": "model_name_or_path: org/locked: the Hugging Face Hub answered 401; check HF_TOKEN",
        # huggingface_hub falls back on the cache when the Hub refuses; so does the weights' listing
        "cached, Hub refusing": f"ok {snapshot(hub, 'org/tiny', MAIN)}",
    }


@pytest.mark.slow  # a fresh interpreter (Hub variables are read at import): not make test-fast's
def test_an_unreachable_hub_is_one_line(hub, tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    outcomes = resolve_outcomes({
        "missing": {"name": "org/missing", "key": "model_name_or_path"},
        "cached": {"name": "org/tiny", "key": "model_name_or_path"},
    }, hub_env(hub, offline=False, HF_ENDPOINT=closed), tmp_path)
    assert outcomes == {
        "missing": f"model_name_or_path: org/missing is no local folder, not in the Hugging Face cache ({hub}), and "
                   "the Hub cannot be reached (ConnectError); fetch it with `hf download org/missing`",
        "cached": f"ok {snapshot(hub, 'org/tiny', MAIN)}",
    }


@pytest.mark.slow  # a fresh interpreter (Hub variables are read at import): not make test-fast's
def test_a_run_folder_not_made_yet_is_no_hub_id(hub, tmp_path):
    """examples/kto.yaml before examples/sft_base.yaml: its model_name_or_path, saves/sft_base, is a run folder that
    an example writes, not a Hub id; nor is a typo in a folder where the examples write their runs."""
    with socket.socket() as sock:  # a port nothing listens on: no Hub, as on a laptop offline
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    (tmp_path / "examples" / "real").mkdir(parents=True)
    (tmp_path / "examples" / "sft_base.yaml").write_text("stage: sft\noutput_dir: saves/sft_base\n")
    (tmp_path / "examples" / "real" / "sft.yaml").write_text("output_dir: ./saves/real/sft\n")
    (tmp_path / "examples" / "broken.yaml").write_text("output_dir: [\n")  # not this check's business
    (tmp_path / "saves" / "quickstart").mkdir(parents=True)
    outcomes = resolve_outcomes({
        "id-like": {"name": "saves/sft_base", "key": "model_name_or_path"},
        "a path": {"name": "./saves/sft_base/", "key": "model_name_or_path"},
        "nested": {"name": "saves/real/sft", "key": "reward_model"},
        "typo beside a run": {"name": "saves/sft-base", "key": "model_name_or_path"},
        "a Hub id": {"name": "org/missing", "key": "model_name_or_path"},
    }, hub_env(hub, offline=False, HF_ENDPOINT=closed), tmp_path)
    assert outcomes == {
        "id-like": f"model_name_or_path: saves/sft_base: no such folder in {tmp_path}; examples/sft_base.yaml "
                   "writes it: run `tunelab train examples/sft_base.yaml` first",
        "a path": f"model_name_or_path: ./saves/sft_base/: no such folder in {tmp_path}; examples/sft_base.yaml "
                  "writes it: run `tunelab train examples/sft_base.yaml` first",
        "nested": f"reward_model: saves/real/sft: no such folder in {tmp_path}; examples/real/sft.yaml writes it: "
                  "run `tunelab train examples/real/sft.yaml` first",
        "typo beside a run": f"model_name_or_path: saves/sft-base: no such folder in {tmp_path}; saves/ (where the "
                             "examples write their runs) holds quickstart",
        "a Hub id": f"model_name_or_path: org/missing is no local folder, not in the Hugging Face cache ({hub}), "
                    "and the Hub cannot be reached (ConnectError); fetch it with `hf download org/missing`",
    }


# ---- a run, and loading what it wrote ----------------------------------------------------------------------------


@pytest.mark.slow
def test_train_chat_by_hub_ids(hub, tmp_path):
    """`tunelab train` with a Hub model and a Hub dataset records the commits; the adapter names the Hub id as its
    base, and the chat engine loads it (and the Hub id itself) from the cache."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"reverse": {"hf_hub_url": "org/reverse"}}))
    cfg = write_config(tmp_path, dataset="reverse", dataset_dir=str(tmp_path / "data"), max_steps=2,
                       per_device_train_batch_size=2, cutoff_len=32, report_to="none", logging_steps=1)
    done = run_tunelab(["train", str(cfg)], hub_env(hub), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"

    written = yaml.safe_load((out / "tunelab_config.yaml").read_text())
    assert (written["model_name_or_path"], written["model_revision"]) == ("org/tiny", MAIN)
    run_info = json.loads((out / "run_info.json").read_text())
    assert run_info["hub"] == {"model_name_or_path": {
        "repo_id": "org/tiny", "commit": MAIN, "revision": "main", "folder": snapshot(hub, "org/tiny", MAIN)}}
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == ("org/tiny", MAIN)
    (source,) = json.loads((out / "data_report.json").read_text())["sources"]
    assert source["hub"] == {"repo_id": "org/reverse", "revision": "main", "commit": DATA, "subset": None,
                             "folder": None, "split": "train"}
    assert source["rows"] == 37

    loaded = run_python(f"""
import json
from tunelab.infer.engine import SamplingOptions, load_engine, resolve_folders
adapter = load_engine({str(out)!r})
base = load_engine("org/tiny", template="chatml")
answer = adapter.complete([{{"role": "user", "content": "w5 w6"}}], SamplingOptions(temperature=0, max_new_tokens=4))
print(json.dumps([resolve_folders({str(out)!r}), resolve_folders("org/tiny"),
                  type(adapter.model).__name__, type(base.model).__name__, answer.completion_tokens]))
""", hub_env(hub), tmp_path)
    assert loaded[:4] == [[snapshot(hub, "org/tiny", MAIN), str(out)], [snapshot(hub, "org/tiny", MAIN), None],
                          "PeftModelForCausalLM", "LlamaForCausalLM"]
    assert 1 <= loaded[4] <= 4  # it answers

    # The written config reruns the same commit, here as an eval of the adapter by its pinned revision.
    rerun = config_outcomes({"rerun": (str(out / "tunelab_config.yaml"), [f"output_dir={tmp_path / 'again'}"])},
                            hub_env(hub), tmp_path)
    assert rerun == {"rerun": f"ok {snapshot(hub, 'org/tiny', MAIN)}"}
