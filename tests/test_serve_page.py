"""The page of `nmt serve` in a real browser: Debian's headless Chromium (/usr/bin/chromium, which
.ci/run installs when it is missing) driven by Selenium through Debian's chromedriver, against a real
server on a loopback port. Nothing is downloaded: Selenium is given both binaries.

Set NMT_SERVE_SCREENSHOT=PATH to keep the screenshot the attention test takes (README.md's picture).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from serving import Server, serve_extra_missing

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
PHONE = (390, 844)  # CSS pixels of a phone-sized window


@pytest.fixture(scope="module")
def page_server(multi30k_run: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    if (why := serve_extra_missing()) is not None:
        pytest.skip(why)
    # fp32, as the reference (conftest's multi30k_fp32_hyp): a sentence alone is translated as in a file
    running = Server([f"en-de={multi30k_run['model']}", "--dtype", "fp32"],
                     tmp_path_factory.mktemp("page") / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("the page tests drive Chromium with selenium (pip install selenium)")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("the page tests need Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver; .ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", f"--window-size={PHONE[0]},{PHONE[1]}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def lines(multi30k_run: dict[str, Path], multi30k_fp32_hyp: Path) -> list[tuple[str, str]]:
    """Each test_2016_flickr line with `nmt translate --dtype fp32`'s translation of it."""
    source = (multi30k_run["raw"] / "test.en").read_text(encoding="utf-8").splitlines()
    return list(zip(source, multi30k_fp32_hyp.read_text(encoding="utf-8").splitlines(), strict=True))


def alpha(colour: str) -> float:
    """The opacity of a CSS colour as the browser reports it: rgba(r, g, b, a), or rgb(r, g, b)."""
    numbers = re.findall(r"[\d.]+", colour)
    return float(numbers[3]) if len(numbers) == 4 else 1.0


def open_page(browser, server: Server) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"http://{server.host}:{server.port}/")
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#pair option"))


def test_the_page_translates_as_nmt_translate_by_button_and_keyboard(page_server, browser, lines) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, page_server)
    assert browser.find_element(By.ID, "pair").get_attribute("value") == "en-de"
    sentence, reference = lines[0]
    box = browser.find_element(By.ID, "source")
    box.send_keys(sentence)
    browser.find_element(By.ID, "translate").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "result").text)
    assert browser.find_element(By.ID, "result").text == reference
    assert "ms" in browser.find_element(By.ID, "time").text
    # keyboard only: Ctrl+Enter in the text box translates; the alternatives list has what was asked
    sentence, reference = lines[1]
    nbest = browser.find_element(By.ID, "nbest")
    nbest.clear()
    nbest.send_keys("3")
    box.clear()
    box.send_keys(sentence, Keys.CONTROL, Keys.ENTER)
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "result").text == reference)
    items = browser.find_elements(By.CSS_SELECTOR, "#alternatives li")
    assert len(items) == 3 and items[0].text.startswith(reference)
    # readable on a phone: nothing wider than the window
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")


def test_the_attention_view_draws_the_cross_attention_of_the_translation(page_server, browser, lines,
                                                                         tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, page_server)
    sentence, reference = lines[2]
    browser.find_element(By.ID, "show-attention").click()
    browser.find_element(By.ID, "source").send_keys(sentence)
    browser.find_element(By.ID, "translate").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "table.attention td"))
    status, _, expected = page_server.post("/v1/attention", {"text": sentence, "translation": reference,
                                                             "source": "en", "target": "de"})
    assert status == 200
    columns = [th.get_attribute("textContent") for th in
               browser.find_elements(By.CSS_SELECTOR, "table.attention thead th")][1:]
    rows = [th.get_attribute("textContent") for th in
            browser.find_elements(By.CSS_SELECTOR, "table.attention tbody th")]
    assert columns == expected["source_labels"] and rows == expected["target_labels"]
    cells = browser.find_elements(By.CSS_SELECTOR, "table.attention td")
    assert len(cells) == len(rows) * len(columns)
    # each cell's colour is its weight: the darkest cell of each row is the row's largest weight
    alphas = [alpha(c.value_of_css_property("background-color")) for c in cells]
    for t, row in enumerate(expected["weights"]):
        drawn = alphas[t * len(columns):(t + 1) * len(columns)]
        assert drawn.index(max(drawn)) == row.index(max(row))
    # the picture in README.md: a desktop-sized window, with alternatives and the attention drawn
    browser.set_window_size(1000, 1100)
    nbest = browser.find_element(By.ID, "nbest")
    nbest.clear()
    nbest.send_keys("3")
    browser.find_element(By.ID, "translate").click()
    WebDriverWait(browser, 60).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#alternatives li")) == 3)
    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    browser.set_window_size(*PHONE)
    if keep := os.environ.get("NMT_SERVE_SCREENSHOT"):
        shutil.copyfile(shot, keep)
