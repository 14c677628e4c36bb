"""`agentrl view` as a user runs it: the console command serves a page that a real browser loads.

The run directory is made of real ledgers (tests/viewer_runs.py: the Qwen2.5 template
delta-tokenises tool-calling episodes, the real `RolloutLog` keeps each step's sample); Debian's
headless Chromium loads the page over loopback (tests/browser.py). Checked: the JSON API and its
refusals, the episode list and its filters, tool calls and their results, the reward and why,
token colours and masks against the ledger, the curves and the panels left out. A run that went
wrong (tests/viewer_runs.py `make_failing_run`): tool calls and results under the model's own turns
when the prompt holds assistant messages (the retool preset's worked examples, a chat-history
row), a bidi override that reorders nothing after its token, lines that are not episodes counted,
the stopped-run file, and reward, pass@k and infrastructure failures drawn at 0. A run with a ~2 MB
tool output (`make_big_run`): its episode comes gzip-compressed and draws folded at once, and the
page answers clicks while the rest is drawn; a 200-turn episode compaction played in three contexts
(`long_eval`): each segment shows as such, every turn and token drawn; the off-policy overlay colours the token whose trainer
logprob was set apart from the rollout's. A run directory with only its config: a waiting page
that fills in when the first kept rollouts are written.
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
    show_curves,
    wait_ready,
)
from viewer_runs import ENTROPY, GAP, NOT_EPISODES, QWEN25, make_big_run, make_failing_run, make_run_dir

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not QWEN25.is_dir(), reason=f"tokenizer assets not found under {QWEN25}")]


@pytest.fixture(scope="module")
def calc_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.chat import ChatTemplate

    return make_run_dir(tmp_path_factory.mktemp("viewer") / "calc-run", ChatTemplate.from_pretrained(QWEN25))


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.chat import ChatTemplate

    return make_failing_run(tmp_path_factory.mktemp("viewer") / "failing-run", ChatTemplate.from_pretrained(QWEN25))


@pytest.fixture(scope="module")
def big_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    from agentrl.chat import ChatTemplate

    return make_big_run(tmp_path_factory.mktemp("viewer") / "big-run", ChatTemplate.from_pretrained(QWEN25))


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
        listed = httpx.get(url + "api/episodes", params={"source": "rollouts/step-000003"}).json()
        assert listed["skipped_lines"] == 0
        episodes = listed["episodes"]
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
        panels = show_curves(browser)
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


def test_the_api_skips_lines_that_are_not_episodes_and_serves_the_stopped_run_file(failing_run: Path) -> None:
    with agentrl_view(failing_run) as url:
        listed = httpx.get(url + "api/episodes", params={"source": "rollouts/step-000001"})
        assert listed.status_code == 200  # `null` and `[1, 2]` lines no longer drop the connection
        assert listed.json()["skipped_lines"] == len(NOT_EPISODES) == 6
        assert [e["episode_id"] for e in listed.json()["episodes"]] == ["fs-0", "fs-1", "ch-0", "ch-1", "bidi"]
        stopped = httpx.get(url + "api/episodes", params={"source": "rollouts/step-000003-stopped"}).json()
        assert [(e["episode_id"], e["kept_as"]) for e in stopped["episodes"]] == [
            ("stopped", ["stopped"]), ("stopped-tool", ["stopped"])]
        one = httpx.get(url + "api/episode", params={"source": "rollouts/step-000003-stopped", "index": 0}).json()
        assert one["kept_as"] == ["stopped"] and one["num_turns"] == 0


def _section(browser, side: str, turn: int):
    from selenium.webdriver.common.by import By

    [section] = browser.find_elements(By.CSS_SELECTOR, f"#episode .turn[data-side='{side}'][data-turn='{turn}']")
    return section


def _open(browser, index: int) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.find_element(By.CSS_SELECTOR, f"#episodes tr.row[data-index='{index}']").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episode .tok")
                                     and d.execute_script("return location.hash").endswith(f"episode={index}"))


def test_tool_calls_and_results_sit_under_the_models_own_turns(browser, failing_run: Path) -> None:
    from selenium.webdriver.common.by import By

    from agentrl.records.trajectory_log import read_trajectory_file

    records = read_trajectory_file(failing_run / "rollouts" / "step-000001.jsonl")
    with agentrl_view(failing_run) as url:
        browser.get(url + "#source=rollouts/step-000001")
        wait_ready(browser)
        assert browser.find_element(By.ID, "episode-count").text == "5 of 5 episodes"
        assert browser.find_element(By.ID, "skipped-lines").text.startswith("6 lines of this file are not an episode")

        # The retool preset's prompt: two worked examples, four assistant messages before the model's.
        _open(browser, 0)
        sides = [(s.get_attribute("data-side"), s.get_attribute("data-turn"))
                 for s in browser.find_elements(By.CSS_SELECTOR, "#episode .turn")]
        assert sides == [("prompt", "0"), ("assistant", "1"), ("env", "1"), ("assistant", "2")]
        [call] = _section(browser, "assistant", 1).find_elements(By.CSS_SELECTOR, ".call")
        assert call.text.startswith("tool call python") and "print(12*7)" in call.text
        [result] = _section(browser, "env", 1).find_elements(By.CSS_SELECTOR, ".result")
        assert result.text.startswith("result of python") and result.text.endswith("84")  # not the example's 5468
        assert "10 messages, 4 of them the assistant's" in _section(browser, "prompt", 0).find_element(By.TAG_NAME, "h3").text
        assert _section(browser, "assistant", 2).find_elements(By.CSS_SELECTOR, ".call, .result") == []
        assert "final answer\nThe answer is \\boxed{85}." in browser.find_element(By.ID, "why").text
        check_tokens_match_ledger(browser, records[0])
        screenshot(browser, "viewer-few-shot-episode")

        # A chat-history row: the user's earlier exchange is prompt, not the model's turn 1.
        _open(browser, 2)
        [call] = _section(browser, "assistant", 1).find_elements(By.CSS_SELECTOR, ".call")
        assert "calculator" in call.text and '"expression": "12*7"' in call.text
        [result] = _section(browser, "env", 1).find_elements(By.CSS_SELECTOR, ".result")
        assert result.text.startswith("result of calculator") and result.text.endswith("84")
        assert "3 messages, 1 of them the assistant's" in _section(browser, "prompt", 0).find_element(By.TAG_NAME, "h3").text
        assert "Ada" not in browser.find_element(By.CSS_SELECTOR, "#episode .turn.env").text
        check_tokens_match_ledger(browser, records[2])
        assert page_errors(browser) == []


def test_a_bidi_override_reorders_nothing_drawn_after_it(browser, failing_run: Path) -> None:
    from selenium.webdriver.common.by import By

    from agentrl.records.trajectory_log import read_trajectory_file

    record = read_trajectory_file(failing_run / "rollouts" / "step-000001.jsonl")[4]
    with agentrl_view(failing_run) as url:
        browser.get(url + "#source=rollouts/step-000001&episode=4")
        wait_ready(browser)
        spans = _section(browser, "assistant", 2).find_elements(By.CSS_SELECTOR, ".tok")
        texts = [s.get_attribute("textContent") for s in spans]
        at = next(i for i, t in enumerate(texts) if "\u202e" in t or "⟨U+202E⟩" in t)
        boxes = browser.execute_script(
            "return arguments[0].map((s) => { const b = s.getBoundingClientRect(); return [b.left, b.top]; });",
            spans[at:at + 8])
        assert texts[at + 1:at + 4] == ["The", " answer", " is"]
        # Drawn left to right, on one line, in ledger order: nothing after the override was reversed.
        assert len({round(top) for _, top in boxes}) == 1
        lefts = [left for left, _ in boxes]
        assert lefts == sorted(lefts) and len(set(lefts)) == len(lefts), lefts
        assert {s.value_of_css_property("unicode-bidi") for s in spans} == {"isolate"}
        check_tokens_match_ledger(browser, record)  # every token, the override drawn as ⟨U+202E⟩
        assert "⟨U+202E⟩" in browser.find_element(By.ID, "why").text  # the final answer, too
        assert page_errors(browser) == []


def test_the_stopped_run_and_a_failing_runs_curves(browser, failing_run: Path) -> None:
    from selenium.webdriver.common.by import By

    with agentrl_view(failing_run) as url:
        browser.get(url + "#source=rollouts/step-000003-stopped&episode=0")
        wait_ready(browser)
        chips = browser.find_element(By.CSS_SELECTOR, "#episode .chips").text
        assert "kept as stopped" in chips and "t, h, e" not in chips
        why = browser.find_element(By.ID, "why").text
        assert "final answer\nnone: the model took no turn" in why and "9455" not in why  # not a worked example
        sides = [s.get_attribute("data-side") for s in browser.find_elements(By.CSS_SELECTOR, "#episode .turn")]
        assert sides == ["prompt"]

        panels = show_curves(browser)
        assert {"Reward", "Held-out pass@k", "Infrastructure failures"} <= set(panels)
        assert panels["Reward"].find_element(By.TAG_NAME, "h3").text == "Reward"  # two curves: no 'last'
        assert "alarm" not in panels["Infrastructure failures"].get_attribute("class")
        note = browser.find_element(By.CSS_SELECTOR, "#curves .nothing").text
        assert "KL (always 0)" in note and "Reward" not in note and "pass@k" not in note
        screenshot(browser, "viewer-failing-curves")
        assert page_errors(browser) == []


def test_a_big_episode_comes_compressed_and_draws_folded_while_the_page_answers(browser, big_run) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from agentrl.records.trajectory_log import read_trajectory_file

    run, _ = big_run
    record = read_trajectory_file(run / "rollouts" / "step-000001.jsonl")[1]
    tool = max((s for s in record["segments"]), key=lambda s: len(s["ids"]))
    assert tool["origin"] == "tool" and len(tool["text"]) > 1_900_000 and len(tool["ids"]) > 500_000
    with agentrl_view(run) as url:
        params = {"source": "rollouts/step-000001", "index": 1}
        packed = httpx.get(url + "api/episode", params=params, headers={"Accept-Encoding": "gzip"}, timeout=120)
        assert packed.status_code == 200 and packed.headers["content-encoding"] == "gzip"
        assert packed.json()["segments"][3]["ids"] == tool["ids"]  # decoded, the whole line
        assert packed.num_bytes_downloaded * 10 < len(packed.content)  # ~11 MB of JSON sent as a tenth of it
        plain = httpx.get(url + "api/episode", params=params, headers={"Accept-Encoding": "identity"}, timeout=120)
        assert "content-encoding" not in plain.headers and plain.json()["num_tokens"] == record["num_tokens"]

        browser.get(url + "#source=rollouts/step-000001&episode=1")
        wait_ready(browser)  # the normal wait: before, drawing this episode froze the page for 30-45 s
        env = _section(browser, "env", 1)
        n = sum(len(s["ids"]) for s in record["segments"] if s["origin"] != "sampled" and s["turn"] == 1)
        assert env.get_attribute("data-folded") == str(n)
        button = env.find_element(By.CSS_SELECTOR, ".fold button")
        chars = sum(len(s["text"]) for s in record["segments"] if s["origin"] != "sampled" and s["turn"] == 1)
        assert f"{n:,} tokens, {chars:,} characters in all" in button.text
        assert len(env.find_elements(By.CSS_SELECTOR, ".tok")) == 200  # a preview; the rest on demand
        assert _section(browser, "assistant", 2).find_elements(By.CSS_SELECTOR, ".tok")  # the turn after it is drawn

        button.click()  # draw it all, a chunk per frame
        WebDriverWait(browser, 60).until(lambda d: "drawing" in button.text or not d.find_elements(By.CSS_SELECTOR, ".turn.env .fold"))
        drawn = browser.execute_script("return document.querySelectorAll('.turn.env .tok').length")
        assert drawn > 200
        # The page still answers while it draws: another episode opens at once.
        browser.find_element(By.CSS_SELECTOR, "#episodes tr.row[data-index='0']").click()
        WebDriverWait(browser, 30).until(lambda d: d.execute_script("return location.hash").endswith("episode=0")
                                         and d.find_elements(By.CSS_SELECTOR, "#episode .turn[data-side='env'] .tok"))
        assert browser.find_element(By.CSS_SELECTOR, "#episode .turn[data-side='env']").get_attribute("data-folded") is None
        check_tokens_match_ledger(browser, read_trajectory_file(run / "rollouts" / "step-000001.jsonl")[0])
        assert page_errors(browser) == []


def test_the_overlay_colours_tokens_by_the_trainers_logprob_gap_and_entropy(browser, big_run) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from agentrl.records.trajectory_log import read_trajectory_file

    run, at = big_run
    record = read_trajectory_file(run / "rollouts" / "step-000001.jsonl")[0]
    with agentrl_view(run) as url:
        browser.get(url + "#source=rollouts/step-000001&episode=0")
        wait_ready(browser)
        plain = check_tokens_match_ledger(browser, record)  # overlay off: the origin colours
        assert "passed 1" in browser.find_element(By.ID, "onpolicy").text  # the step's on-policy check
        assert "max_gap 0.125" in browser.find_element(By.ID, "onpolicy").text

        Select(browser.find_element(By.ID, "overlay")).select_by_value("gap")
        colours = {t["i"]: t["background"] for t in _backgrounds(browser)}
        scale = _scale(browser)
        assert colours[at] == scale["hi"]  # a gap of GAP >= the scale's cap: full colour
        sampled = [t["i"] for t in plain if t["origin"] == "sampled" and t["i"] != at]
        assert sampled and all(colours[i] == scale["lo"] for i in sampled)  # the same logprob: no gap
        others = [t for t in plain if t["origin"] != "sampled"]
        assert all(colours[t["i"]] == t["background"] for t in others)  # no trainer value: drawn plainly

        span = browser.find_element(By.CSS_SELECTOR, f"#episode .tok[data-i='{at}']")
        ActionChains(browser).move_to_element(span).perform()
        tip = browser.find_element(By.ID, "tooltip")
        WebDriverWait(browser, 10).until(lambda d: tip.is_displayed())
        lp = next(s for s in record["segments"] if s["origin"] == "sampled")["logprobs"][0]
        assert f"trainer logprob {lp - GAP:.4f}" in tip.text and f"gap |rollout − trainer| {GAP:.4f}" in tip.text
        assert f"trainer entropy {ENTROPY:.4f}" in tip.text

        Select(browser.find_element(By.ID, "overlay")).select_by_value("entropy")
        colours = {t["i"]: t["background"] for t in _backgrounds(browser)}
        hi = _scale(browser)["hi"]
        assert colours[at] == hi and hi != scale["hi"]  # another scale: entropy, not the gap
        assert all(colours[t["i"]] == t["background"] for t in others)

        # An episode the trainer did not score (the big one has no trainer values): nothing to overlay.
        browser.get(url + "#source=rollouts/step-000001&episode=1")
        browser.refresh()
        wait_ready(browser)
        assert browser.find_element(By.ID, "overlay").get_attribute("disabled") is not None
        assert page_errors(browser) == []


def _scale(browser) -> dict[str, str]:
    """The overlay scale's end colours, as computed for the page (the same form as a token's)."""
    return browser.execute_script("""
        const out = {};
        for (const k of ['lo', 'hi']) out[k] = getComputedStyle(document.querySelector('#overlay-scale i.' + k)).backgroundColor;
        return out;""")


def _backgrounds(browser) -> list[dict]:
    return browser.execute_script("""
        return [...document.querySelectorAll('#episode .turn .tok[data-i]')].map((s) =>
          ({i: Number(s.dataset.i), background: getComputedStyle(s).backgroundColor}));""")


def test_a_run_that_has_written_only_its_config_shows_a_waiting_page_that_fills_in(browser, calc_run: Path,
                                                                                    tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from agentrl.records.trajectory_log import read_trajectory_file

    run = tmp_path / "starting"
    run.mkdir()
    (run / "config.yaml").write_text((calc_run / "config.yaml").read_text())
    with agentrl_view(run) as url:  # before: 'holds no run', and the command exited
        browser.get(url)
        wait_ready(browser)
        waiting = browser.find_element(By.ID, "waiting")
        assert "Waiting for the run to write its first step" in waiting.text
        assert "env.name arithmetic" in browser.find_element(By.ID, "run-facts").text

        # The run writes its first step's kept rollouts (as RolloutLog does: a whole file at once).
        (run / "rollouts").mkdir()
        tmp = run / "rollouts" / ".step-000001.jsonl.tmp"
        tmp.write_text((calc_run / "rollouts" / "step-000001.jsonl").read_text())
        tmp.replace(run / "rollouts" / "step-000001.jsonl")
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episodes tr.row"))
        assert browser.find_element(By.ID, "episode-count").text == "6 of 6 episodes"
        _open(browser, 0)
        check_tokens_match_ledger(browser, read_trajectory_file(run / "rollouts" / "step-000001.jsonl")[0])
        assert page_errors(browser) == []


@pytest.fixture(scope="module")
def long_eval(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An `agentrl eval` directory holding one 200-turn recall episode that compaction played in three
    contexts (the scripted note-taking agent of `agentrl.envs.recall`, cutting old tool outputs)."""
    import asyncio

    from agentrl.chat import ChatTemplate
    from agentrl.config import RolloutConfig
    from agentrl.envs.recall import RecallEnv, make_recall_row, scripted_recall_turn
    from agentrl.records.trajectory_log import write_eval_trajectories
    from agentrl.rollout import AgentLoop
    from agentrl.tools.parsers import HermesParser
    from agentrl.types import Generation

    template = ChatTemplate.from_pretrained(QWEN25)
    tok = template.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")

    class Agent:
        async def generate(self, prompt_ids, sampling, *, session_id, timeout_s=None):  # type: ignore[no-untyped-def]
            ids = tok.encode(scripted_recall_turn(tok.decode(prompt_ids), pages=199), add_special_tokens=False)
            return Generation([*ids, end], [-0.2] * (len(ids) + 1), "stop", 1)

    config = RolloutConfig(max_turns=400, max_total_tokens=32768, max_tokens_per_turn=2048, episode_timeout_s=3600,
                           compaction={"policy": "drop_tool_outputs", "tool_output_chars": 0})
    row = make_recall_row(0, pages=199, page_chars=300)
    loop = AgentLoop(Agent(), template, HermesParser(), config)
    segments = asyncio.run(loop.run_episode_segments(RecallEnv(max_turns=400, pages=199, page_chars=300), row=row,
                                                     episode_id="long", group_id="g0"))
    assert [s.segment.of for s in segments] == [3, 3, 3] and segments[-1].metrics["turns"] == 200  # type: ignore[union-attr]
    out = tmp_path_factory.mktemp("viewer") / "eval-recall"
    out.mkdir()
    write_eval_trajectories(out / "trajectories.jsonl", [segments], [row], tok)
    return out


