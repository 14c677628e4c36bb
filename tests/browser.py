"""A real browser for the tests: Debian's headless Chromium driven through its own chromedriver.

Nothing is downloaded at run time: Selenium is given the browser and driver paths explicitly, and
Selenium Manager (which would fetch drivers from the internet) is made to fail loudly if anything
ever calls it. Chromium starts with a fresh profile and without its background network traffic
(which the closed network here would refuse). `agentrl view` runs as the user runs it: the console
command in a subprocess, its URL read from what it prints.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1500,1000")


def need_browser() -> None:
    """Skip (naming what is missing) where the browser, its driver or selenium are not installed."""
    pytest.importorskip("selenium", reason="selenium is a dev extra: pip install -e '.[dev]'")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            pytest.skip(f"{path} is missing: apt-get install chromium chromium-driver")


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (a selenium WebDriver) with a fresh profile; quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common import selenium_manager

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("Selenium Manager must never run here: it downloads drivers")

    selenium_manager.SeleniumManager.binary_paths = refuse  # type: ignore[method-assign,assignment]
    profile = tempfile.mkdtemp(prefix="agentrl-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@contextlib.contextmanager
def agentrl_view(path: str | Path, timeout_s: float = 120.0) -> Iterator[str]:
    """Run `agentrl view PATH` (a free port on 127.0.0.1) and yield the URL it prints."""
    agentrl = Path(sys.executable).with_name("agentrl")
    command = [str(agentrl)] if agentrl.exists() else [sys.executable, "-m", "agentrl.cli"]
    proc = subprocess.Popen([*command, "view", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline() if proc.stdout else ""
            if "http://" in line:
                break
        match = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert match, f"agentrl view printed no local URL: {line!r} {proc.stderr.read() if proc.poll() is not None and proc.stderr else ''}"
        yield match.group(0)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(driver: Any, timeout_s: float = 60.0) -> None:
    """Wait until the page has loaded its run (body[data-ready])."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout_s).until(
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    state = driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready")
    assert state == "1", driver.find_element(By.ID, "main").text


def show_curves(driver: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    """Click "curves" and wait until the dashboard (fetched on the click) is drawn; its panels by title."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.ID, "show-curves").click()
    WebDriverWait(driver, timeout_s).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#curves .panel"))
    return {p.get_attribute("data-title"): p for p in driver.find_elements(By.CSS_SELECTOR, "#curves .panel")}


def screenshot(driver: Any, name: str) -> Path:
    """Save a screenshot under tests/artifacts/ (ignored by git) and print where it went."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


def page_errors(driver: Any) -> list[str]:
    """The page's JavaScript errors so far (console messages at SEVERE level)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def shown_tokens(driver: Any) -> list[dict[str, Any]]:
    """Every token span of the open episode, as the page shows it: index, origin, mask, text,
    computed colours, rollout logprob and policy version (one script call, not one per token)."""
    return driver.execute_script("""
        return [...document.querySelectorAll('#episode .turn .tok[data-i]')].map((s) => {
          const style = getComputedStyle(s);
          return {i: Number(s.dataset.i), origin: s.dataset.origin, mask: s.dataset.mask, text: s.textContent,
                  background: style.backgroundColor, underline: style.boxShadow,
                  lp: s.dataset.lp === undefined ? null : Number(s.dataset.lp),
                  version: s.dataset.v === undefined ? null : Number(s.dataset.v)};
        });""")


def legend_colours(driver: Any) -> dict[str, str]:
    """The background of each legend sample (`o-prompt m0`, `o-sampled m1`, ...)."""
    return driver.execute_script("""
        const out = {};
        for (const s of document.querySelectorAll('.legend-bar .tok')) out[s.className.replace('tok ', '')] = getComputedStyle(s).backgroundColor;
        return out;""")


_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(text: str) -> str:
    """`text` as the page draws model output: each bidi control character as an escape, ⟨U+202E⟩."""
    return _BIDI.sub(lambda m: f"⟨U+{ord(m.group()):04X}⟩", text)


def check_tokens_match_ledger(driver: Any, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Assert that the open episode shows exactly the ledger of `record` (a trajectory-file line):
    every token once, in order, with its text (bidi controls drawn visibly), its origin's colour
    (the legend's), the trained underline exactly on the sampled tokens of a trained episode, and
    its logprob and version."""
    shown = shown_tokens(driver)
    ledger = []
    for seg in record["segments"]:
        for j, piece in enumerate(seg["pieces"]):
            ledger.append({"origin": seg["origin"], "text": visible(piece),
                           "lp": seg["logprobs"][j] if "logprobs" in seg else None, "version": seg.get("version")})
    assert [t["i"] for t in shown] == list(range(len(ledger))) == list(range(record["num_tokens"]))
    legend = legend_colours(driver)
    for t, want in zip(shown, ledger, strict=True):
        trained = bool(record["trained"]) and want["origin"] == "sampled"
        assert (t["origin"], t["text"], t["lp"], t["version"]) == (want["origin"], want["text"], want["lp"], want["version"]), t
        assert t["mask"] == ("1" if trained else "0"), t
        assert t["background"] == legend[f"o-{want['origin']} m{int(trained)}"], t
        assert (t["underline"] != "none") == trained, t
    colours = {f"o-{t['origin']} m{t['mask']}": t["background"] for t in shown}
    assert len(set(colours.values())) == len(colours), f"two kinds of token share a colour: {colours}"
    return shown
