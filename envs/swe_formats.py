"""Published SWE instance formats, read as they are: SWE-bench (and Verified, Lite), SWE-Gym, SWE-smith, R2E-Gym.

`to_instance(row, format=...)` turns one published row into agentrl's instance fields (see
`agentrl.envs.swe_tasks`); `detect_format(row)` tells the formats apart. What each format brings:

- **SWE-bench / SWE-bench_Verified / Lite** (`princeton-nlp/SWE-bench*`, `SWE-bench/SWE-bench*`):
  `instance_id, repo, base_commit, version, problem_statement, hints_text, patch, test_patch,
  FAIL_TO_PASS, PASS_TO_PASS` (JSON-encoded lists), `environment_setup_commit`, `created_at`.
  Image `swebench/sweb.eval.x86_64.<id with "__" as "_1776_">:latest` (`image_namespace=""` for
  images the SWE-bench harness built locally); the repository at /testbed, the conda env
  `testbed`. Tests run as SWE-bench's harness runs them: the test files of `test_patch` as
  directives (Django: as test modules), with the repository family's command and log parser
  (pytest `-rA`, Django's `runtests.py --verbosity 2`, sympy's `bin/test -C --verbose`, tox for
  sphinx).
- **SWE-Gym** (`SWE-Gym/SWE-Gym`, `-Lite`): SWE-bench's fields; image
  `xingyaoww/sweb.eval.x86_64.<id with "__" as "_s_">:latest`; tests with pytest `-rA` on the test
  files named by FAIL_TO_PASS and PASS_TO_PASS.
- **SWE-smith** (`SWE-bench/SWE-smith`): `instance_id, repo, patch, FAIL_TO_PASS, PASS_TO_PASS,
  image_name, problem_statement`. Its `patch` *introduces* the bug: it is applied at reset, and
  the reference fix is its reverse. The FAIL_TO_PASS test files are removed at reset and put back
  for grading (SWE-smith hides them from the agent the same way); tests run with pytest
  `--verbose` on those files, and PASS_TO_PASS tests outside them are not run (SWE-smith counts
  them as passing).
- **R2E-Gym** (`R2E-Gym/R2E-Gym-Subset`, `-Lite`, `-V1`): `repo_name, docker_image, commit_hash,
  problem_statement, parsed_commit_content, expected_output_json, ...`. The hidden tests
  (/r2e_tests, /testbed/run_tests.sh) are moved to /root at reset, linked back for grading; the
  reference fix is the commit's non-test Python files. A test must reach the status
  `expected_output_json` gives it; tests expected to pass are FAIL_TO_PASS here (R2E-Gym also
  demands the expected failures keep failing, which agentrl does not grade).

Nothing here runs code or talks to Docker.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from typing import Any

from agentrl.envs.patches import PatchError, reverse_patch
from agentrl.errors import DatasetError

__all__ = ["FORMATS", "detect_format", "swe_bench_image", "swe_gym_image", "to_instance"]

FORMATS = ("agentrl", "swe-bench", "swe-gym", "swe-smith", "r2e-gym")

CONDA = "source /opt/miniconda3/bin/activate && conda activate testbed"
TESTBED = "/testbed"
PYTEST = "pytest -rA --tb=no -p no:cacheprovider"
SWE_GYM_REPOS = frozenset({
    "getmoto/moto", "python/mypy", "pandas-dev/pandas", "iterative/dvc", "conan-io/conan", "dask/dask",
    "pydantic/pydantic", "bokeh/bokeh", "facebookresearch/hydra", "modin-project/modin", "project-monai/monai",
    "Project-MONAI/MONAI",
})
# SWE-bench's per-repository test commands (swebench.harness.constants.python), by family.
_DJANGO = ("export LANG=en_US.UTF-8 LC_ALL=en_US.UTF-8 LANGUAGE=en_US:en PYTHONIOENCODING=utf8; "
           "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1")
_SWE_BENCH_CMDS = {
    "django/django": (_DJANGO, "django"),
    "sympy/sympy": ("PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose", "sympy"),
    "sphinx-doc/sphinx": ("tox --current-env -epy39 -v --", "pytest"),
    "astropy/astropy": ("pytest -rA -vv -o console_output_style=classic --tb=no -p no:cacheprovider", "pytest"),
    "mwaskom/seaborn": ("pytest --no-header -rA", "pytest"),
}
_NON_TEST_EXTS = (".json", ".png", ".csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
_SWE_SMITH_PYTEST = "pytest --disable-warnings --color=no --tb=no --verbose"


def detect_format(row: dict[str, Any]) -> str:
    """Which published format `row` is in (see the module docstring); raises DatasetError if none."""
    if any(row.get(k) for k in ("repo_files", "repo_path", "image_repo_dir")) or row.get("format") == "agentrl":
        return "agentrl"
    if row.get("docker_image") and ("parsed_commit_content" in row or "expected_output_json" in row):
        return "r2e-gym"
    if row.get("image_name") and not row.get("test_patch"):
        return "swe-smith"
    if row.get("repo") and row.get("base_commit") and "test_patch" in row:
        return "swe-gym" if row["repo"] in SWE_GYM_REPOS else "swe-bench"
    raise DatasetError(
        f"Row {str(row.get('instance_id') or '')!r} is in no SWE format agentrl knows (keys: {sorted(row)[:12]}). "
        f"Give one of {', '.join(FORMATS)} rows (see agentrl.envs.swe_formats)."
    )


def swe_bench_image(instance_id: str, namespace: str = "swebench") -> str:
    """SWE-bench's instance image name (Docker forbids "__", written "_1776_")."""
    name = f"sweb.eval.x86_64.{instance_id.replace('__', '_1776_')}:latest".lower()
    return f"{namespace}/{name}" if namespace else name


