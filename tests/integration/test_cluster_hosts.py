"""The multi-host test bed itself (`tests/cluster_hosts.py`): two hosts on this machine, one Ray cluster.

Checks what the multi-node tests rely on: Ray tasks land on both hosts (each sees its own address
and host name), the hosts share no /tmp (a file one writes is not there for the other), the
hosts reach each other only at their private addresses, and Ray refuses a client without the
cluster's token.
"""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.slow

SPREAD_TASKS = """
import json, os, socket, pathlib
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init(address={address!r}, logging_level="ERROR")
pathlib.Path("/tmp/work/written-by-head-driver").write_text("x")

@ray.remote(num_cpus=0)
def where():
    return {{"ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
             "sees_head_file": os.path.exists("/tmp/work/written-by-head-driver"), "cwd": os.getcwd()}}

nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
out = ray.get([where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
               for n in nodes])
print("RESULT", json.dumps(sorted(out, key=lambda r: r["ip"])))
"""


def test_tasks_land_on_both_hosts_which_share_no_tmp(ns_cluster) -> None:
    out = ns_cluster.head.python(SPREAD_TASKS.format(address=ns_cluster.address), timeout=180)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    head, worker = json.loads(line[len("RESULT ") :])
    assert (head["ip"], head["host"]) == ("10.77.0.1", "head")
    assert (worker["ip"], worker["host"]) == ("10.77.0.2", "worker")
    assert head["sees_head_file"] is True
    assert worker["sees_head_file"] is False  # the worker's /tmp is its own
    listing = ns_cluster.worker.run(["ls", "/tmp/work"]).stdout.split()
    assert "written-by-head-driver" not in listing
    assert "written-by-head-driver" in ns_cluster.head.run(["ls", "/tmp/work"]).stdout.split()


def test_hosts_reach_each_other_only_at_private_addresses(ns_cluster) -> None:
    addrs = ns_cluster.worker.run(["ip", "-4", "-o", "addr", "show"]).stdout
    assert sorted(line.split()[3] for line in addrs.splitlines()) == ["10.77.0.2/24", "127.0.0.1/8"]
    probe = (
        "import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()"
        "\n    print('open')\nexcept OSError as exc:\n    print('closed', exc)"
    )
    gcs = ns_cluster.address.split(":")
    reached = ns_cluster.worker.run([sys.executable, "-c", probe, *gcs]).stdout
    assert reached.strip() == "open"
    # No default route: from inside the hosts nothing but the other host (and loopback) is reachable.
    routes = ns_cluster.worker.run(["ip", "-4", "route", "show"]).stdout.splitlines()
    assert [r.split()[0] for r in routes] == ["10.77.0.0/24"]


def test_ray_refuses_a_client_without_the_token(ns_cluster) -> None:
    code = (
        f"import ray; ray.init(address={ns_cluster.address!r}, logging_level='ERROR'); "
        "print('CONNECTED', ray.cluster_resources().get('CPU'))"
    )
    ok = ns_cluster.worker.python(code, timeout=120)
    assert "CONNECTED 4.0" in ok.stdout
    refused = ns_cluster.worker.python(
        code, env={"RAY_AUTH_TOKEN_PATH": "/tmp/work/no-such-token"}, timeout=120, check=False
    )
    assert refused.returncode != 0
    assert "CONNECTED" not in refused.stdout
