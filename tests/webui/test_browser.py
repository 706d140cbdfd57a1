"""The web UI in headless Chromium (Selenium): configure the quickstart, see a check fail and pass, preview the
data, launch, watch the loss chart grow, stop (a checkpoint), resume to the end, chat with the result, evaluate it.

Skips, saying why, without Debian's chromium / chromium-driver (or selenium). Screenshots of each screen go to
the test's folder; with TUNELAB_WEBUI_SCREENSHOTS=1 also to docs/images/webui_*.png (docs/webui.md shows them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.webui.server import QUICK_FORM, webui_server

pytest.importorskip("fastapi", reason="tunelab webui needs the webui extra (fastapi, uvicorn)")
webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium (pip install selenium)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                       reason="no chromium / chromedriver on PATH (Debian: apt-get install chromium chromium-driver)"),
]
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
STEPS = 10


@pytest.fixture
def browser():
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def shot(driver, folder: Path, name: str) -> None:
    """The whole page (the window grown to its height), in folder and, when asked, in docs/images."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(700, min(height + 40, 2000)))
    path = folder / f"webui_{name}.png"
    driver.save_screenshot(str(path))
    if os.environ.get("TUNELAB_WEBUI_SCREENSHOTS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, DOCS_IMAGES / path.name)
    driver.set_window_size(1400, 1000)


PACE = """import time

import transformers


class Pace(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(1.0)
"""


def fill(driver, values: dict[str, str]) -> None:
    for key, value in values.items():
        element = driver.find_element(By.ID, f"f-{key}")
        if element.tag_name == "select":
            Select(element).select_by_value(value)
        else:
            element.clear()
            element.send_keys(value)


def points(driver, chart: str) -> int:
    """Points drawn in a chart (read in the page: the charts are redrawn at every refresh)."""
    return driver.execute_script(
        "const svg = document.querySelector(arguments[0]); return svg ? Number(svg.dataset.points) : 0", f"#{chart} svg")


def test_configure_launch_watch_stop_resume_chat(browser, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    # On an idle machine the tiny model runs ~8 steps a second: the run would end before Stop is clicked.
    # A user callback (the `callbacks` key, typed into the form's YAML box) paces it to a step a second.
    (root / "pace.py").write_text(PACE, encoding="utf-8")
    wait = WebDriverWait(browser, 300, poll_frequency=0.3)
    with webui_server(root) as url:
        browser.get(url + "/")
        # Configure: the quickstart's values, with a bad cutoff_len first
        fill(browser, {**QUICK_FORM, "cutoff_len": "-3", "max_steps": str(STEPS), "output_dir": "saves/quickstart",
                       "other": "callbacks: [pace.py:Pace]"})
        message = browser.find_element(By.ID, "m-cutoff_len")
        wait.until(lambda d: message.text == "cutoff_len must be at least 2, got -3")
        fill(browser, {"cutoff_len": "64"})
        status = browser.find_element(By.ID, "check-status")
        wait.until(lambda d: status.text == "✓ the config passes the checks of tunelab train")
        assert message.text == ""
        browser.find_element(By.ID, "btn-yaml").click()
        assert "cutoff_len: 64" in browser.find_element(By.ID, "yaml-out").text.splitlines()
        shot(browser, tmp_path, "configure")

        # Data: rendered samples with their supervised spans, the stats and the length histogram
        browser.find_element(By.ID, "tab-data").click()
        browser.find_element(By.ID, "btn-preview").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#examples .sup"))
        assert browser.find_element(By.CSS_SELECTOR, "#stats-lines li").text.startswith("train: 200 samples")
        assert points(browser, "histogram") > 0
        shot(browser, tmp_path, "data")

        # Launch and watch the loss chart gain points
        browser.find_element(By.ID, "tab-configure").click()
        browser.find_element(By.ID, "btn-start").click()
        wait.until(lambda d: not d.find_element(By.ID, "screen-runs").get_attribute("class").count("hidden"))
        wait.until(lambda d: points(d, "chart-loss") >= 2)
        seen = points(browser, "chart-loss")
        wait.until(lambda d: points(d, "chart-loss") > seen)

        # Stop: SIGTERM, a checkpoint, state "stopped"
        browser.find_element(By.ID, "btn-stop").click()
        state = browser.find_element(By.ID, "run-state")
        wait.until(lambda d: state.text == "stopped")
        assert "checkpoint-" in browser.find_element(By.ID, "checkpoints").text

        # Resume to the last step
        wait.until(lambda d: d.find_element(By.ID, "btn-resume").is_enabled())
        browser.find_element(By.ID, "btn-resume").click()
        wait.until(lambda d: state.text == "finished")
        assert browser.find_element(By.ID, "run-progress-text").text.startswith(f"step {STEPS} of {STEPS}")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#metrics tr"))
        # ticked runs share one loss chart: this one's every logged step
        browser.find_element(By.CSS_SELECTOR, "#runs-table tbody tr .cmp").click()
        wait.until(lambda d: points(d, "compare") == STEPS)
        shot(browser, tmp_path, "runs")

        # Chat with the final model: a streamed answer
        browser.find_element(By.ID, "tab-try").click()
        wait.until(lambda d: any(o.get_attribute("value").endswith("saves/quickstart")
                                 for o in Select(d.find_element(By.ID, "try-run")).options))
        Select(browser.find_element(By.ID, "try-run")).select_by_value(str(root / "saves" / "quickstart"))
        browser.find_element(By.ID, "chat-input").send_keys("Sort the numbers from smallest to largest. 3 1 2")
        browser.find_element(By.ID, "btn-send").click()
        answer = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chat-log .assistant.done"))[0]
        assert answer.text.strip() != ""

        # tunelab eval on a few held-out questions: the predictions beside their references
        browser.find_element(By.ID, "eval-dataset").send_keys("demo_sort_test")
        samples = browser.find_element(By.ID, "eval-samples")
        samples.clear()
        samples.send_keys("5")
        browser.find_element(By.ID, "btn-eval").click()
        wait.until(lambda d: d.find_element(By.ID, "job-status").text.startswith(("✓", "✗")))
        assert browser.find_element(By.ID, "job-status").text.startswith("✓ eval finished")
        rows = browser.find_elements(By.CSS_SELECTOR, "#predictions tr")
        assert len(rows) == 1 + 5  # the header and one row per sample
        shot(browser, tmp_path, "try")
