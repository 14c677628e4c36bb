"""SWE instances whose Docker images have a toolchain of their own, built here (nothing is pulled).

Three small repositories, each with a real bug, its tests, a reference fix and a plausible wrong
fix, each published in a different format and baked into an image the way that format's images
are made (the repository at /testbed as a git checkout, a `conda activate testbed` that puts the
image's own Python and pytest first on PATH):

- `batchkit` (SWE-bench format) on Debian trixie, Python 3.13: the reference fix uses
  `itertools.batched(..., strict=True)`, new in 3.13, so it passes only with the image's Python.
- `argsdoc` (SWE-smith format: the row's patch introduces the bug) on Debian bullseye, Python 3.9:
  a code base written against `inspect.getargspec`, which Python 3.11 removed, so neither the bug
  nor its fix even imports with the host's Python.
- `slug` (agentrl format) on Debian bookworm without any Python: a shell tool whose tests print
  unittest-style lines; the tools (bash, the editor, grading) work with only a shell and coreutils.

`instance_image(spec)` builds (once; rebuilt when the files change) and returns the image tag;
`published_row(spec)` is the instance as its format publishes it. Base images come from
`tests/docker_images.py` (debootstrap), a few minutes each on first use.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from typing import Any

from docker_images import debian_image, docker_sdk, image_exists

from agentrl.envs.patches import make_patch

__all__ = ["ARGSDOC", "BATCHKIT", "SLUG", "SPECS", "InstanceSpec", "instance_image", "published_row"]

NAMESPACE = "agentrl-swe-test"
# The layout SWE-bench, SWE-Gym and SWE-smith images share: Miniconda's activate script, and
# `conda activate testbed` putting the env's bin first on PATH. Here the env is the image's Python.
CONDA_ACTIVATE = """# agentrl test image: a stand-in for Miniconda's activate script
conda() {
  if [ "$1" = activate ]; then
    export CONDA_DEFAULT_ENV="$2" PATH="/opt/miniconda3/envs/$2/bin:$PATH"
  fi
}
"""


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    base: tuple[str, str, tuple[str, ...]]  # tag, Debian suite, packages
    repo: dict[str, str]  # the repository as the image holds it
    fix: dict[str, str]  # files the reference fix changes, as it leaves them
    wrong: dict[str, str]  # files a plausible but wrong fix changes
    hidden_tests: dict[str, str] = field(default_factory=dict)  # test files the test patch adds or changes
    bug: dict[str, str] = field(default_factory=dict)  # SWE-smith: files as the bug patch leaves them
    conda: bool = True

    @property
    def tag(self) -> str:
        digest = hashlib.sha256(json.dumps([self.base, self.repo, self.conda], sort_keys=True).encode()).hexdigest()[:10]
        return f"{NAMESPACE}/{self.name}:{digest}"

    def start(self) -> dict[str, str]:
        """The repository as the agent finds it."""
        return {**self.repo, **self.bug}

    def reference_patch(self) -> str:
        return make_patch({k: self.start()[k] for k in self.fix}, self.fix)

    def wrong_patch(self) -> str:
        return make_patch({k: self.start()[k] for k in self.wrong}, self.wrong)


# ── batchkit: SWE-bench format, Python 3.13 ─────────────────────────────────────────────────
_CHUNKS_BUGGY = '''"""Split sequences into fixed-size batches."""
from itertools import islice


def chunked(items, size, *, strict=False):
    """Tuples of `size` consecutive items; the last one may be shorter, unless `strict`.

    With strict=True a short last batch raises ValueError.
    """
    if size < 1:
        raise ValueError("size must be at least 1")
    it = iter(items)
    out = []
    while True:
        batch = tuple(islice(it, size))
        if len(batch) < size:
            break
        out.append(batch)
    return out
'''
_CHUNKS_FIXED = '''"""Split sequences into fixed-size batches."""
from itertools import batched


def chunked(items, size, *, strict=False):
    """Tuples of `size` consecutive items; the last one may be shorter, unless `strict`.

    With strict=True a short last batch raises ValueError.
    """
    if size < 1:
        raise ValueError("size must be at least 1")
    return list(batched(items, size, strict=strict))
'''
_CHUNKS_WRONG = _CHUNKS_BUGGY.replace("""        if len(batch) < size:
            break""", """        if len(batch) < size:
            if batch:
                out.append(batch)
            break""")
_CHUNK_TESTS = '''from batchkit import chunked
import pytest


def test_exact_multiple():
    assert chunked(range(4), 2) == [(0, 1), (2, 3)]


def test_size_must_be_positive():
    with pytest.raises(ValueError):
        chunked([1], 0)
'''
_CHUNK_TESTS_HIDDEN = _CHUNK_TESTS + '''

def test_keeps_the_last_partial_batch():
    assert chunked(range(5), 2) == [(0, 1), (2, 3), (4,)]


def test_strict_rejects_a_short_last_batch():
    with pytest.raises(ValueError):
        chunked(range(5), 2, strict=True)


def test_strict_accepts_an_exact_multiple():
    assert chunked("abcd", 2, strict=True) == [("a", "b"), ("c", "d")]
'''
BATCHKIT = InstanceSpec(
    name="batchkit",
    base=("agentrl-swe-test/debian:trixie-py", "trixie", ("python3", "python3-pytest", "git")),
    repo={"batchkit/__init__.py": 'from batchkit.chunks import chunked\n\n__all__ = ["chunked"]\n',
          "batchkit/chunks.py": _CHUNKS_BUGGY, "tests/test_chunks.py": _CHUNK_TESTS,
          "README.md": "batchkit: split sequences into batches. Needs Python 3.13.\n"},
    fix={"batchkit/chunks.py": _CHUNKS_FIXED},
    wrong={"batchkit/chunks.py": _CHUNKS_WRONG},
    hidden_tests={"tests/test_chunks.py": _CHUNK_TESTS_HIDDEN},
)

# ── argsdoc: SWE-smith format, Python 3.9 ───────────────────────────────────────────────────
_DESCRIBE = '''"""Render a function's signature for the docs. This code base targets Python 3.9."""
import inspect


