"""A fault planted in every python of a run that has this folder on its PYTHONPATH (the driver, its
Ray workers, the trainer actor that hosts the colocated engine), chosen by `AGENTRL_PLANTED_FAULT`:

- `colocated-loads-nothing`: the colocated vLLM engine's reload (`colocated._reload_in_worker`)
  consumes every pushed tensor and loads none, so the push is complete and verified, the engine
  reports the new version, and it computes with whatever its weights held (in `sync` mode, storage
  the trainer's step had taken back).

Python imports `sitecustomize` at start-up from the path; nothing is patched without the variable.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

FAULT = os.environ.get("AGENTRL_PLANTED_FAULT", "")
TARGET = "agentrl.inference.colocated"


def _reload_nothing(worker: Any, named_tensors: Iterable[tuple[str, Any]]) -> int:
    for _ in named_tensors:  # received and checked, loaded nowhere
        pass
    return 0


class _PlantOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            module._reload_in_worker = _reload_nothing  # type: ignore[attr-defined]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if FAULT == "colocated-loads-nothing":
    sys.meta_path.insert(0, _PlantOnImport())
elif FAULT:
    raise SystemExit(f"AGENTRL_PLANTED_FAULT={FAULT!r} is not a fault this sitecustomize plants")
