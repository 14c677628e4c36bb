"""Generate the shipped SWE task set, agentrl/envs/data/swe/tasks.jsonl, from scripts/swe_task_specs.py.

    python scripts/make_swe_tasks.py            # (re)write the task file
    python scripts/make_swe_tasks.py --check    # exit 1 if the shipped file is not what the specs give

For each spec it builds the buggy repository, the reference fix as a unified diff (`patch`) and
the hidden tests as a diff against the repository's own tests (`test_patch`); then it runs every
hidden test with agentrl's grading runner, on this machine, before and after the fix, and derives
FAIL_TO_PASS (fail before, pass after) and PASS_TO_PASS (pass both). A spec whose fix leaves a test
failing, or whose tests all pass before the fix, is an error. The output is deterministic: the
same specs give the same bytes. tests/integration/test_swe_tasks.py re-verifies every task in the
real sandbox.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from swe_task_specs import SPECS, Spec  # noqa: E402

from agentrl.envs.patches import make_patch  # noqa: E402
from agentrl.envs.swe_grading import RUNNER  # noqa: E402

OUT = HERE.parent / "envs" / "data" / "swe" / "tasks.jsonl"


def test_ids(path: str, source: str) -> list[str]:
    """pytest-style ids of the test functions and unittest/Test* class methods in a file, in order."""
    ids = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            ids.append(f"{path}::{node.name}")
        elif isinstance(node, ast.ClassDef) and (node.name.startswith("Test") or node.bases):
            ids += [f"{path}::{node.name}::{f.name}" for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return ids


def run_tests(files: dict[str, str], ids: list[str]) -> dict[str, str]:
    """Status of each test id in a fresh copy of `files`, run by the grading runner."""
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-gen-") as tmp:
        root = Path(tmp)
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        (root / "runner.py").write_text(RUNNER)
        config = {"tests": ids, "out": "results.jsonl", "per_test_timeout_s": 10}
        subprocess.run([sys.executable, "-B", "runner.py"], input=json.dumps(config), text=True, cwd=root,
                       capture_output=True, timeout=120, check=True)
        return {r["test"]: r["status"] for r in map(json.loads, (root / "results.jsonl").read_text().splitlines())}


def build(spec: Spec) -> dict:
    repo = {**spec.files, **spec.visible_tests}
    fixed = dict(repo)
    for path, old, new in spec.fix:
        count = fixed[path].count(old)
        if count != 1:
            raise SystemExit(f"{spec.id}: the fix's old text occurs {count} times in {path}; it must occur once.")
        fixed[path] = fixed[path].replace(old, new)
    touched = sorted({p for p, _, _ in spec.fix})
    patch = make_patch({p: repo[p] for p in touched}, {p: fixed[p] for p in touched})
    test_patch = make_patch({p: repo[p] for p in spec.hidden_tests if p in repo}, spec.hidden_tests)
    ids = [i for path, text in sorted(spec.hidden_tests.items()) for i in test_ids(path, text)]
    before = run_tests({**repo, **spec.hidden_tests}, ids)
    after = run_tests({**fixed, **spec.hidden_tests}, ids)
    broken = [i for i in ids if after.get(i) != "PASSED"]
    if broken:
        raise SystemExit(f"{spec.id}: tests still fail after the reference fix: {broken} ({after})")
    f2p = [i for i in ids if before.get(i) != "PASSED"]
    if not f2p:
        raise SystemExit(f"{spec.id}: every test passes before the fix; the hidden tests do not catch the bug.")
    return {
        "instance_id": spec.id,
        "repo": spec.id.split("__")[0],
        "problem_statement": spec.issue,
        "repo_files": repo,
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": [i for i in ids if i not in f2p],
    }


def render() -> str:
    ids = [s.id for s in SPECS]
    if len(set(ids)) != len(ids):
        raise SystemExit("two specs share an id")
    return "".join(json.dumps(build(s), sort_keys=True) + "\n" for s in sorted(SPECS, key=lambda s: s.id))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default: the shipped file)")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            raise SystemExit(f"{args.out} is not what scripts/swe_task_specs.py generates; "
                             "rerun python scripts/make_swe_tasks.py")
        sys.stdout.write(f"{args.out}: {text.count(chr(10))} tasks, up to date\n")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    sys.stdout.write(f"wrote {text.count(chr(10))} tasks to {args.out}\n")


if __name__ == "__main__":
    main()