def describe(fn):
    """`name(a, b=1, *args, **kwargs)` for a plain Python function."""
    spec = inspect.getargspec(fn)
    defaults = spec.defaults or ()
    first_default = len(spec.args) - len(defaults)
    parts = []
    for i, name in enumerate(spec.args):
        if i >= first_default:
            parts.append("%s=%r" % (name, defaults[i - first_default]))
        else:
            parts.append(name)
    if spec.varargs:
        parts.append("*" + spec.varargs)
    if spec.keywords:
        parts.append("**" + spec.keywords)
    return "%s(%s)" % (fn.__name__, ", ".join(parts))
'''
_DESCRIBE_BUGGY = _DESCRIBE.replace("if i >= first_default:", "if i < len(defaults):").replace(
    "defaults[i - first_default]", "defaults[i]")
_DESCRIBE_WRONG = _DESCRIBE_BUGGY.replace("if i < len(defaults):", "if i > len(defaults):")
_DESCRIBE_TESTS = '''from argsdoc.describe import describe


def plain(a, b):
    pass


def defaulted(a, b, c=3, d="x"):
    pass


def starred(a, *rest, **options):
    pass


def test_no_defaults():
    assert describe(plain) == "plain(a, b)"


def test_star_args():
    assert describe(starred) == "starred(a, *rest, **options)"


def test_defaults_belong_to_the_last_arguments():
    assert describe(defaulted) == "defaulted(a, b, c=3, d='x')"
