"""Which tests must share a pytest-xdist worker when the slow tier runs on both cores.

`.ci/run` runs the slow tier with `-n 2 --dist loadgroup`: two workers, each test sent to whichever
is free, except that tests in one `xdist_group` run on one worker, one after another. This module
puts tests in groups where running them on two workers at once would be wrong or wasteful:

- tests that use one module-scoped fixture of their module (a training run or a server several
  tests look at): on two workers it would be built twice;
- tests that use a session fixture named in `ONE_WORKER_FIXTURES`;
- tests marked `docker`: they build the same images and look for leftover containers by image;
- the tests of the modules in `ONE_WORKER_MODULES`, which run the built-in model.

Groups are joined transitively (a test in two groups joins them). Tests in no group run wherever a
worker is free. The serial run (`python -m pytest`, the README's) is unaffected: without `--dist
loadgroup` nothing here runs.
"""

from __future__ import annotations

import pytest

__all__ = ["ONE_WORKER_FIXTURES", "ONE_WORKER_MODULES", "group_for_two_workers"]

# Session fixtures that exist once per machine, with why.
ONE_WORKER_FIXTURES: dict[str, str] = {
    "ns_cluster": "its hosts are network namespaces with fixed names and addresses: one cluster per machine",
    "short_run": "a two-step training run several tests look at: built once",
}

# Modules whose tests run the built-in model (SmolLM2-135M, about 4.5 GB a run): all on one worker,
# one after another. Two such runs at once exhaust this 24 GB machine (Ray's OOM killer stopped
# README runs when they shared it), and gain little anyway: decoding it on CPU is bound by memory
# bandwidth (two README-sized runs at once took 85 s against 96 s one after the other, where two
# runs of the tiny model took 35 s against 58). The other worker meanwhile runs the tiny-model tests.
# Two more modules run it, each in a group of its own that keeps it apart from the others' runs:
# tests/e2e/test_cluster_run.py (the namespace cluster's) and tests/e2e/test_fresh_machine.py (Docker's).
ONE_WORKER_MODULES: tuple[str, ...] = (
    "tests/integration/test_readme.py",
    "tests/integration/test_default_model.py",
)
_BUILT_IN_MODEL = "built_in_model"


def _keys(item: pytest.Item) -> list[str]:
    """What ties `item` to other tests (fixture instances it shares, the docker marker)."""
    keys: list[str] = [_BUILT_IN_MODEL] if item.nodeid.split("::")[0] in ONE_WORKER_MODULES else []
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    for name in getattr(item, "fixturenames", ()):
        fixturedefs = defs.get(name)
        if not fixturedefs:
            continue
        scope = fixturedefs[-1].scope
        if scope == "module":
            keys.append(f"{item.nodeid.split('::')[0]}:{name}")
        elif scope == "session" and name in ONE_WORKER_FIXTURES:
            keys.append(name)
    if item.get_closest_marker("docker") is not None:
        keys.append("docker")
    return keys


def group_for_two_workers(items: list[pytest.Item]) -> None:
    """Mark each item that must share a worker with others with `xdist_group(name)` (see the module
    docstring); the name is `built_in_model` for the group of `ONE_WORKER_MODULES`, else one of its keys."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    item_keys = [_keys(item) for item in items]
    for keys in item_keys:
        for key in keys[1:]:
            a, b = find(keys[0]), find(key)
            if a != b:
                parent[b] = a
    members: dict[str, set[str]] = {}
    for keys in item_keys:
        for key in keys:
            members.setdefault(find(key), set()).add(key)
    names = {root: _BUILT_IN_MODEL if _BUILT_IN_MODEL in keys else root for root, keys in members.items()}
    for item, keys in zip(items, item_keys, strict=True):
        if keys and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(names[find(keys[0])].replace("/", ".").replace("@", "_")))
