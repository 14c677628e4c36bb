"""Apply received weights to a torch module in place.

`load_into_module` copies a stream of `(name, tensor)` pairs into a module's parameters and
persistent buffers (the names of `module.state_dict()`), one tensor at a time, so a stream of
views into a reused receive buffer is safe to pass. Names can be mapped first (a dict or a
function, for trainer and server naming that differ); shapes must match exactly and dtypes must
match unless `allow_cast=True`. Every problem is collected and reported at once.

It does not build modules, move them between devices or handle sharded (FSDP/TP) parameters:
a sharded server loads its own slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from agentrl.errors import WeightSyncError

__all__ = ["LoadReport", "load_into_module"]


@dataclass
class LoadReport:
    """What a load did: names copied, target names never received, received names with no target."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_into_module(
    module: torch.nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    name_map: Mapping[str, str] | Callable[[str], str | None] | None = None,
    strict: bool = True,
    allow_cast: bool = False,
) -> LoadReport:
    """Copy `named_tensors` into `module`'s parameters and buffers in place; return a LoadReport.

    `name_map` renames incoming names (a function may return None to drop a name). With
    `strict=True` (the default) any unexpected or missing name raises WeightSyncError after the
    stream is consumed; names tied to a loaded tensor (shared storage, e.g. tied embeddings)
    count as loaded. Shape mismatches, and dtype mismatches without `allow_cast`, always raise.
    """
    targets = module.state_dict(keep_vars=True)
    report = LoadReport()
    problems: list[str] = []
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name_map is not None:
                mapped = name_map(name) if callable(name_map) else name_map.get(name, name)
                if mapped is None:
                    continue
                name = mapped
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                problems.append(f"'{name}': shape {tuple(tensor.shape)} received, module has {tuple(target.shape)}")
                continue
            if target.dtype != tensor.dtype and not allow_cast:
                problems.append(f"'{name}': dtype {tensor.dtype} received, module has {target.dtype} "
                                "(pass allow_cast=True to convert)")
                continue
            target.data.copy_(tensor)
            report.loaded.append(name)
    loaded_ptrs = {targets[n].data_ptr() for n in report.loaded}
    loaded_names = set(report.loaded)
    report.missing = [n for n, t in targets.items()
                      if n not in loaded_names and not (t.numel() and t.data_ptr() in loaded_ptrs)]
    report.unexpected = unexpected
    if strict:
        if unexpected:
            problems.append(f"unexpected names (no such parameter or buffer): {_listed(unexpected)}")
        if report.missing:
            problems.append(f"missing names (never received): {_listed(report.missing)}")
    if problems:
        raise WeightSyncError(
            f"Loading weights into {type(module).__name__} failed ({len(report.loaded)} tensors copied):\n  "
            + "\n  ".join(problems)
            + "\nCheck that trainer and server build the same architecture, or pass name_map=."
        )
    return report