'''
ARGSDOC = InstanceSpec(
    name="argsdoc",
    base=("agentrl-swe-test/debian:bullseye-py", "bullseye", ("python3", "python3-pytest", "git")),
    repo={"argsdoc/__init__.py": "", "argsdoc/describe.py": _DESCRIBE, "tests/test_describe.py": _DESCRIBE_TESTS,
          "tests/test_import.py": "def test_package_imports():\n    import argsdoc\n"},
    bug={"argsdoc/describe.py": _DESCRIBE_BUGGY},
    fix={"argsdoc/describe.py": _DESCRIBE},
    wrong={"argsdoc/describe.py": _DESCRIBE_WRONG},
)

# ── slug: agentrl format, no Python in the image ────────────────────────────────────────────
_SLUG = """#!/bin/sh
# slug TEXT...: a URL slug of TEXT (lower case, words joined by single dashes).
printf '%s\\n' "$*" | tr '[:upper:]' '[:lower:]' | sed -e 's/[^a-z0-9]/-/g' -e 's/^-*//' -e 's/-*$//'
"""
_SLUG_FIXED = _SLUG.replace("-e 's/[^a-z0-9]/-/g'", "-e 's/[^a-z0-9][^a-z0-9]*/-/g'")
_SLUG_WRONG = _SLUG.replace("tr '[:upper:]' '[:lower:]'", "tr -s ' ' | tr '[:upper:]' '[:lower:]'")
_SLUG_RUNNER = """#!/bin/sh
# Each check prints "name (slug.tests) ... ok" or "... FAIL", the way Python's unittest -v does.
cd "$(dirname "$0")/.." || exit 1
check() {
  name=$1; want=$2; shift 2
  got=$(sh bin/slug "$@")
  if [ "$got" = "$want" ]; then echo "$name (slug.tests) ... ok"; else echo "$name (slug.tests) ... FAIL"; fi
}
check test_lowercase "hello" "Hello"
check test_words "hello-world" "hello world"
"""
_SLUG_RUNNER_HIDDEN = _SLUG_RUNNER + """check test_collapses_punctuation "hello-world" "Hello,  World!"
check test_trims_separators "a-b" "-- a  b --"
"""
SLUG = InstanceSpec(
    name="slug",
    base=("agentrl-swe-test/debian:bookworm-nopy", "bookworm", ("git",)),
    repo={"bin/slug": _SLUG, "tests/run.sh": _SLUG_RUNNER},
    fix={"bin/slug": _SLUG_FIXED},
    wrong={"bin/slug": _SLUG_WRONG},
    hidden_tests={"tests/run.sh": _SLUG_RUNNER_HIDDEN},
    conda=False,
)
SPECS = (BATCHKIT, ARGSDOC, SLUG)


def instance_image(spec: InstanceSpec) -> str:
    """The spec's image, built once FROM its Debian base (a git checkout at /testbed)."""
    docker = docker_sdk()
    tag, suite, packages = spec.base
    debian_image(tag, suite=suite, packages=list(packages))
    if image_exists(spec.tag):
        return spec.tag
    lines = [f"FROM {tag}", "COPY testbed /testbed"]
    files = {f"testbed/{k}": v for k, v in spec.repo.items()}
    if spec.conda:
        files["activate"] = CONDA_ACTIVATE
        lines += ["COPY activate /opt/miniconda3/bin/activate",
                  "RUN mkdir -p /opt/miniconda3/envs/testbed/bin && ln -s /usr/bin/python3 /opt/miniconda3/envs/testbed/bin/python"
                  " && printf '#!/bin/sh\\nexec python3 -m pytest \"$@\"\\n' > /opt/miniconda3/envs/testbed/bin/pytest"
                  " && chmod +x /opt/miniconda3/envs/testbed/bin/pytest"]
    lines += ["RUN cd /testbed && git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm base",
              "WORKDIR /testbed"]
    files["Dockerfile"] = "\n".join(lines) + "\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith(("slug", ".sh")) else 0o644
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    docker.from_env().images.build(fileobj=buf, custom_context=True, tag=spec.tag, rm=True, forcerm=True,
                                   network_mode="none", labels={"agentrl.test": "swe"})
    return spec.tag


def published_row(spec: InstanceSpec) -> dict[str, Any]:
    """The instance as its format publishes it (the image must be tagged with the format's name)."""
    statement = {
        "batchkit": ("chunked() silently drops the last items: chunked(range(5), 2) returns [(0, 1), (2, 3)] instead "
                     "of [(0, 1), (2, 3), (4,)]. Also, strict=True is ignored: it should raise ValueError when the "
                     "last batch is short, like itertools.batched(strict=True) does."),
        "argsdoc": ("describe() puts default values on the wrong parameters: for def f(a, b, c=3, d='x') it renders "
                    "\"f(a=3, b='x', c, d)\" instead of \"f(a, b, c=3, d='x')\"."),
        "slug": ("bin/slug leaves runs of dashes: `sh bin/slug 'Hello,  World!'` prints hello---world instead of "
                 "hello-world. Separators should collapse into one dash and never lead or trail."),
    }[spec.name]
    if spec.name == "batchkit":
        hidden = spec.hidden_tests
        return {
            "repo": "batchkit/batchkit", "instance_id": "batchkit__batchkit-1", "base_commit": "0" * 40,
            "version": "1.0", "environment_setup_commit": "0" * 40, "created_at": "2025-01-01T00:00:00Z",
            "problem_statement": statement, "hints_text": "", "patch": spec.reference_patch(),
            "test_patch": make_patch({k: spec.repo.get(k, "") for k in hidden}, hidden),
            "FAIL_TO_PASS": json.dumps(["tests/test_chunks.py::test_keeps_the_last_partial_batch",
                                        "tests/test_chunks.py::test_strict_rejects_a_short_last_batch"]),
            "PASS_TO_PASS": json.dumps(["tests/test_chunks.py::test_exact_multiple",
                                        "tests/test_chunks.py::test_size_must_be_positive",
                                        "tests/test_chunks.py::test_strict_accepts_an_exact_multiple"]),
        }
    if spec.name == "argsdoc":
        return {
            "instance_id": "argsdoc__argsdoc.0001.describe_defaults", "repo": "swesmith/argsdoc__argsdoc.0001",
            "patch": make_patch({k: spec.repo[k] for k in spec.bug}, spec.bug), "problem_statement": statement,
            "FAIL_TO_PASS": ["tests/test_describe.py::test_defaults_belong_to_the_last_arguments"],
            "PASS_TO_PASS": ["tests/test_describe.py::test_no_defaults", "tests/test_describe.py::test_star_args",
                             "tests/test_import.py::test_package_imports"],
            "image_name": f"{NAMESPACE}/swesmith.x86_64.argsdoc__argsdoc.0001",
        }
    hidden = spec.hidden_tests
    return {
        "instance_id": "slug__collapse-separators", "problem_statement": statement, "format": "agentrl",
        "image": spec.tag, "image_repo_dir": "/testbed", "test_cmd": "sh tests/run.sh", "log_parser": "unittest",
        "patch": spec.reference_patch(),
        "test_patch": make_patch({k: spec.repo.get(k, "") for k in hidden}, hidden),
        "FAIL_TO_PASS": ["test_collapses_punctuation (slug.tests)", "test_trims_separators (slug.tests)"],
        "PASS_TO_PASS": ["test_lowercase (slug.tests)", "test_words (slug.tests)"],
    }


def format_image_name(spec: InstanceSpec) -> str:
    """The image name the spec's published format derives from its row."""
    from agentrl.envs.swe_tasks import SweTask

    return SweTask.from_dict(published_row(spec), image_namespace=NAMESPACE).image or ""


def tag_for_format(spec: InstanceSpec) -> str:
    """Build the spec's image and tag it with the name its format gives it; return that name."""
    docker = docker_sdk()
    built = instance_image(spec)
    name = format_image_name(spec)
    if name != built:
        repo, _, tag = name.rpartition(":")
        docker.from_env().images.get(built).tag(repo, tag or "latest")
    return name