def test_a_200_turn_episode_in_three_segments_is_shown_whole_with_its_compactions(browser, long_eval: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from agentrl.records.trajectory_log import read_trajectory_file

    records = read_trajectory_file(long_eval / "trajectories.jsonl")
    assert sum(r["num_turns"] for r in records) == 200
    with agentrl_view(long_eval) as url:
        browser.get(url)
        wait_ready(browser)
        assert browser.find_element(By.ID, "episode-count").text == "3 of 3 episodes"
        for k, record in enumerate(records):
            browser.find_element(By.CSS_SELECTOR, f"#episodes tr.row[data-index='{k}']").click()
            WebDriverWait(browser, 60).until(
                lambda d, k=k: f"segment: {k + 1} of 3" in d.find_element(By.CSS_SELECTOR, "#episode .chips").text)
            # where the compaction happened: segment k+1 opens on the cut context, as its prompt
            assert f"turns: {record['num_turns']}" in browser.find_element(By.CSS_SELECTOR, "#episode .chips").text
            assistant = browser.find_elements(By.CSS_SELECTOR, "#episode .turn[data-side='assistant']")
            assert len(assistant) == record["num_turns"]  # every turn drawn, none folded away
            # a block over 2,000 tokens (a later segment's prompt: the compacted context) is folded: open it
            for button in browser.find_elements(By.CSS_SELECTOR, "#episode .fold button"):
                button.click()
            try:
                WebDriverWait(browser, 120).until(  # drawn in slices, the page answering in between
                    lambda d, n=record["num_tokens"]: len(d.find_elements(By.CSS_SELECTOR, "#episode .tok")) >= n)
            except Exception:
                drawn = len(browser.find_elements(By.CSS_SELECTOR, "#episode .tok"))
                raise AssertionError(f"segment {k + 1}: {drawn} of {record['num_tokens']} tokens drawn") from None
            check_tokens_match_ledger(browser, record)
        assert not page_errors(browser)
        screenshot(browser, "viewer-long-episode")
