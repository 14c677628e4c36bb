"""`agentrl run` across two hosts: the namespace cluster of `tests/cluster_hosts.py`.

The driver runs on the head host; the cluster plan (`cluster.address`, strategy SPREAD) puts a
trainer rank and an `hf` server on each host (each host has 2 Ray CPUs, each process takes 1).
The hosts share no /tmp, so the run directory exists on the head only: the worker host's server
gets every new version over HTTP from trainer rank 0's endpoint, and the worker's trainer rank
ships its checkpoint shard to the head. Checked: where each process ran, that both servers load
every new version (every bucket verified), that the ledger balances, that the checkpoint holds
both ranks' shards and the run resumes from it on the cluster; and, in the second test, that killing the worker host's server in the middle
of the run loses no episode (the server is restarted on its node, re-synced, and every prompt taken
is trained).
"""

from __future__ import annotations

import json
import re
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


def test_a_run_spans_two_hosts(ns_cluster, assets: Path) -> None:
    head, worker = ns_cluster.head, ns_cluster.worker
    done = head.run(run_args(assets, ns_cluster.address, "span", 2), env=env(), timeout=1500, check=False)
    run_dir = "/tmp/work/runs/span"
    log = read(head, f"{run_dir}/driver.log") if done.returncode == 0 else done.stderr[-8000:]
    assert done.returncode == 0, log
    where = placed(log)
    assert where["trainer rank 0"] == head.ip  # pinned to the driver's node
    assert sorted(where.values()) == sorted([head.ip, head.ip, worker.ip, worker.ip])
    assert {where["trainer rank 1"], where["server 0"], where["server 1"]} == {head.ip, worker.ip}

    # Both servers load every new version, every bucket verified, from the trainer's node over HTTP.
    seen = pushes(log)
    assert sorted(seen) == [1, 2]
    for version in (1, 2):
        hosts = {re.sub(r"http://([\d.]+):\d+", r"\1", sid) for sid in seen[version]}
        assert hosts == {head.ip, worker.ip}, seen
        assert all(v == b and b > 0 for v, b in seen[version].values()), seen
    assert re.search(rf"from http://{re.escape(head.ip)}:\d+", log)  # the endpoint on rank 0's node

    result = json.loads(read(head, f"{run_dir}/result.json"))
    assert result["steps_done"] == 2 and result["policy_version"] == 2
    ledger = result["ledger"]
    assert (
        ledger["taken"]
        == ledger["trained"]
        + ledger["filtered"]
        + ledger["requeued"]
        + ledger["failed"]
        + ledger["unfinished"]
        + ledger["in_flight"]
    )
    assert ledger["in_flight"] == 0 and ledger["trained"] >= 8

    # The checkpoint on the head holds both ranks' shards; the worker wrote none of the run there.
    shards = head.run(["sh", "-c", f"cd {run_dir}/checkpoints && ls */trainer/dcp */trainer"]).stdout
    assert "__0_0.distcp" in shards and "__1_0.distcp" in shards
    assert "rng_rank1.pt" in shards
    on_worker = worker.run(["sh", "-c", f"ls -R {run_dir} 2>/dev/null || true"]).stdout
    assert "checkpoints" not in on_worker and "driver.log" not in on_worker
    assert "hf-" in on_worker  # only the log of the server that ran there

    # Resume on the cluster: the worker's rank gets the checkpoint's files from the head, one more step.
    again = head.run(
        run_args(assets, ns_cluster.address, "span", 3, "resume=true"), env=env(), timeout=1500, check=False
    )
    log = read(head, f"{run_dir}/driver.log")
    assert again.returncode == 0, log[-8000:] + again.stderr[-4000:]
    assert re.search(r"resuming .*span from step-0*2: step 2, policy version 2", log), log[-3000:]
    result = json.loads(read(head, f"{run_dir}/result.json"))
    assert result["steps_done"] == 3 and result["policy_version"] == 3
    assert sorted(pushes(log)) == [1, 2, 3]  # version 2 pushed again at the resume, then version 3
    assert result["ledger"]["in_flight"] == 0


def test_killing_the_worker_hosts_server_mid_run_loses_no_episode(ns_cluster, assets: Path) -> None:
    head, worker = ns_cluster.head, ns_cluster.worker
    run_dir = "/tmp/work/runs/kill"
    driver = head.popen(
        run_args(assets, ns_cluster.address, "kill", 4),
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
    assert result["steps_done"] == 4
    assert ledger["failed"] == 0 and ledger["unfinished"] == 0 and ledger["in_flight"] == 0
    assert ledger["trained"] + ledger["filtered"] == 16  # every prompt of the 4 steps, none lost
    # After its restart the worker's server got the weights pushed last before it was back (re-synced),
    # and every version pushed after that reached both servers.
    seen = pushes(log)
    before, after = pushes(log[: back.start()]), pushes(log[back.end():])
    assert int(back.group(1)) == max(before), (back.group(0), sorted(before))
    assert all(len(seen[v]) == 2 for v in after), seen
