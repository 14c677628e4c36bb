"""A real run, looked at: the rollouts each step keeps, `agentrl plot`, and `agentrl view` in Chromium.

The run is `short_run` (tests/e2e/conftest.py): two steps of the tiny random Qwen2 on a two-turn
env, through vLLM, Ray and FSDP2, keeping two groups per step. Checked: each step's file holds the
best and the worst group, every line turns back into a valid ledger whose `trained` flags agree
with the prompt ledger, and the trained ones carry the trainer's logprob and entropy of each sampled
token beside the rollout's; the dashboard has the time split and the writer's own time; the page shows
each token of an episode with its origin's colour and the trained underline exactly where the
ledger says, and its rollout logprob and policy version on hover; a screenshot is kept.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

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

pytestmark = pytest.mark.slow


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_each_step_keeps_its_best_and_worst_groups(short_run: Path) -> None:
    from agentrl.records.trajectory_log import FORMAT, read_trajectory_file, trajectory_from_record

    trained = {(e["step"], e["uid"]) for e in lines(short_run / "ledger.jsonl") if e["status"] == "trained"}
    files = sorted((short_run / "rollouts").glob("step-*.jsonl"))
    assert [f.name for f in files] == ["step-000001.jsonl", "step-000002.jsonl"]
    for step, path in enumerate(files, start=1):
        records = read_trajectory_file(path)
        kept = {r["group_id"]: r["kept_as"] for r in records}
        assert 2 <= len(kept) <= 3
        # one group can be both the best and the worst (when every group's reward ties)
        assert any("best" in why for why in kept.values()) and any("worst" in why for why in kept.values())
        for r in records:
            assert r["format"] == FORMAT and r["step"] == step and r["source"] == "train"
            t = trajectory_from_record(r)
            t.validate()
            assert len(t) == r["num_tokens"] and {s["origin"] for s in r["segments"]} <= {"prompt", "sampled", "template", "tool"}
            uid = r["group_id"].rsplit("-a", 1)[0]
            assert r["trained"] == ((step - 1, uid) in trained and t.trainable)
            # Beside the rollout's logprobs, the trainer's of every trained token (the same weights,
            # so close to them), and its entropy; nothing of the kind on what was not trained.
            for seg in (s for s in r["segments"] if s["origin"] == "sampled"):
                if r["status"] != "trained" or not t.trainable:
                    assert "trainer_logprobs" not in seg
                    continue
                assert None not in seg["trainer_logprobs"] and None not in seg["trainer_entropy"]
                gaps = [abs(a - b) for a, b in zip(seg["logprobs"], seg["trainer_logprobs"], strict=True)]
                assert sum(gaps) / len(gaps) < 0.5 and all(e >= 0 for e in seg["trainer_entropy"])
    origins = {s["origin"] for path in files for r in read_trajectory_file(path) for s in r["segments"]}
    assert origins == {"prompt", "sampled", "template", "tool"}, "two-turn episodes hold every origin"
    evals = read_trajectory_file(short_run / "eval" / "step-000000" / "trajectories.jsonl")
    assert len(evals) == 4 and all(r["source"] == "eval" and not r["trained"] for r in evals)
    metrics = lines(short_run / "metrics.jsonl")
    for m in metrics:
        assert 0 < m["time/rollout_log_s"] < m["time/step_s"]
        split = sum(m[f"time/split/{k}"] for k in ("wait_rollout_s", "train_s", "weights_s", "other_s"))
        assert split == pytest.approx(m["time/step_s"])


def test_plot_draws_the_real_runs_dashboard(short_run: Path) -> None:
    from agentrl.records.plot import plot_run

    written = {p.name for p in plot_run(short_run)}
    assert {"dashboard.png", "reward.png", "finish_reasons.png", "time_split.png", "held_out_pass_k.png"} <= written
    print(f"dashboard: {short_run / 'plots' / 'dashboard.png'}")


def test_the_viewer_shows_what_was_sampled_and_trained(short_run: Path) -> None:
    need_browser()  # before selenium is imported: it skips, naming what to install
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from agentrl.records.trajectory_log import read_trajectory_file

    records = read_trajectory_file(short_run / "rollouts" / "step-000002.jsonl")
    # An episode with every origin, trained on, if the step has one (two turns with the env between).
    pick = next((i for i, r in enumerate(records) if r["trained"] and r["num_turns"] == 2), 0)
    with chromium() as browser, agentrl_view(short_run) as url:
        browser.get(url)
        wait_ready(browser)
        options = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#source option")]
        assert options == ["step 1 rollouts", "step 2 rollouts", "eval before training", "eval after step 2"]
        assert browser.find_element(By.ID, "episode-count").text == f"{len(records)} of {len(records)} episodes"
        panels = [p.get_attribute("data-title") for p in browser.find_elements(By.CSS_SELECTOR, "#curves .panel")]
        assert {"Reward", "Finish reasons", "Time split", "Held-out pass@k"} <= set(panels)

        browser.find_element(By.CSS_SELECTOR, f"#episodes tr.row[data-index='{pick}']").click()
        WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#episode .tok"))
        record = records[pick]
        shown = check_tokens_match_ledger(browser, record)
        assert sum(t["mask"] == "1" for t in shown) == (record["num_sampled"] if record["trained"] else 0)

        # Hover a sampled token: its rollout logprob and the policy version that sampled it.
        sampled = next(t for t in shown if t["origin"] == "sampled")
        span = browser.find_element(By.CSS_SELECTOR, f"#episode .tok[data-i='{sampled['i']}']")
        ActionChains(browser).move_to_element(span).perform()
        tip = browser.find_element(By.ID, "tooltip")
        WebDriverWait(browser, 10).until(lambda d: tip.is_displayed())
        assert f"rollout logprob {sampled['lp']:.4f}" in tip.text
        assert f"sampled by policy v{sampled['version']}" in tip.text
        assert ("in the loss (trained)" if record["trained"] else "masked: not in the loss") in tip.text
        screenshot(browser, "viewer-real-run-episode")
        assert page_errors(browser) == []
