"""The cluster plan against a real cluster, the namespace cluster of `tests/cluster_hosts.py`:
`agentrl validate` prints the node each process would run on, and a run the cluster cannot hold
stops before anything starts, naming the role and the resource."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def base(assets: Path, address: str) -> list[str]:
    return [
        sys.executable, "-m", "agentrl.cli", "env=arithmetic", f"model.path={assets / 'tiny-random-qwen2'}",
        "model.chat_template=chatml-tools", "inference.engine=hf", "trainer.device=cpu",
        "trainer.num_processes=2", "inference.num_servers=2", f"cluster.address={address}",
        "run.output_dir=/tmp/work/runs",
    ]  # fmt: skip


def test_validate_prints_where_each_process_runs(ns_cluster, assets: Path) -> None:
    argv = base(assets, ns_cluster.address)
    argv.insert(3, "validate")
    out = ns_cluster.head.run([*argv, "cluster.strategy=SPREAD"], timeout=300).stdout
    lines = out.splitlines()
    assert "placement split on cpu (placement=split on a cluster (cluster.address))" in lines
    assert f"  trainer rank 0: 1 CPU -> node {ns_cluster.head.ip}" in lines  # pinned to the driver's node
    nodes = [line.rsplit(" ", 1)[1] for line in lines if " -> node " in line]
    assert sorted(nodes) == sorted([ns_cluster.head.ip] * 2 + [ns_cluster.worker.ip] * 2)
    assert any("one placement group of 4 bundles, strategy SPREAD" in line for line in lines)


def test_a_plan_the_cluster_cannot_hold_stops_before_anything_starts(ns_cluster, assets: Path) -> None:
    argv = base(assets, ns_cluster.address)
    argv.insert(3, "run")
    done = ns_cluster.head.run([*argv, "cluster.server.cpus=3", "run.name=toobig"], timeout=300, check=False)
    assert done.returncode != 0
    assert "cannot hold the run's plan; nothing was started" in done.stderr
    assert "CPU: the plan needs 8 (cluster.trainer 2, cluster.server 6), the cluster has 4" in done.stderr
    assert "server 0 (CPU 3, from cluster.server) fits on no node" in done.stderr
    for host in ns_cluster.hosts:  # no server and no trainer was started anywhere in the cluster
        found = host.run(["pgrep", "-f", "agentrl.inference.hf_server|TrainerWorker"], check=False).stdout
        # the hosts share this machine's PID namespace: count only processes of the host's own namespace
        assert {int(p) for p in found.split()} & set(host.pids()) == set()


def test_the_files_engine_without_a_shared_directory_stops_at_start(ns_cluster, assets: Path) -> None:
    argv = base(assets, ns_cluster.address)
    argv.insert(3, "run")
    done = ns_cluster.head.run(
        [
            *argv,
            "cluster.strategy=SPREAD",
            "weights.backend=files",
            "run.name=files",
            "env=parity_env:ParityEnv",
            "run.total_steps=1",
        ],
        env={"PYTHONPATH": str(Path(__file__).parents[1] / "e2e")},
        timeout=900,
        check=False,
    )
    assert done.returncode != 0
    # The worker host's server cannot read the head's run directory: the probe says so before any step.
    assert "weights.backend=files" in done.stderr
    assert "the files engine needs a directory that the trainer and every server share" in done.stderr
    assert "use weights.backend=http" in done.stderr


def test_validate_warns_only_when_the_cluster_lets_in_clients_without_a_token(ns_cluster, assets: Path) -> None:
    import subprocess

    from agentrl.orchestration.cluster import unauthenticated_join

    # The namespace cluster runs with Ray's token auth on: validate says nothing about it.
    argv = base(assets, ns_cluster.address)
    argv.insert(3, "validate")
    out = ns_cluster.head.run(argv, timeout=300).stdout
    assert "without an auth token" not in out

    # A head without token auth, as a plain `ray start --head` on a machine with no ~/.ray/auth_token
    # starts one: a client with no token joins it, and that is what the warning says.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    head = subprocess.Popen(
        [sys.executable, "-c", "import ray, sys, time\n"
         "ray.init(num_cpus=1, include_dashboard=False, logging_level='ERROR')\n"
         "print(ray.get_runtime_context().gcs_address, flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**env, "RAY_TMPDIR": "/tmp/ray-open-door"},
    )  # fmt: skip
    try:
        assert head.stdout is not None
        address = head.stdout.readline().strip()
        warning = unauthenticated_join(address)
        assert warning is not None and f"the Ray cluster at {address} lets in clients without an auth token" in warning
        assert "RAY_AUTH_MODE=token" in warning
    finally:
        assert head.stdin is not None
        head.stdin.close()
        head.wait(timeout=120)


def test_validate_checks_the_model_on_every_node_that_loads_it(ns_cluster, assets: Path) -> None:
    # A model directory that only the head holds (each host has its own /tmp): named with the node.
    ns_cluster.head.run(["cp", "-r", str(assets / "tiny-random-qwen2"), "/tmp/work/head-only-model"])
    argv = base(assets, ns_cluster.address)
    argv.insert(3, "validate")
    argv = [a if not a.startswith("model.path=") else "model.path=/tmp/work/head-only-model" for a in argv]
    done = ns_cluster.head.run([*argv, "cluster.strategy=SPREAD"], timeout=300, check=False)
    assert done.returncode != 0
    assert "Not every node can run its part of the run; nothing was started" in done.stderr
    named = [ln.strip() for ln in done.stderr.split("nothing was started")[1].splitlines() if "node " in ln]
    # SPREAD puts two of the four processes on the worker: each is named; the head's two load it
    assert len(named) == 2 and all(ln.startswith(f"node {ns_cluster.worker.ip} (") for ln in named), named
    assert all("model.path '/tmp/work/head-only-model' is not a directory here" in ln for ln in named)
