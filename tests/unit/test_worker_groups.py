"""`tests/worker_groups.py`: which slow tests share a pytest-xdist worker under `--dist loadgroup`."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker_groups import group_for_two_workers


class _Item:
    """What `group_for_two_workers` reads of a pytest item: its id, fixtures (with scopes) and marks."""

    def __init__(self, nodeid: str, fixtures: dict[str, str], docker: bool = False) -> None:
        self.nodeid = nodeid
        self.fixturenames = list(fixtures)
        self._fixtureinfo = SimpleNamespace(name2fixturedefs={n: [SimpleNamespace(scope=s)] for n, s in fixtures.items()})
        self.marks: dict[str, pytest.MarkDecorator] = {"docker": pytest.mark.docker} if docker else {}

    def get_closest_marker(self, name: str):
        mark = self.marks.get(name)
        return mark.mark if mark is not None else None

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        self.marks[mark.name] = mark

    @property
    def group(self) -> str | None:
        mark = self.get_closest_marker("xdist_group")
        return mark.args[0] if mark is not None else None


def test_shared_fixtures_docker_and_the_built_in_model_join_groups_and_the_rest_stay_free() -> None:
    items = [
        _Item("tests/integration/test_a.py::t1", {"server": "module", "tmp_path": "function"}),
        _Item("tests/integration/test_a.py::t2", {"server": "module"}),
        _Item("tests/integration/test_b.py::t3", {"server": "module"}),  # another module's instance
        _Item("tests/integration/test_c.py::t4", {"ns_cluster": "session"}),
        _Item("tests/e2e/test_d.py::t5", {"ns_cluster": "session", "vllm_server": "session"}),
        _Item("tests/integration/test_e.py::t6", {"vllm_server": "session"}),  # per worker: free
        _Item("tests/integration/test_f.py::t7", {}, docker=True),
        _Item("tests/integration/test_readme.py::t8", {}, docker=True),  # joins docker to the model's group
        _Item("tests/integration/test_default_model.py::t9", {}),
    ]
    group_for_two_workers(items)  # type: ignore[arg-type]
    groups = [i.group for i in items]
    assert groups[0] == groups[1] == "tests.integration.test_a.py:server"
    assert groups[2] == "tests.integration.test_b.py:server"
    assert groups[3] == groups[4] == "ns_cluster"
    assert groups[5] is None
    assert groups[6] == groups[7] == groups[8] == "built_in_model"
