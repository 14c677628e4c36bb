"""`agentrl eval` (`run_eval`) of `env=verifiers` over a verifiers 0.4 taskset written as its docs show
(tests/verifiers_tasks), with a scripted policy: the real chat template, AgentLoop, adapter and the
taskset's own `Task.score`, run in the verifiers worker process (verifiers installed in its own folder).
It guards that the rows are the taskset's tasks with their system prompt, that the reward is the task's
`@vf.reward` of the model's reply (1 right, 0 wrong) with its metrics, that a rubric that raises or
hangs past `score_timeout_s` masks the episode (fault infra), and that a worker SIGKILLed while it
scores an episode masks that episode while the later ones are scored by a fresh worker, with no
worker process left once the eval is over, nor once a driver that started one is SIGKILLed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import load_config
from agentrl.envs.verifiers_process import WORKER_PATH
from agentrl.errors import InfraFailureError
from agentrl.inference.protocol import Generation, SamplingParams
from agentrl.orchestration.evaluate import run_eval

pytestmark = [pytest.mark.slow, pytest.mark.verifiers]

TASKSET = Path(__file__).resolve().parents[1] / "verifiers_tasks" / "sums_with_broken_rubrics.py"


class SummingPolicy:
    """Boxes the true sum, except for the task named 'wrong', where it boxes the sum plus one."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        prompt = self.tok.decode(prompt_ids)
        name, a, b = re.findall(r"Task (\w+): what is (\d+) \+ (\d+)\?", prompt)[-1]
        total = int(a) + int(b) + (name == "wrong")
        ids = self.tok.encode(f"It is \\boxed{{{total}}}.<|im_end|>", add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


def test_eval_of_a_verifiers_taskset_scores_with_its_rubric_and_masks_broken_rubrics(
        assets: Path, tmp_path: Path) -> None:
    config = load_config(overrides=[
        "env=verifiers", f"env.kwargs.id={TASKSET}", "env.kwargs.score_timeout_s=2",
        f"model.path={assets / 'tiny-random-qwen2'}", "eval.k=1", "run.max_infra_failure_rate=0.2",
        # one episode at a time, in row order: the worker is killed while it scores the first only
        "rollout.max_concurrent_episodes=1", f"eval.output_dir={tmp_path / 'eval'}"])
    policy = SummingPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer)
    with pytest.raises(InfraFailureError, match="3 of 5 evaluation episodes failed for infrastructure"):
        run_eval(config, client=policy)

    episodes = {}
    for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines():
        episode = json.loads(line)
        episodes[re.findall(r"Task (\w+):", json.dumps(episode["messages"]))[0]] = episode
    right, wrong = episodes["right"], episodes["wrong"]
    assert [m["role"] for m in right["messages"]] == ["system", "user", "assistant"]
    assert right["messages"][0]["content"] == "Box the answer."
    assert (right["reward"], right["fault"], right["finish_reason"]) == (1.0, None, "done")
    assert right["metrics"]["reward/correct"] == 1.0
    assert right["metrics"]["reply_chars"] == len("It is \\boxed{5}.")
    assert (wrong["reward"], wrong["fault"]) == (0.0, None)
    assert episodes["raises"]["fault"] == "infra" and "the grader crashed" in episodes["raises"]["error"]
    assert episodes["hangs"]["fault"] == "infra" and "did not finish within 2 s" in episodes["hangs"]["error"]
    dies = episodes["dies"]
    assert (dies["fault"], dies["reward"]) == ("infra", None)
    assert "the verifiers worker" in dies["error"] and "was killed by signal 9" in dies["error"]
    # the episodes after it were scored by a fresh worker; none is left now the eval is over
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert [line for line in ps.splitlines() if WORKER_PATH in line] == []


DRIVER = """
import sys, time
from agentrl.envs.verifiers_process import VerifiersWorker
worker = VerifiersWorker()
tasks = worker.tasks(sys.argv[1], {}, 3)
print(len(tasks), worker.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: str) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie is dead, waiting for whoever adopted it to reap it


def test_the_worker_dies_with_a_driver_killed_by_sigkill() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(TASKSET)], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None
        count, pid = driver.stdout.readline().split()
        assert count == "3" and _alive(pid)
        driver.kill()  # SIGKILL: no cleanup of its own runs
        driver.wait()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the verifiers worker outlived its driver"
    finally:
        driver.kill()
