"""Benchmark of the local sandbox: latency and throughput of short snippets against two baselines.

    python bench/sandbox.py            # full run (about a minute on 2 cores)
    python bench/sandbox.py --quick    # fewer repetitions

Three ways to run the same snippet are measured in the same run, so the ratios are fair even on a
busy machine: `bare` starts a new `python -c` process per snippet (no isolation, no pool);
`warm-fork` is `LocalSandbox(isolation="none")`, the same fork server with no namespaces; and
`isolated` is the default `LocalSandbox()` (bubblewrap, cgroups, per-job uid). Reported: p50/p99
latency of `print(1)` and of a small numeric snippet one at a time, and snippets per second with
1/2/4/8 concurrent callers (the sandbox itself runs at most one job per core; callers queue).
Targets: isolated p50 within 1.5x of warm-fork; at least 300 isolated snippets/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import sys
import time

from agentrl.sandboxes.local import LocalSandbox

SNIPPETS = {
    "print(1)": "print(1)",
    "numeric": "import math\nprint(sum(math.sqrt(i) * math.sin(i) for i in range(20000)))",
}


class Bare:
    """A new `python -c` process per snippet: what a sandbox without a warm pool costs at least."""

    async def exec(self, *, code: str, timeout_s: float) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        if proc.returncode != 0 or not out:
            raise RuntimeError(f"bare run failed: {proc.returncode}")

    async def close(self) -> None:
        pass


async def _checked(runner, code: str) -> None:
    res = await runner.exec(code=code, timeout_s=30)
    if res is not None and (res.exit_code != 0 or not res.stdout):
        raise RuntimeError(f"snippet failed: {res}")


async def latency(runner, code: str, n: int) -> tuple[float, float]:
    for _ in range(max(5, n // 10)):  # warm-up
        await _checked(runner, code)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await _checked(runner, code)
        times.append(time.perf_counter() - t)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]


class CpuMeter:
    """CPU seconds used by this process and all its descendants (sandboxes included), via cpuacct.

    Other tenants of a shared machine slow the wall-clock numbers down; CPU per snippet does not
    depend on them, and `cores / cpu_per_snippet` is the rate an otherwise idle machine would reach.
    """

    def __init__(self) -> None:
        self.path = None
        base = "/sys/fs/cgroup/cpuacct"
        try:
            path = os.path.join(base, f"agentrl-bench-{os.getpid()}")
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            self.path = path
        except OSError:
            pass

    def read(self) -> float | None:
        if self.path is None:
            return None
        with open(os.path.join(self.path, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError), open("/sys/fs/cgroup/cpuacct/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
            with contextlib.suppress(OSError):
                os.rmdir(self.path)


METER: CpuMeter | None = None


async def throughput(runner, code: str, concurrency: int, n: int) -> tuple[float, float | None]:
    """Snippets per second, and CPU milliseconds per snippet (None where cpuacct is unavailable)."""
    queue = list(range(n))

    async def caller() -> None:
        while queue:
            queue.pop()
            await _checked(runner, code)

    cpu0 = METER.read() if METER else None
    t = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    rate = n / (time.perf_counter() - t)
    cpu1 = METER.read() if METER else None
    return rate, (None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / n)


async def measure(kind: str, args: argparse.Namespace) -> dict[str, float]:
    if kind == "bare":
        runner = Bare()
    else:
        runner = LocalSandbox(isolation="none" if kind == "warm-fork" else "bwrap")
        await runner.start()
    out: dict[str, float] = {}
    try:
        n = args.n // 4 if kind == "bare" else args.n
        for name, code in SNIPPETS.items():
            out[f"{name} p50"], out[f"{name} p99"] = await latency(runner, code, n)
        for c in (1, 2, 4, 8):
            out[f"tput c={c}"], cpu = await throughput(runner, SNIPPETS["print(1)"], c, n)
            if cpu is not None:
                out[f"cpu c={c}"] = cpu
    finally:
        await runner.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=400, help="snippets per measurement")
    parser.add_argument("--quick", action="store_true", help="n=100")
    args = parser.parse_args()
    if args.quick:
        args.n = 100
    logging.basicConfig(level=logging.ERROR)
    global METER
    METER = CpuMeter()
    load = os.getloadavg()[0]
    print(f"cores={os.cpu_count()} load_avg_1m={load:.2f} n={args.n} python={sys.version.split()[0]}")
    try:
        results = {kind: asyncio.run(measure(kind, args)) for kind in ("bare", "warm-fork", "isolated")}
    finally:
        METER.close()
    keys = list(results["isolated"])
    print(f"{'metric':<16}{'bare':>12}{'warm-fork':>12}{'isolated':>12}{'iso/fork':>10}{'iso/bare':>10}")
    for key in keys:
        b, w, i = (results[k][key] for k in ("bare", "warm-fork", "isolated"))
        scale, unit = (1, "/s") if key.startswith("tput") else (1000, "ms")
        print(f"{key + ' ' + unit:<16}{b * scale:>12.2f}{w * scale:>12.2f}{i * scale:>12.2f}{i / w:>10.2f}{i / b:>10.2f}")
    iso = results["isolated"]
    p50_ratio = iso["print(1) p50"] / results["warm-fork"]["print(1) p50"]
    best = max(v for k, v in iso.items() if k.startswith("tput"))
    print(f"target isolated p50 <= 1.5x warm-fork: {p50_ratio:.2f}x -> {'met' if p50_ratio <= 1.5 else 'MISSED'}")
    print(f"target >= 300 isolated snippets/s: best {best:.0f}/s -> {'met' if best >= 300 else 'MISSED'}")
    cpus = [v for k, v in iso.items() if k.startswith("cpu")]
    if cpus:
        cores = os.cpu_count() or 1
        print(f"isolated CPU per snippet (whole tree, median over concurrencies): {statistics.median(cpus) * 1000:.2f} ms "
              f"-> about {cores / statistics.median(cpus):.0f} snippets/s if {cores} cores were idle")


if __name__ == "__main__":
    main()
