"""Two hosts against one: weight sync and rollout throughput across the namespace cluster of the tests.

    sudo python bench/cluster.py                 # both parts, one run; ratios printed at the end
    sudo python bench/cluster.py --quick         # smaller sizes, for a smoke test

Builds the two hosts of `tests/cluster_hosts.py` (network namespaces joined by a veth pair, each
with a private /tmp; no Ray is needed here) and measures, side by side in one run:

1. **Weight sync across the hosts.** The trainer side (`HTTPCheckpointEngine(host=HEAD_IP)`, the
   engine a cluster run uses when nothing is shared) publishes `--total-mb` of fp32 tensors on the
   head; the server side pulls them from the worker host over the veth, checksumming every bucket
   (sum64, the default) as it lands. Next to it, in the same rounds, a raw transfer of the same
   bytes between the same two processes: one TCP connection, `sendall` of one buffer, `recv_into` a
   preallocated one. These are `bench/weight_sync.py`'s http cases, run with one side on each host.
   Target: pull (sum64) >= 70% of the raw transfer.
2. **Rollout throughput, a server on each host against one.** Servers with a fixed service time
   (`FixedTimeEngine` below: `--slots` requests at once, each held `--service-ms`, whatever the CPU
   does) run the real server app (`agentrl.inference.server_app`) on each host; the real `Router`,
   on the head as in a run, spreads sticky multi-turn sessions (`--sessions` at once, `--turns`
   each) over one server (the head's) or two (one per host). Rounds alternate between the two so
   load from elsewhere falls on both alike. The fixed service time is what makes the comparison
   about placement and routing: two simulated hosts share this machine's cores, so real engines
   would measure the cores, not the hosts. Target: two hosts >= 1.8x one.

Needs root (network namespaces); exits 2 saying why where it cannot build the hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the namespace cluster of the multi-host tests

from agentrl.inference.protocol import GenerateRequest, GenerateResponse, WeightLoadReport  # noqa: E402
from agentrl.inference.server_app import ServerEngine, run_server  # noqa: E402


# ── the fixed-service-time server ──────────────────────────────────────────────────────────────
class FixedTimeEngine(ServerEngine):
    """Serves `slots` requests at once, each for `service_ms`, answering `max_tokens` tokens of id 1."""

    engine_name = "fixed-time"

    def __init__(self, service_ms: float, slots: int) -> None:
        self.service_s = service_ms / 1000
        self.model_name = "fixed-time"
        self._slots = asyncio.Semaphore(slots)
        self._epoch = 0

    async def generate(self, request: GenerateRequest, version: int) -> GenerateResponse:
        epoch = self._epoch
        async with self._slots:
            await asyncio.sleep(self.service_s)
        n = request.sampling.max_tokens
        reason = "abort" if epoch != self._epoch else "length"
        return GenerateResponse(token_ids=[1] * n, logprobs=[-0.5] * n, finish_reason=reason, weight_version=version)

    async def abort_all(self) -> None:
        self._epoch += 1

    async def load_weights(self, source: str, *, version: int, token: str | None) -> WeightLoadReport:
        raise NotImplementedError("the fixed-time bench server holds no weights; it measures routing only")


def serve(args: argparse.Namespace) -> None:
    run_server(FixedTimeEngine(args.service_ms, args.slots), host=args.host, port=args.port, weight_version=0,
               log_level="warning")


# ── rollouts through the router (runs on the head) ─────────────────────────────────────────────
async def _rollouts(urls: list[str], sessions: int, turns: int, tokens: int) -> float:
    """Requests per second of `sessions` concurrent sticky sessions of `turns` turns through a Router."""
    from agentrl.inference.router import Router
    from agentrl.types import SamplingParams

    router = Router(urls, health_interval_s=1.0)
    sampling = SamplingParams(max_tokens=tokens)
    rng = random.Random(0)

    async def episode(i: int) -> None:
        prompt = [rng.randrange(2, 1000) for _ in range(32)]
        for _ in range(turns):
            out = await router.generate(prompt, sampling, session_id=f"s{i}")
            prompt = prompt + out.token_ids + [3, 4]

    try:
        await router.generate([1, 2], SamplingParams(max_tokens=1), session_id="warm")
        start = time.perf_counter()
        await asyncio.gather(*(episode(i) for i in range(sessions)))
        return sessions * turns / (time.perf_counter() - start)
    finally:
        await router.aclose()


def rollouts(args: argparse.Namespace) -> None:
    one = json.loads(args.one)
    two = json.loads(args.two)
    rates: dict[str, list[float]] = {"one host": [], "two hosts": []}
    for _ in range(args.repeats):
        rates["one host"].append(asyncio.run(_rollouts(one, args.sessions, args.turns, args.tokens)))
        rates["two hosts"].append(asyncio.run(_rollouts(two, args.sessions, args.turns, args.tokens)))
    print(json.dumps({k: statistics.median(v) for k, v in rates.items()}))


# ── the driver: hosts, then both parts ─────────────────────────────────────────────────────────
def _wait_healthy(host, url: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    code = (f"import time, httpx\nend = time.time() + {timeout_s}\n"
            f"while True:\n    try:\n        httpx.get({url + '/health'!r}, timeout=2).raise_for_status(); break\n"
            f"    except Exception:\n        assert time.time() < end, 'server did not start'\n        time.sleep(0.3)\n")
    host.python(code, timeout=timeout_s + 10)


def weight_sync_part(cluster, args: argparse.Namespace) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """bench/weight_sync.py's http cases with the publisher on the head and the puller on the worker."""
    port = 29517
    out = "/tmp/work/http.json"
    code = ("import sys; sys.path.insert(0, {bench!r}); from weight_sync import _http_worker; "
            "_http_worker({rank}, {port}, {host!r}, {mb}, {bucket}, {repeats}, {out!r}, rendezvous={host!r})")
    sides = []
    for rank, (host, iface) in enumerate(((cluster.head, cluster.veth[0]), (cluster.worker, cluster.veth[1]))):
        line = code.format(bench=str(REPO / "bench"), rank=rank, port=port, host=cluster.head.ip, mb=args.total_mb,
                           bucket=args.bucket_mb << 20, repeats=args.repeats, out=out)
        sides.append(host.popen([sys.executable, "-c", line], env={"GLOO_SOCKET_IFNAME": iface},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for side in sides:
        _, err = side.communicate(timeout=1800)
        if side.returncode != 0:
            raise RuntimeError(f"a weight-sync side exited {side.returncode}: {err[-3000:]}")
    return json.loads(cluster.worker.run(["cat", out]).stdout)


def rollout_part(cluster, args: argparse.Namespace) -> dict[str, float]:  # type: ignore[no-untyped-def]
    servers, urls = [], []
    for host in cluster.hosts:
        port = 18080
        servers.append(host.popen([sys.executable, __file__, "serve", "--host", host.ip, "--port", str(port),
                                   "--service-ms", str(args.service_ms), "--slots", str(args.slots)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        urls.append(f"http://{host.ip}:{port}")
    try:
        for url in urls:
            _wait_healthy(cluster.head, url)
        done = cluster.head.run([sys.executable, __file__, "rollouts", "--one", json.dumps(urls[:1]),
                                 "--two", json.dumps(urls), "--sessions", str(args.sessions), "--turns",
                                 str(args.turns), "--tokens", str(args.tokens), "--repeats", str(args.repeats)],
                                timeout=3600)
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)


def bench(args: argparse.Namespace) -> int:
    from cluster_hosts import NamespaceCluster

    why = NamespaceCluster.unavailable()
    if why:
        print(f"cannot build the two hosts here: {why}", file=sys.stderr)
        return 2
    print(f"two hosts on one machine ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}); "
          f"median of {args.repeats} rounds", flush=True)
    cluster = NamespaceCluster(f"b{os.getpid() % 10000}").start(ray=False)
    try:
        http = weight_sync_part(cluster, args)
        raw = http["raw tcp transfer"]
        print(f"\n1. weight sync, head -> worker over the veth: {args.total_mb} MiB in {args.bucket_mb} MiB buckets")
        print(f"{'path':<42} {'GB/s':>7} {'x raw tcp':>10}")
        for name, gbps in http.items():
            print(f"{name:<42} {gbps:>7.2f} {gbps / raw:>10.2f}")
        pull = http["http engine pull (sum64)"] / raw
        rates = rollout_part(cluster, args)
    finally:
        cluster.stop()
    speedup = rates["two hosts"] / rates["one host"]
    print(f"\n2. rollouts: {args.sessions} sessions x {args.turns} turns, servers of {args.slots} slots x "
          f"{args.service_ms:g} ms, through the router on the head")
    for name, rate in rates.items():
        print(f"{name:<12} {rate:8.1f} requests/s")
    print(f"\nweight sync across hosts: pull (sum64) at {pull:.0%} of the raw transfer "
          f"(target >= 70%: {'met' if pull >= 0.7 else 'MISSED'})")
    print(f"rollout throughput: two hosts {speedup:.2f}x one (target >= 1.8x: {'met' if speedup >= 1.8 else 'MISSED'})")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part")
    s = sub.add_parser("serve", help="(internal) a fixed-service-time server")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--service-ms", type=float, required=True)
    s.add_argument("--slots", type=int, required=True)
    r = sub.add_parser("rollouts", help="(internal) sessions through the router, one server against two")
    for flag in ("--one", "--two"):
        r.add_argument(flag, required=True)
    for flag in ("--sessions", "--turns", "--tokens", "--repeats"):
        r.add_argument(flag, type=int, required=True)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    if args.part == "serve":
        serve(args)
        return
    if args.part == "rollouts":
        rollouts(args)
        return
    quick = args.quick
    args.repeats = args.repeats or (2 if quick else 5)
    args.total_mb, args.bucket_mb = (64, 16) if quick else (256, 64)
    args.sessions, args.turns, args.tokens = (16, 2, 8) if quick else (64, 4, 16)
    args.service_ms, args.slots = 50.0, 4
    sys.exit(bench(args))


if __name__ == "__main__":
    main()