def swe_gym_image(instance_id: str) -> str:
    """SWE-Gym's instance image name ("__" written "_s_")."""
    return f"xingyaoww/sweb.eval.x86_64.{instance_id.replace('__', '_s_')}:latest".lower()


def _id_list(value: Any) -> list[str]:
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    return [str(v) for v in value or []]


def _test_files(test_ids: list[str]) -> list[str]:
    return sorted({t.split("::", 1)[0] for t in test_ids if "::" in t})


def _directives(repo: str, test_patch: str) -> list[str]:
    """SWE-bench's test directives: the files its test patch touches (Django: as test modules)."""
    paths = [p for p in re.findall(r"^diff --git a/.* b/(.*)$", test_patch, flags=re.M)
             if not p.endswith(_NON_TEST_EXTS)]
    if repo != "django/django":
        return paths
    out = []
    for p in paths:
        name = posixpath.basename(p)
        if not (name == "tests.py" or name.startswith("test_") or "/tests/" in p or "/test_" in p):
            continue
        p = p[: -len(".py")] if p.endswith(".py") else p
        p = p[len("tests/"):] if p.startswith("tests/") else p
        out.append(p.replace("/", "."))
    return out


def _keep(row: dict[str, Any], used: set[str]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in used}


def _from_swe_bench(row: dict[str, Any], image: str, fmt: str) -> dict[str, Any]:
    repo = str(row["repo"])
    f2p, p2p = _id_list(row.get("FAIL_TO_PASS")), _id_list(row.get("PASS_TO_PASS"))
    if fmt == "swe-bench":
        command, parser = _SWE_BENCH_CMDS.get(repo, (PYTEST, "pytest"))
        targets = _directives(repo, row.get("test_patch") or "")
    else:
        command, parser = ("pytest -n0 -rA --tb=no -p no:cacheprovider" if repo == "getmoto/moto" else PYTEST), "pytest"
        targets = _test_files(f2p + p2p)
    used = {"instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS", "patch", "test_patch"}
    return {
        **_keep(row, used), "format": fmt,
        "instance_id": row["instance_id"], "problem_statement": row["problem_statement"],
        "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "patch": row.get("patch") or "", "test_patch": row.get("test_patch") or "",
        "image": image, "image_repo_dir": TESTBED, "env_setup": CONDA,
        "test_cmd": " ".join([command, *(shlex.quote(t) for t in targets)]), "log_parser": parser,
    }


def _swe_smith_image(name: str) -> str:
    owner, _, rest = name.rpartition("/")
    rest = rest.replace("__", "_1776_")
    if ":" not in rest:
        rest += ":latest"
    return f"{owner or 'jyangballin'}/{rest}"


def _from_swe_smith(row: dict[str, Any]) -> dict[str, Any]:
    iid = str(row["instance_id"])
    f2p, p2p = _id_list(row.get("FAIL_TO_PASS")), _id_list(row.get("PASS_TO_PASS"))
    files = _test_files(f2p)
    p2p = [t for t in p2p if t.split("::", 1)[0] in files] if files else p2p
    try:
        fix = reverse_patch(row["patch"])
    except PatchError as exc:
        raise DatasetError(f"Instance {iid}: its SWE-smith bug patch cannot be reversed into a fix: {exc}") from exc
    used = {"instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS", "patch", "image_name"}
    return {
        **_keep(row, used), "format": "swe-smith",
        "instance_id": iid, "problem_statement": row["problem_statement"],
        "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "start_patch": row["patch"], "patch": fix,
        "hidden_files": files, "image": _swe_smith_image(str(row["image_name"])), "image_repo_dir": TESTBED,
        "env_setup": CONDA, "test_cmd": " ".join([_SWE_SMITH_PYTEST, *(shlex.quote(f) for f in files)]),
        "log_parser": "pytest",
    }


