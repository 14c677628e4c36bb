"""`env=openenv` plays an OpenEnv environment agentrl's authors did not write, unchanged: the echo env
that OpenEnv's own CLI generates (`openenv init echo_env`, offline), served from its package directory
as its README says (`uvicorn server.app:app`, `env.kwargs.cwd` the package). Its step reward is
0.1 x the length of the action's text and it never says `done`, so every episode ends at
`rollout.max_turns` (or at a turn cut by its token budget), scored with the rewards its steps gave.

Guards: `agentrl eval` and `agentrl run` (the commands, with the tiny random Qwen2 on the hf engine)
score each episode exactly the sum of 0.1 x len(text) over the turns the server echoed, end it at the
turn budget, balance their books and (run) train only the sampled tokens, never the echo of them; a
server SIGKILLed mid-episode masks that episode (fault infra, reward None) while the others are
scored; the template's `max_concurrent_envs=1` refuses a second session on one `url` with an error
that names the limit and the fix; no server process outlives its episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agentrl.chat import ChatTemplate
from agentrl.config import load_config
from agentrl.envs import make_env
from agentrl.errors import EnvServerError
from agentrl.inference.protocol import Generation, SamplingParams
from agentrl.orchestration.evaluate import run_eval
from agentrl.orchestration.infra import fix_for
from agentrl.types import Action

pytest.importorskip("openenv.core")
pytestmark = pytest.mark.slow

SERVE = "[python, -m, uvicorn, server.app:app, --port, '{port}']"  # the generated README's command
# The random model seldom samples its end-of-turn token: the first 20,000 ids end a turn too, so
# most turns end (within 48 tokens nearly all do) and reach the server as actions.
STOPS = f"rollout.extra_stop_token_ids=[{','.join(str(i) for i in range(20000))}]"
TINY = ("model.chat_template=chatml-tools", "inference.engine=hf", "rollout.max_tokens_per_turn=48",
        "env.kwargs.startup_timeout_s=120", "env.kwargs.message_timeout_s=30")
MAX_TURNS = 3


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package `openenv init echo_env` generates. PATH is empty so the CLI finds no `uv` and
    skips its optional `uv lock`, the one step that would go to the network."""
    where = tmp_path_factory.mktemp("openenv-init")
    empty = where / "no-tools"
    empty.mkdir()
    done = subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env"], cwd=where, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PATH": str(empty)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    package = where / "echo_env"
    assert "max_concurrent_envs=1" in (package / "server" / "app.py").read_text()
    assert "reward = length * 0.1" in (package / "server" / "echo_env_environment.py").read_text()
    return package


