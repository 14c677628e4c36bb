"""The cluster plan against a real cluster, the namespace cluster of `tests/cluster_hosts.py`:
a run the cluster cannot hold stops before anything starts, naming the role and the resource; a
model or a shared directory a node lacks is named with the node; a process that dies at start on the
worker is named with its node and its own error. (What `agentrl validate` prints for the README's
plan is checked by tests/e2e/test_cluster_run.py, which runs that command.)"""

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


def test_a_cluster_that_lets_in_clients_without_a_token_is_named_with_the_fix() -> None:
    """The warning validate prints for such a cluster (that a token cluster gets none is checked by
    the README cluster run in tests/e2e/test_cluster_run.py, which runs validate on one)."""
    import subprocess

    from agentrl.orchestration.cluster import unauthenticated_join

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


def test_a_process_that_fails_to_start_on_the_worker_is_named_with_its_node_and_its_own_error(
    ns_cluster, assets: Path
) -> None:
    """A model directory both hosts hold (so validate passes) whose config the worker's copy breaks:
    the processes placed on the worker die as they start, and the run says which node, which process
    and the process's own error (not only that an actor is gone)."""
    model = "/tmp/work/broken-on-worker"
    for host in ns_cluster.hosts:
        host.run(["cp", "-r", str(assets / "tiny-random-qwen2"), model])
    ns_cluster.worker.run(["sh", "-c", f"printf '{{\"model_type\": \"no-such-architecture\"}}' > {model}/config.json"])
    argv = base(assets, ns_cluster.address)
    argv.insert(3, "run")
    argv = [a if not a.startswith("model.path=") else f"model.path={model}" for a in argv]
    done = ns_cluster.head.run(
        [*argv, "cluster.strategy=SPREAD", "run.name=broken-worker", "env=parity_env:ParityEnv", "run.total_steps=1"],
        env={"PYTHONPATH": str(Path(__file__).parents[1] / "e2e")}, timeout=900, check=False,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    worker = ns_cluster.worker.ip
    assert f"node {worker}" in done.stderr, done.stderr[-4000:]
    assert "no-such-architecture" in done.stderr, done.stderr[-4000:]  # the process's own message
