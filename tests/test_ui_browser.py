"""The web app in a real browser: headless Chromium (Debian's chromium + chromedriver, installed by
.ci/run) uploads the bundled sample, asks a question, sees the streamed answer and opens a citation;
the page is saved as a screenshot (pytest's tmp dir and out/ui-screenshot.png). Real Gemma 3 270M; the
answer-length control under a saved cap of 1024 with a tiny random-weight model."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from ldqa.app.api import LongDocQA  # noqa: E402
from ldqa.app.ui import UIConfig, build_app, launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "app" / "sample" / "docs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--window-size=1440,1000"]
QUESTION = "What is the maximum load of lumber the Korvel SL-30 kiln chamber holds?"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                       reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
                              ".ci/run installs them)"),
]


def start(store: Path, model: str, max_new_tokens: int):
    """(url, app) of a server on a free localhost port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = UIConfig(max_new_tokens=max_new_tokens)
    app = build_app(LongDocQA(store=store, model=model), cfg)
    return launch(app, cfg, port=port, block=False), app


@pytest.fixture
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)  # no Selenium Manager download
    yield driver
    driver.quit()


def test_upload_ask_and_open_a_citation(browser, tmp_path):
    url, app = start(tmp_path / "store", "gemma3-270m", max_new_tokens=24)
    try:
        wait = WebDriverWait(browser, 300)
        browser.get(url)
        # an empty collection opens on the Documents tab: upload all four sample files at once
        upload = wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#ldqa-upload input[type=file]")))
        upload.send_keys("\n".join(str(p) for p in sorted(SAMPLE.iterdir())))
        results = "#ldqa-ingest-results"
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, results).text.count("added") == 4)
        assert "4 documents" in browser.find_element(By.ID, "ldqa-header").text

        browser.find_element(By.XPATH, "//button[@role='tab'][normalize-space()='Chat']").click()
        box = wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, "#ldqa-question textarea")))
        box.send_keys(QUESTION)
        browser.find_element(By.ID, "ldqa-ask").click()
        chat = browser.find_element(By.ID, "ldqa-chat")
        wait.until(lambda d: "TTFT" in chat.text)  # the answer finished (the timing line comes last)
        assert QUESTION in chat.text and "3.2 cubic metre" in chat.text
        citation = chat.find_element(By.XPATH, ".//*[starts-with(normalize-space(text()), '[1] ')]")
        citation.click()  # opens the cited passage with the cited sentence highlighted
        mark = wait.until(lambda d: next((m for m in chat.find_elements(By.TAG_NAME, "mark") if m.is_displayed()),
                                         False))
        assert "3.2 cubic metre" in mark.text
        table = browser.find_element(By.ID, "ldqa-passages").text
        assert "fused" in table and "BM25" in table and "sl30_manual.md" in table
    finally:
        shot = tmp_path / "ui-screenshot.png"
        browser.save_screenshot(str(shot))  # also on failure: the artifact shows what the page looked like
        (ROOT / "out").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "out" / "ui-screenshot.png")
        app.close()


def test_a_saved_answer_cap_of_1024_is_shown_and_asks(browser, tmp_path, tiny_model_dir):
    """`ldqa ask ... --max-new-tokens 1024 --save-settings`, then the web app: its answer-length control
    shows 1024 (up to the model's window) and a question goes through (a tiny model, an empty collection)."""
    store, model = tmp_path / "store", str(tiny_model_dir("gemma3"))
    LongDocQA(store=store, model=model).save_answer_settings(1024)
    qa = LongDocQA(store=store, model=model)
    cfg = UIConfig(max_new_tokens=qa.max_new_tokens)  # as `ldqa serve` makes it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(qa, cfg)
    try:
        url = launch(app, cfg, port=port, block=False)
        wait = WebDriverWait(browser, 300)
        browser.get(url)
        wait.until(EC.element_to_be_clickable((By.XPATH, "//button[@role='tab'][normalize-space()='Chat']"))).click()
        browser.find_element(By.XPATH, "//button[.//*[normalize-space()='Settings'] or normalize-space()='Settings']"
                             ).click()
        cap = wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, "input[aria-label='number input for Max new tokens']")))
        assert cap.get_attribute("value") == "1024" and cap.get_attribute("max") == str(qa.context_length)
        box = wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, "#ldqa-question textarea")))
        box.send_keys("What is the maximum load?")
        browser.find_element(By.ID, "ldqa-ask").click()
        chat = browser.find_element(By.ID, "ldqa-chat")
        wait.until(lambda d: "No documents yet" in chat.text)  # answered from the (empty) collection
        assert "greater than maximum" not in browser.page_source
    finally:
        browser.save_screenshot(str(tmp_path / "ui-answer-cap.png"))
        app.close()