def _r2e_gold_patch(parsed: Any) -> str:
    """The non-test Python file diffs of R2E-Gym's `parsed_commit_content`, as a unified diff."""
    commit = json.loads(parsed) if isinstance(parsed, str) else parsed
    out = []
    for fd in (commit or {}).get("file_diffs", []):
        old, new = fd["old_file"]["path"], fd["new_file"]["path"]
        parts = new.split("/")
        if not new.endswith(".py") or new.endswith("_test.py") or new.startswith("test_") or "tests" in parts:
            continue
        old_name = "/dev/null" if old in ("", "/dev/null") else f"a/{old}"
        lines = [f"diff --git a/{old or new} b/{new}", f"--- {old_name}", f"+++ b/{new}"]
        for hunk in fd.get("hunks", []):
            d, g = hunk["descriptor"], hunk["line_group"]
            o, n = d["old_range"], d["new_range"]
            lines.append(f"@@ -{o['start']},{o.get('length') or 0} +{n['start']},{n.get('length') or 0} @@")
            lines += [" " + x["content"] for x in g.get("pre_context_lines", [])]
            lines += ["-" + x["content"] for x in g.get("left_lines", [])]
            lines += ["+" + x["content"] for x in g.get("right_lines", [])]
            lines += [" " + x["content"] for x in g.get("post_context_lines", [])]
        out.append("\n".join(lines) + "\n")
    return "".join(out)


def _from_r2e_gym(row: dict[str, Any]) -> dict[str, Any]:
    image = str(row["docker_image"])
    repo = str(row.get("repo_name") or row.get("repo") or image.split("/")[-1].split(":")[0])
    iid = str(row.get("instance_id") or f"{repo}__{str(row.get('commit_hash') or image.rsplit(':', 1)[-1])[:12]}")
    expected = row.get("expected_output_json") or "{}"
    expected = json.loads(expected) if isinstance(expected, str) else dict(expected)
    passing = sorted(re.sub(r"\x1b\[\d+m", "", k).split(" - ")[0] for k, v in expected.items() if v == "PASSED")
    statement = str(row.get("problem_statement") or "")
    inner = re.search(r"\[ISSUE\](.*)\[/ISSUE\]", statement, flags=re.S)
    used = {"problem_statement", "docker_image", "expected_output_json", "parsed_commit_content"}
    return {
        **_keep(row, used), "format": "r2e-gym",
        "instance_id": iid, "problem_statement": (inner.group(1) if inner else statement).strip(),
        "FAIL_TO_PASS": passing, "PASS_TO_PASS": [],
        "patch": _r2e_gold_patch(row["parsed_commit_content"]) if row.get("parsed_commit_content") else "",
        "image": image, "image_repo_dir": TESTBED,
        "env_setup": 'export PATH="/root/.venv/bin:/root/.local/bin:$PATH"',
        "setup_cmd": ("ln -sfn /testbed/.venv /root/.venv 2>/dev/null; "
                      "if [ -e run_tests.sh ]; then mv run_tests.sh /root/run_tests.sh; fi; "
                      "if [ -d /r2e_tests ]; then rm -rf /root/r2e_tests && mv /r2e_tests /root/r2e_tests; fi; true"),
        "test_cmd": "ln -sfn /root/r2e_tests r2e_tests && bash /root/run_tests.sh; s=$?; rm -f r2e_tests; exit $s",
        "log_parser": "r2e",
    }


def to_instance(row: dict[str, Any], *, format: str = "auto", image_namespace: str = "swebench") -> dict[str, Any]:
    """agentrl's instance fields for one published row (`format`: one of FORMATS, or "auto")."""
    if not isinstance(row, dict):
        raise DatasetError(f"A SWE instance must be a JSON object, got {type(row).__name__}.")
    fmt = detect_format(row) if format == "auto" else format
    if fmt not in FORMATS:
        raise DatasetError(f"Unknown SWE format {format!r}; use one of {', '.join(FORMATS)} or 'auto'.")
    if fmt == "agentrl":
        return row
    iid = str(row.get("instance_id") or row.get("docker_image") or "?")
    try:
        if fmt == "swe-bench":
            return _from_swe_bench(row, swe_bench_image(str(row["instance_id"]), image_namespace), fmt)
        if fmt == "swe-gym":
            return _from_swe_bench(row, swe_gym_image(str(row["instance_id"])), fmt)
        if fmt == "swe-smith":
            return _from_swe_smith(row)
        return _from_r2e_gym(row)
    except KeyError as exc:
        raise DatasetError(f"Instance {iid}: a {fmt} row needs the field {exc.args[0]!r}.") from exc
    except (ValueError, TypeError) as exc:
        raise DatasetError(f"Instance {iid}: this {fmt} row is malformed: {exc}") from exc
