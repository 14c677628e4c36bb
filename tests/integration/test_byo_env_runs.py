"""`agentrl run` (the command, as a user types it) trains on environments agentrl's authors did not
write: an OpenEnv server agentrl starts per episode, a Gymnasium text env registered by id, the
tools of an MCP server from PyPI, a verifiers taskset (scored in verifiers' own worker process), a
multi-turn one (played by verifiers itself, its model calls through the gateway) and verifiers' own
built-in OpenEnv taskset, each with the tiny random Qwen2 served by the hf engine.

Guards: each run exits 0 with a balanced ledger, trains its steps and writes their episodes; on the
OpenEnv run, a server that dies mid-episode (the seed-13 row) makes that row's episodes
infrastructure failures, masked and never trained or scored 0 (the row is requeued, as any prompt
whose every episode failed), while the others train; no env server, MCP server or verifiers worker
process outlives the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
DYING_SERVER = TESTS / "openenv" / "dying_guess_server.py"
DYING_SEED = 13
# The random model seldom samples its end-of-turn token: the first 20,000 ids end a turn too, so
# most turns end and reach the env as actions instead of running into the token budget.
STOPS = f"rollout.extra_stop_token_ids=[{','.join(str(i) for i in range(20000))}]"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def agentrl_run(tmp_path: Path, name: str, assets: Path, *args: str,
                prompts_per_step: int = 2) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`agentrl run` on the tiny model, `prompts_per_step` groups of 2 episodes a step; its run directory."""
    command = [sys.executable, "-m", "agentrl.cli", "run", *args, f"model.path={assets / 'tiny-random-qwen2'}",
               "model.chat_template=chatml-tools", "inference.engine=hf", "trainer.device=cpu",
               f"data.prompts_per_step={prompts_per_step}", "rollout.samples_per_prompt=2",
               "rollout.max_tokens_per_turn=16",
               "data.num_val_rows=1", "eval.k=1", "run.eval_every=0", "run.loggers=[jsonl]",
               f"run.output_dir={tmp_path}", f"run.name={name}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    return done, tmp_path / name


def check_trained(run_dir: Path, steps: int) -> list[dict]:
    """The run's books balance and it trained `steps` steps; returns every episode it logged."""
    from agentrl.orchestration.ledger import journal_balance

    books = journal_balance(run_dir / "ledger.jsonl")
    assert books["trained"] >= 1 and books.get("in_flight", 0) == 0
    assert [m["step"] for m in lines(run_dir / "metrics.jsonl")] == list(range(steps))
    episodes = [e for f in sorted((run_dir / "rollouts").glob("step-*.jsonl")) for e in lines(f)]
    assert episodes and any(e["trained"] for e in episodes)
    return episodes


def processes_running(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "pytest" not in line]


def test_run_trains_on_an_openenv_server_and_masks_the_episodes_of_one_that_dies(
        assets: Path, tmp_path: Path) -> None:
    pytest.importorskip("openenv.core")
    rows = tmp_path / "rows.jsonl"
    with rows.open("w") as f:
        for seed in (1, DYING_SEED):  # one step of 2 prompts draws both rows, the dying one among them
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"Seed {seed}. Play the game."}],
                                "data_source": "openenv", "extra_info": {"seed": seed}}) + "\n")
    _, run_dir = agentrl_run(
        tmp_path, "openenv", assets, "env=openenv", f"data.train_files=[{rows}]", f"data.val_files=[{rows}]",
        f"env.kwargs.command=[python, {DYING_SERVER}, --port, '{{port}}']", "env.kwargs.message_timeout_s=30",
        "env.kwargs.startup_timeout_s=120", "rollout.max_turns=3", "run.total_steps=1",
        "run.max_infra_failure_rate=0.9", STOPS)
    episodes = check_trained(run_dir, 1)
    seed13 = [e for e in episodes if f"Seed {DYING_SEED}." in json.dumps(e["messages"])]
    died = [e for e in episodes if e["fault"] == "infra"]
    assert died and all(e in seed13 for e in died), "the seed-13 row's server dies, and only it"
    for e in died:
        assert "OpenEnv server" in (e["error"] or "") and not e["trained"] and e["reward"] is None
    # a seed-13 episode that ended before its first step (the token budget) never met the dying server
    assert all(e["fault"] is None for e in episodes if e not in died) and any(e["trained"] for e in episodes)
    # an attempt of the seed-13 row whose every episode failed is requeued (and that attempt never
    # trained); none of another row is
    requeued = [e for e in lines(run_dir / "ledger.jsonl") if e["status"] == "requeued"]
    assert {e["uid"] for e in requeued} <= {e["group_id"].rsplit("-", 1)[0] for e in seed13}
    assert all("OpenEnv server" in e["reason"] for e in requeued)
    assert processes_running(str(DYING_SERVER)) == []


def test_run_trains_on_a_gymnasium_text_env_registered_by_id(assets: Path, tmp_path: Path) -> None:
    _, run_dir = agentrl_run(tmp_path, "gym", assets, "env=gym", "env.kwargs.id=gym_text.guess_text_env:GuessText-v0",
                             "rollout.max_turns=3", "run.total_steps=2", STOPS)
    episodes = check_trained(run_dir, 2)
    assert all(e["fault"] is None for e in episodes)
    assert all(e["messages"][1]["content"] == "Guess my number from 1 to 10 in 3 tries." for e in episodes)


