"""`agentrl eval` (`run_eval`) of `env=openenv` against the example OpenEnv server started by agentrl
for each episode (`env.kwargs.command`), with a scripted policy: the real chat template, AgentLoop,
adapter, OpenEnv client and server. It guards that guesses reach the server as actions and its
answers come back as user turns, that the server's rewards are the episode's, that a server killed
mid-episode makes that episode an infrastructure failure (masked, counted, never scored 0) while the
others complete, and that no server process outlives its episode.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import load_config
from agentrl.envs import check_env, make_env
from agentrl.errors import InfraFailureError
from agentrl.inference.protocol import Generation, SamplingParams
from agentrl.orchestration.evaluate import run_eval

pytest.importorskip("openenv.core")
pytestmark = pytest.mark.slow

SERVER = Path(__file__).resolve().parents[1] / "openenv" / "dying_guess_server.py"
DYING_SEED = 13


def secret(seed: int) -> int:
    """The example server's secret for `seed` (examples/openenv_guess_server.py)."""
    return random.Random(seed).randint(1, 10)


class GuessingPolicy:
    """Guesses the secret of seed 1 at once; for any other seed guesses 11 (always wrong)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        prompt = self.tok.decode(prompt_ids)
        guess = secret(1) if "Seed 1." in prompt else 11
        ids = self.tok.encode(f"{guess}<|im_end|>", add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


def _guess_servers() -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(SERVER) in line]


def test_eval_of_an_openenv_server_scores_its_rewards_and_masks_a_server_that_died(
        assets: Path, tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    with rows.open("w") as f:
        for seed in (1, 2, DYING_SEED):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"Seed {seed}. Play the game."}],
                                "data_source": "openenv", "extra_info": {"seed": seed}}) + "\n")
    config = load_config(overrides=[
        "env=openenv", f"model.path={assets / 'tiny-random-qwen2'}", f"data.val_files=[{rows}]",
        f"env.kwargs.command=[python, {SERVER}, --port, '{{port}}']", "env.kwargs.message_timeout_s=20",
        "env.kwargs.startup_timeout_s=120", "eval.k=1", "rollout.max_turns=6", "run.max_infra_failure_rate=0.2",
        f"eval.output_dir={tmp_path / 'eval'}"])
    policy = GuessingPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer)
    with pytest.raises(InfraFailureError, match="1 of 3 evaluation episodes failed for infrastructure"):
        run_eval(config, client=policy)

    episodes = {}
    for line in (tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines():
        episode = json.loads(line)
        seed = next(s for s in (1, 2, DYING_SEED) if f"Seed {s}." in json.dumps(episode["messages"]))
        episodes[seed] = episode
    won, lost, died = episodes[1], episodes[2], episodes[DYING_SEED]
    assert [(m["role"], m["content"]) for m in won["messages"][1:]] == [  # the reset observation, then the guess
        ("user", "I picked a number from 1 to 10. Guess it: answer with one number. You have 4 tries."),
        ("assistant", str(secret(1)))]
    assert (won["reward"], won["fault"], won["finish_reason"]) == (1.0, None, "done")
    # four wrong guesses: the server ends the game, reward 0 measured by the server
    lost_answers = [m["content"] for m in lost["messages"] if m["role"] == "user"][2:]
    assert lost_answers == ["lower", "lower", "lower"]
    assert (lost["reward"], lost["fault"], lost["finish_reason"]) == (0.0, None, "done")
    assert died["fault"] == "infra" and "OpenEnv server" in died["error"]
    assert _guess_servers() == []  # every server agentrl started is gone


def test_the_openenv_adapter_passes_check_env_against_a_running_server(openenv_guess_url: str) -> None:
    check_env(make_env("openenv", url=openenv_guess_url))