def echo_servers(package: Path) -> list[psutil.Process]:
    """Every echo server running (served from `package`) and the lifeline agentrl runs it under."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "server.app:app" in (p.info["cmdline"] or []) and p.cwd() == str(package):
                found.append(p)
    return found


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def agentrl(command: str, assets: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "agentrl.cli", command, *args, f"model.path={assets / 'tiny-random-qwen2'}", *TINY]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    return done


def check_echoed(episode: dict[str, Any]) -> None:
    """The episode's reward is the server's: 0.1 x len(text) for each turn it echoed; the turn budget ended it."""
    assert episode["fault"] is None and episode["error"] is None
    said = [m["content"] for m in episode["messages"] if m["role"] == "assistant"]
    # the reset observation, then one echo per stepped turn but the last (the budget ends the episode
    # before the last step's observation is shown)
    echoes = [json.loads(m["content"]) for m in episode["messages"][1:] if m["role"] == "user"]
    assert echoes[0] == {"echoed_message": "Echo Env environment ready!", "message_length": 0}
    assert [(e["echoed_message"], e["message_length"]) for e in echoes[1:]] == [(s, len(s)) for s in said[:-1]]
    if episode["finish_reason"] == "max_turns":  # the server never says done: the loop's budget ends it
        assert len(said) == MAX_TURNS and episode["info"]["truncated_by"] == "rollout.max_turns"
        stepped = said
    else:  # the last turn ran into its token budget: cut, never sent as an action
        assert episode["finish_reason"] == "max_length" and len(echoes) == len(said)
        stepped = said[:-1]
    assert episode["reward"] == pytest.approx(sum(len(s) * 0.1 for s in stepped))
    assert episode["metrics"]["openenv_steps"] == len(stepped)


def test_agentrl_eval_scores_the_generated_echo_env_by_its_rewards(
        echo_env: Path, assets: Path, tmp_path: Path) -> None:
    done = agentrl("eval", assets, tmp_path, "env=openenv", f"env.kwargs.command={SERVE}", f"env.kwargs.cwd={echo_env}",
                   # one row, two samples (each episode starts a server of its own: seconds each)
                   "eval.k=2", "eval.max_rows=1", f"rollout.max_turns={MAX_TURNS}", STOPS,
                   f"eval.output_dir={tmp_path / 'eval'}")
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    episodes = lines(tmp_path / "eval" / "trajectories.jsonl")
    assert len(episodes) == report["episodes"] == 2 and report["infra_failed_episodes"] == 0
    assert "eval: 2/2 episodes done" in done.stderr
    for episode in episodes:
        check_echoed(episode)
    assert sum(report["finish_reasons"].values()) == 2
    assert report["finish_reasons"].get("max_turns", 0) >= 1
    assert report["mean_reward"] == pytest.approx(sum(e["reward"] for e in episodes) / 2)
    assert echo_servers(echo_env) == []


def test_agentrl_run_trains_on_the_generated_echo_env_and_only_on_sampled_tokens(
        echo_env: Path, assets: Path, tmp_path: Path) -> None:
    from agentrl.orchestration.ledger import journal_balance

    agentrl("run", assets, tmp_path, "env=openenv", f"env.kwargs.command={SERVE}", f"env.kwargs.cwd={echo_env}",
            "trainer.device=cpu", "data.prompts_per_step=1", "rollout.samples_per_prompt=2", "data.num_val_rows=1",
            "eval.k=1", "run.eval_every=0", "run.loggers=[jsonl]", "run.total_steps=1",
            f"rollout.max_turns={MAX_TURNS}", STOPS, f"run.output_dir={tmp_path}", "run.name=echo")
    run_dir = tmp_path / "echo"
    books = journal_balance(run_dir / "ledger.jsonl")
    assert books["trained"] == 1 and books.get("in_flight", 0) == 0
    assert [m["step"] for m in lines(run_dir / "metrics.jsonl")] == [0]
    episodes = [e for f in sorted((run_dir / "rollouts").glob("step-*.jsonl")) for e in lines(f)]
    assert len(episodes) == 2 and all(e["trained"] for e in episodes)
    tok = ChatTemplate.from_pretrained(str(assets / "tiny-random-qwen2")).tokenizer
    for episode in episodes:
        check_echoed(episode)
        said = [m["content"] for m in episode["messages"] if m["role"] == "assistant"]
        sampled = [s for s in episode["segments"] if s["origin"] == "sampled"]
        # one sampled segment per turn, each the model's own ids with their logprobs: the turn's text
        assert [s["turn"] for s in sampled] == list(range(1, len(said) + 1))
        for segment, text in zip(sampled, said, strict=True):
            assert len(segment["logprobs"]) == len(segment["ids"]) and all(lp <= 0 for lp in segment["logprobs"])
            assert text.strip() in tok.decode(segment["ids"])
        # the server's echo of each turn (the same text) came back as observation tokens, never trained
        echoed = "".join(s["text"] for s in episode["segments"] if s["origin"] != "sampled")
        for text in said[:-1]:
            assert json.dumps(text)[1:-1] in echoed
    assert echo_servers(echo_env) == []


class EchoPolicy:
    """Says `turn T of episode E`; at the second turn of episode `dies` it first SIGKILLs that episode's
    server (one episode runs at a time, so the one echo server alive is its own)."""

    def __init__(self, tokenizer: Any, package: Path, dies: int) -> None:
        self.tok, self.package, self.dies, self.killed = tokenizer, package, dies, []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session_id: str,
                       timeout_s: float | None = None) -> Generation:
        prompt = self.tok.decode(prompt_ids)
        episode = next(e for e in (1, 2, 3) if f"Episode {e}." in prompt)
        turn = prompt.count("<|im_start|>assistant")
        if episode == self.dies and turn == 2:
            (server,) = [p for p in echo_servers(self.package) if p.cmdline()[1:3] == ["-m", "uvicorn"]]
            server.send_signal(signal.SIGKILL)
            server.wait(10)
            self.killed.append(server.pid)
        ids = self.tok.encode(f"turn {turn} of episode {episode}<|im_end|>", add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", 0)


def test_a_killed_echo_server_masks_its_episode_and_the_others_are_scored(
        echo_env: Path, assets: Path, tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Episode {e}. Talk."}],
                                        "data_source": "openenv", "extra_info": {"seed": e}}) + "\n" for e in (1, 2, 3)))
    config = load_config(overrides=[
        "env=openenv", f"model.path={assets / 'tiny-random-qwen2'}", "model.chat_template=chatml-tools",
        f"data.val_files=[{rows}]", f"env.kwargs.command={SERVE}", f"env.kwargs.cwd={echo_env}",
        "env.kwargs.message_timeout_s=20", "env.kwargs.startup_timeout_s=120", "eval.k=1",
        f"rollout.max_turns={MAX_TURNS}", "rollout.max_concurrent_episodes=1", "run.max_infra_failure_rate=0.5",
        f"eval.output_dir={tmp_path / 'eval'}"])
    policy = EchoPolicy(ChatTemplate.from_pretrained(config.model.path).tokenizer, echo_env, dies=2)
    report = run_eval(config, client=policy)
    assert len(policy.killed) == 1 and report.infra_failed_episodes == 1

    episodes = {}
    for episode in lines(tmp_path / "eval" / "trajectories.jsonl"):
        episodes[next(e for e in (1, 2, 3) if f"Episode {e}." in json.dumps(episode["messages"]))] = episode
    for e in (1, 3):
        said = [f"turn {t} of episode {e}" for t in (1, 2, 3)]
        assert [m["content"] for m in episodes[e]["messages"] if m["role"] == "assistant"] == said
        assert (episodes[e]["fault"], episodes[e]["finish_reason"]) == (None, "max_turns")
        assert episodes[e]["reward"] == pytest.approx(sum(len(s) * 0.1 for s in said))
    died = episodes[2]
    assert (died["fault"], died["reward"], died["finish_reason"]) == ("infra", None, "error")
    assert "the OpenEnv server at http://127.0.0.1:" in died["error"] and "failed during step" in died["error"]
    assert echo_servers(echo_env) == []


@pytest.fixture
def echo_url(echo_env: Path) -> Iterator[str]:
    """The generated echo server, started by hand as its README says, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "server.app:app", "--port", str(port)], cwd=echo_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            assert proc.poll() is None, "the echo server exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_url_server_at_its_session_limit_refuses_with_the_limit_and_the_fix(echo_url: str) -> None:
    async def play() -> None:
        first = make_env("openenv", url=echo_url, observation_field="echoed_message")
        second = make_env("openenv", url=echo_url)
        try:
            messages, _ = await first.areset(seed=1)
            assert messages[-1] == {"role": "user", "content": "Echo Env environment ready!"}
            with pytest.raises(EnvServerError) as refused:
                await second.areset(seed=2)
            message = str(refused.value)
            assert f"the OpenEnv server at {echo_url} refused the session during reset, at capacity" in message
            assert "max_concurrent_envs=1" in message and "rollout.max_concurrent_episodes=1" in message
            assert "rollout.max_concurrent_episodes" in fix_for(message)
            # the session it has goes on
            shown, reward, done, _, _ = await first.astep(Action(text="hello"))
            assert (shown, reward, done) == ([{"role": "user", "content": "hello"}], pytest.approx(0.5), False)
        finally:
            await first.aclose()
            await second.aclose()

    asyncio.run(play())
