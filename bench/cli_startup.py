"""How long `agentrl --help` and `agentrl envs list` take, next to a bare `python -c pass`.

    python bench/cli_startup.py [--repeats 10]

Prints the median wall time of each command and its ratio to the bare interpreter start, measured
side by side in one run. Target: both CLI commands under 2 s, with torch never imported.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def _median_seconds(cmd: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    from pathlib import Path

    exe = shutil.which("agentrl", path=str(Path(sys.executable).parent)) or shutil.which("agentrl")
    if exe is None:
        sys.exit("install agentrl first: pip install -e .")
    base = _median_seconds([sys.executable, "-c", "pass"], args.repeats)
    rows = [("python -c pass", base)]
    for argv in (["--help"], ["envs", "list"], ["tools", "list"]):
        rows.append((f"agentrl {' '.join(argv)}", _median_seconds([exe, *argv], args.repeats)))
    torch_loaded = subprocess.run(
        [sys.executable, "-c", "import sys; from agentrl.cli import main; main(['envs','list']); "
         "print('torch' in sys.modules, file=sys.stderr)"], capture_output=True, text=True).stderr.strip()
    print(f"{'command':<24} {'median s':>9} {'x bare python':>14} {'target <2 s':>12}")
    for name, secs in rows:
        verdict = "" if name.startswith("python") else ("ok" if secs < 2 else "MISSED")
        print(f"{name:<24} {secs:>9.3f} {secs / base:>14.1f} {verdict:>12}")
    print(f"torch imported by 'envs list': {torch_loaded}")


if __name__ == "__main__":
    main()