def test_run_trains_with_the_tools_of_mcp_servers_one_per_episode_and_one_from_pypi_shared(
        assets: Path, tmp_path: Path) -> None:
    pytest.importorskip("mcp_server_time")
    rows = tmp_path / "rows.jsonl"
    with rows.open("w") as f:
        for a, b in ((2, 3), (7, 5), (4, 4), (9, 1)):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                "data_source": "mcp-test", "reward_model": {"style": "rule",
                                                                            "ground_truth": str(a + b)}}) + "\n")
    calculator = REPO / "envs" / "data" / "mcp_calculator.py"
    servers = (f"[{{name: calculator, command: python, args: [{calculator}], ro_paths: [{calculator.parent}]}}, "
               "{name: time, command: python, args: [-m, mcp_server_time], per_episode: false}]")
    _, run_dir = agentrl_run(tmp_path, "mcp", assets, "env=mcp", f"env.kwargs.servers={servers}",
                                f"data.train_files=[{rows}]", f"data.val_files=[{rows}]", "rollout.max_turns=2",
                                "run.total_steps=1", STOPS)
    episodes = check_trained(run_dir, 1)
    assert all(e["fault"] is None for e in episodes)
    assert processes_running(str(calculator)) == [] and processes_running("mcp_server_time") == []


@pytest.mark.verifiers  # installed in a folder of its own: bash scripts/install.sh verifiers (dev does)
def test_run_trains_on_a_verifiers_taskset_scored_in_its_worker(assets: Path, tmp_path: Path) -> None:
    from agentrl.envs.verifiers_process import WORKER_PATH

    _, run_dir = agentrl_run(tmp_path, "verifiers", assets, "env=verifiers",
                             f"env.kwargs.id={REPO / 'examples' / 'verifiers_arith.py'}", "rollout.max_turns=1",
                             "run.total_steps=1", STOPS)
    episodes = check_trained(run_dir, 1)
    assert all(e["fault"] is None and e["reward"] in (0.0, 1.0) for e in episodes)
    assert all(e["messages"][0]["content"] == "Answer with the result only, as \\boxed{NUMBER}." for e in episodes)
    # an episode the model ended was scored by the taskset's @vf.reward (by name); one that ran into the
    # token budget never reached it (reward 0 from the loop, no rubric metric)
    answered = [e for e in episodes if e["finish_reason"] == "done"]
    assert answered and all(e["metrics"]["reward/correct"] == e["reward"] for e in answered)
    assert all("reward/correct" not in e["metrics"] for e in episodes if e not in answered)
    assert processes_running(WORKER_PATH) == []


@pytest.mark.verifiers
def test_run_trains_on_a_multi_turn_verifiers_taskset_played_through_the_gateway(assets: Path, tmp_path: Path) -> None:
    from agentrl.envs.verifiers_process import WORKER_PATH

    _, run_dir = agentrl_run(tmp_path, "verifiers-turns", assets, "env=verifiers",
                             f"env.kwargs.id={REPO / 'examples' / 'verifiers_guess.py'}", "env.kwargs.max_rows=4",
                             "rollout.max_turns=3", "run.total_steps=1", STOPS,
                             prompts_per_step=1)  # each episode runs verifiers' chat program: one group
    episodes = check_trained(run_dir, 1)
    assert all(e["fault"] is None for e in episodes)
    # verifiers played the game (the seat's max_turns is the run's 3: the game's 4 guesses are cut there), and
    # the trajectory the trainer got holds every turn of it, its reward verifiers' score of that play
    assert any(e["num_turns"] > 1 for e in episodes) and all(e["num_turns"] <= 3 for e in episodes)
    for e in episodes:
        assert e["metrics"]["guesses"] == e["num_turns"] == len([m for m in e["messages"] if m["role"] == "assistant"])
        assert e["reward"] == e["metrics"]["reward/solved"]
        # unsolved, the game asked for a fourth guess, which verifiers refused at the budget: max_turns
        assert e["finish_reason"] == ("done" if e["reward"] == 1.0 else "max_turns"), e
    assert processes_running(WORKER_PATH) == []


@pytest.mark.verifiers
def test_run_trains_on_verifiers_own_openenv_taskset(assets: Path, tmp_path: Path, openenv_guess_url: str) -> None:
    """verifiers' built-in `openenv` taskset (written by verifiers' authors, used as it ships) against
    an OpenEnv server on loopback: verifiers steps the server with each sampled reply and scores the
    episode with its own `openenv_reward`, which the run trains on."""
    from agentrl.envs.verifiers_process import WORKER_PATH, verifiers_folder

    if not any(verifiers_folder().glob("openenv-*.dist-info")):
        pytest.skip(f"verifiers' openenv extra is not in {verifiers_folder()}: bash scripts/install.sh verifiers")
    _, run_dir = agentrl_run(
        tmp_path, "verifiers-openenv", assets, "env=verifiers", "env.kwargs.id=openenv",
        f"env.kwargs.taskset_kwargs={{base_url: '{openenv_guess_url}', resets: [{{seed: 1}}, {{seed: 2}}]}}",
        "rollout.max_turns=2", "run.total_steps=1", STOPS, prompts_per_step=1)  # one group, as above
    episodes = check_trained(run_dir, 1)
    assert all(e["fault"] is None for e in episodes), [e["error"] for e in episodes if e["fault"]]
    for e in episodes:
        # verifiers' own score of its own play: the server's reward, summed by its taskset
        assert e["reward"] == e["metrics"]["reward/openenv_reward"] and e["num_turns"] <= 2
        observations = [m["content"] for m in e["messages"] if m["role"] == "user"]
        assert "I picked a number from 1 to 10." in observations[0]  # the server's reset, the first turn
    assert processes_running(WORKER_PATH) == []
