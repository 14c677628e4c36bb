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
def chromium() -> Iterator[object]:
    """A headless Chromium (a selenium WebDriver) with a fresh profile; quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common import selenium_manager

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("Selenium Manager must never run here: it downloads drivers")

    selenium_manager.SeleniumManager.binary_paths = refuse  # type: ignore[method-assign]
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


def wait_ready(driver: object, timeout_s: float = 60.0) -> None:
    """Wait until the page has loaded its run (body[data-ready])."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout_s).until(  # type: ignore[arg-type]
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
    state = driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready")  # type: ignore[attr-defined]
    assert state == "1", driver.find_element(By.ID, "main").text  # type: ignore[attr-defined]


def screenshot(driver: object, name: str) -> Path:
    """Save a screenshot under tests/artifacts/ (ignored by git) and print where it went."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))  # type: ignore[attr-defined]
    print(f"screenshot: {path}")
    return path


def page_errors(driver: object) -> list[str]:
    """The page's JavaScript errors so far (console messages at SEVERE level)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]  # type: ignore[attr-defined]
