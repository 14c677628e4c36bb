"""`agentrl view` as a user runs it: the console command serves a page that a real browser loads.

The run directory is made of real ledgers (tests/viewer_runs.py: the Qwen2.5 template
delta-tokenises tool-calling episodes, the real `RolloutLog` keeps each step's sample); Debian's
headless Chromium loads the page over loopback (tests/browser.py). Checked: the JSON API and its
refusals, the episode list and its filters, tool calls and their results, the reward and why,
token colours and masks against the ledger, the curves and the panels left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from browser import (
    agentrl_view,
    check_tokens_match_ledger,
    chromium,
    need_browser,
    page_errors,
    screenshot,
    wait_ready,
)
from viewer_runs import QWEN25, make_run_dir

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not QWEN25.is_dir(), reason=f"tokenizer assets not found under {QWEN25}")]


@pytest.fixture(scope="module")
def calc_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.chat import ChatTemplate

    return make_run_dir(tmp_path_factory.mktemp("viewer") / "calc-run", ChatTemplate.from_pretrained(QWEN25))


@pytest.fixture(scope="module")
def browser():
    need_browser()
    with chromium() as driver:
        yield driver


def test_the_server_answers_json_and_refuses_what_is_not_the_run(calc_run: Path) -> None:
    with agentrl_view(calc_run) as url:
        assert url.startswith("http://127.0.0.1:")
        run = httpx.get(url + "api/run").json()
        assert run["kind"] == "run" and len(run["sources"]) == 5
        page = httpx.get(url)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "static/viewer.js" in page.text and "http" not in page.text.replace(url, "")  # nothing from the internet
        js = httpx.get(url + "static/viewer.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"]
        episodes = httpx.get(url + "api/episodes", params={"source": "rollouts/step-000003"}).json()
        assert len(episodes) == 6
        one = httpx.get(url + "api/episode", params={"source": "rollouts/step-000003", "index": 4}).json()
        assert one["episode_id"] == episodes[4]["episode_id"] and one["segments"]
        assert httpx.get(url + "api/episodes", params={"source": "../config.yaml"}).status_code == 404
        assert httpx.get(url + "static/..%2Fsources.py").status_code == 404
        assert httpx.get(url + "api/episode", params={"source": "eval/step-000000", "index": 9}).status_code == 404
        assert httpx.get(url + "nope").status_code == 404
        # A page elsewhere whose name was rebound to 127.0.0.1 is refused.
        assert httpx.get(url + "api/run", headers={"Host": "rebound.example"}).status_code == 403
        assert httpx.get(url.replace("127.0.0.1", "localhost") + "api/run").status_code == 200


def test_the_page_shows_turns_tool_calls_and_what_was_trained(browser, calc_run: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from agentrl.records.trajectory_log import read_trajectory_file

    records = read_trajectory_file(calc_run / "rollouts" / "step-000002.jsonl")
    with agentrl_view(calc_run) as url:
        browser.get(url + "#source=rollouts/step-000002")
        wait_ready(browser)
        count = browser.find_element(By.ID, "episode-count")
        assert count.text == "6 of 6 episodes"
        Select(browser.find_element(By.ID, "f-fault")).select_by_value("infra")
        assert count.text == "2 of 6 episodes"
        Select(browser.find_element(By.ID, "f-fault")).select_by_value("")
        Select(browser.find_element(By.ID, "f-tool")).select_by_value("infra")
        assert count.text == "2 of 6 episodes"
        Select(browser.find_element(By.ID, "f-tool")).select_by_value("")
        browser.find_element(By.ID, "f-reward-min").send_keys("1")
        assert count.text == "2 of 6 episodes"  # the best group, g3
        browser.find_element(By.ID, "f-reward-min").clear()
        browser.execute_script("document.getElementById('f-reward-min').dispatchEvent(new Event('input'))")
        assert count.text == "6 of 6 episodes"

        # The worst group's first episode: trained on, reward 0, answered 85 where 84 was right.
        browser.find_element(By.CSS_SELECTOR, "#episodes tr.row[data-index='0']").click()
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episode .tok"))
        assert browser.find_element(By.ID, "ep-reward").text.startswith("0")
        why = browser.find_element(By.ID, "why").text
        assert "ground truth\n84" in why and "\\boxed{85}" in why and "its group was trained on" in why
        calls = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#episode .call")]
        assert len(calls) == 1 and "calculator" in calls[0] and '"expression": "12*7"' in calls[0]
        results = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#episode .result")]
        assert results == [results[0]] and "result of calculator" in results[0] and results[0].endswith("84")
        sides = [(s.get_attribute("data-side"), s.get_attribute("data-turn"))
                 for s in browser.find_elements(By.CSS_SELECTOR, "#episode .turn")]
        assert sides == [("prompt", "0"), ("assistant", "1"), ("env", "1"), ("assistant", "2")]
        check_tokens_match_ledger(browser, records[0])
        screenshot(browser, "viewer-calc-episode")

        # An infrastructure failure: masked, never scored.
        browser.find_element(By.CSS_SELECTOR, "#episodes tr.row[data-index='2']").click()
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "ep-reward").text.startswith("infra"))
        assert "infrastructure reasons" in browser.find_element(By.ID, "why").text
        shown = check_tokens_match_ledger(browser, records[2])
        assert all(t["mask"] == "0" for t in shown)

        # The curves: the infra panel is raised, flat and missing panels are named, not drawn.
        browser.find_element(By.ID, "show-curves").click()
        panels = {p.get_attribute("data-title"): p for p in browser.find_elements(By.CSS_SELECTOR, "#curves .panel")}
        assert {"Reward", "Held-out pass@k", "Infrastructure failures", "Finish reasons", "Time split"} <= set(panels)
        assert "alarm" in panels["Infrastructure failures"].get_attribute("class")
        assert "KL" not in panels
        note = browser.find_element(By.CSS_SELECTOR, "#curves .nothing").text
        assert "KL (always 0)" in note and "Entropy (not logged)" in note
        screenshot(browser, "viewer-calc-curves")
        assert page_errors(browser) == []


def test_an_eval_directory_opens_on_its_episodes(browser, calc_run: Path) -> None:
    from selenium.webdriver.common.by import By

    with agentrl_view(calc_run / "eval" / "step-000003") as url:
        browser.get(url)
        wait_ready(browser)
        assert browser.find_element(By.ID, "episode-count").text == "2 of 2 episodes"
        assert browser.find_element(By.ID, "show-curves").is_displayed() is False
        browser.find_element(By.CSS_SELECTOR, "#episodes tr.row[data-index='1']").click()
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episode .tok"))
        from agentrl.records.trajectory_log import read_trajectory_file

        record = read_trajectory_file(calc_run / "eval" / "step-000003" / "trajectories.jsonl")[1]
        shown = check_tokens_match_ledger(browser, record)
        assert {t["origin"] for t in shown if t["mask"] == "1"} == set(), "nothing of an evaluation is trained"
        assert "never trained on" in browser.find_element(By.ID, "why").text
