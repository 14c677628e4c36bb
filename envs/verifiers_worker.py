"""The process in which `env=verifiers` runs verifiers tasksets: standard library plus verifiers only.

verifiers 0.4 pins `openai<3` and `mcp==2.0.0`, which agentrl's own environment does not allow, so it
is installed into a folder of its own (`bash scripts/install.sh verifiers`) and loaded here, in a
process whose `sys.path` starts with that folder, never in agentrl's process. This file is run by
path, `python -I verifiers_worker.py --path FOLDER`, so agentrl's package `__init__` never loads
and nothing of agentrl (or its pydantic) is imported; `agentrl.envs.verifiers_process` starts it
and speaks to it, and `agentrl.envs.verifiers_env` is the env built on it.

The protocol is JSON lines. The worker's first line on stdout is `{"ready": true, "verifiers":
VERSION}` (or `{"ready": false, "message": ...}` when verifiers does not import). Then each request
on stdin is one object with a number `n` and an `op`, answered by one line with the same `n`:

- `{"op": "load", "taskset": ID, "kwargs": {...}, "max_rows": N}`: the taskset's first N tasks,
  `{"ok": true, "tasks": [{"data": TaskData as JSON, "key": ...}, ...]}`.
- `{"op": "score", "taskset": ID, "kwargs": {...}, "data": TaskData as JSON, "messages": [...],
  "timeout_s": S}`: the task's `score` over a `vf.Trace` of the messages, `{"ok": true, "reward":
  R, "rewards": {name: score or null (unscored)}, "metrics": {name: number}}`.

A failure answers `{"ok": false, "kind": K, "message": ...}`, K being `config` (the taskset or its
kwargs are wrong), `unavailable` (the taskset needs what env=verifiers does not run), `task` (the
task data does not fit the taskset), `timeout` (the rubric ran past `timeout_s`) or `failed` (the
rubric raised). Requests run concurrently on one event loop. Whatever the taskset's code prints goes
to stderr: stdout carries the protocol only. The worker exits when its stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import site
import sys
import threading
from pathlib import Path
from typing import Any

__all__: list[str] = []


class _Refused(Exception):
    """A request that cannot be served, with the `kind` its answer carries."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _use_folder(folder: str) -> None:
    """Put `folder` (a `pip install --target` of verifiers) first on sys.path, its .pth files read."""
    before = list(sys.path)
    site.addsitedir(folder)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before


class _Tasksets:
    """The tasksets loaded so far, by (id, kwargs)."""

    def __init__(self, vf: Any) -> None:
        self.vf = vf
        self.loaded: dict[str, Any] = {}

    def get(self, taskset_id: str, kwargs: dict[str, Any]) -> Any:
        key = json.dumps([taskset_id, kwargs], sort_keys=True)
        if key not in self.loaded:
            self.loaded[key] = self._load(taskset_id, kwargs)
        return self.loaded[key]

    def _load(self, taskset_id: str, kwargs: dict[str, Any]) -> Any:
        vf = self.vf
        from verifiers.v1.utils.generic import concrete_type
        from verifiers.v1.utils.loaders import _plugin_class, file_module, taskset_class

        is_file = taskset_id.endswith(".py")
        try:
            if is_file:
                if not Path(taskset_id).is_file():
                    raise _Refused("config", f"env.kwargs.id '{taskset_id}' is not a file.")
                cls = _plugin_class(file_module(taskset_id), vf.Taskset, "taskset")
            else:
                cls = taskset_class(taskset_id)
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            raise _Refused("config", f"env.kwargs.id '{taskset_id}' names no verifiers taskset: "
                                     f"{type(exc).__name__}: {exc}") from exc
        config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        try:
            config = config_cls(**({} if is_file else {"id": taskset_id}), **kwargs)
        except Exception as exc:  # pydantic's ValidationError: the user's taskset_kwargs
            raise _Refused("config", f"env.kwargs.taskset_kwargs do not fit {config_cls.__name__}: {exc}") from exc
        taskset = cls(config)
        if cls.toolsets(config) or cls.task_type().toolsets(config.task):
            raise _Refused(
                "unavailable",
                f"the verifiers taskset '{taskset_id}' declares tool servers (Toolsets); env=verifiers does not "
                "run them yet (see agentrl.envs.verifiers_env). Serve them with env=mcp, or run its harness "
                "through env=agent.")
        return taskset


def _trace(vf: Any, task: Any, messages: list[dict[str, Any]]) -> Any:
    from verifiers.v1.graph import MessageNode

    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    kept = [m for m in messages if m.get("role") in kinds]
    nodes = [MessageNode(message=kinds[m["role"]](content=m.get("content") or ""), parent=i - 1 if i else None,
                         sampled=i == len(kept) - 1)  # the one turn the model sampled: the last
             for i, m in enumerate(kept)]
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)


async def _serve(request: dict[str, Any], tasksets: _Tasksets) -> dict[str, Any]:
    vf = tasksets.vf
    taskset = tasksets.get(str(request["taskset"]), dict(request.get("kwargs") or {}))
    if request["op"] == "load":
        tasks = [{"data": t.data.model_dump(mode="json", exclude_none=True), "key": t.key}
                 for t in taskset.take(int(request["max_rows"]))]
        return {"ok": True, "tasks": tasks}
    if request["op"] != "score":
        raise _Refused("task", f"unknown op {request['op']!r}")
    task_cls = type(taskset).task_type()
    try:
        task = task_cls(task_cls.data_type().model_validate(request["data"]), taskset.config.task)
    except Exception as exc:  # pydantic's ValidationError: a row whose task data this taskset does not take
        raise _Refused("task", f"the row's task data does not fit {task_cls.data_type().__name__}: {exc}") from exc
    trace = _trace(vf, task, list(request["messages"]))
    timeout_s = float(request["timeout_s"])
    try:
        await asyncio.wait_for(task.score(trace), timeout_s)
    except TimeoutError as exc:
        raise _Refused("timeout", f"did not finish within {timeout_s:.0f} s") from exc
    except Exception as exc:  # the task's own reward code: whatever it raises, the episode was not scored
        raise _Refused("failed", f"{type(exc).__name__}: {exc}") from exc
    rewards = {name: (None if r is None else float(r.score)) for name, r in trace.rewards.items()}
    metrics = {name: float(v) for name, v in trace.metrics.items()
               if isinstance(v, int | float) and not isinstance(v, bool)}
    unscored = any(r is None for r in rewards.values())
    return {"ok": True, "reward": None if unscored else float(trace.reward), "rewards": rewards, "metrics": metrics}


def main(argv: list[str]) -> None:
    if argv[:1] != ["--path"] or len(argv) != 2:
        sys.exit("usage: python -I verifiers_worker.py --path FOLDER")
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the taskset's prints go to stderr; stdout carries answers only
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        protocol.write(json.dumps(obj) + "\n")
        protocol.flush()

    _use_folder(argv[1])
    try:
        import verifiers
        import verifiers.v1 as vf
    except Exception as exc:  # a missing or broken install: say so, then exit
        send({"ready": False, "message": f"{type(exc).__name__}: {exc} (sys.path starts {sys.path[:2]})"})
        sys.exit(1)
    send({"ready": True, "verifiers": getattr(verifiers, "__version__", "?")})
    tasksets = _Tasksets(vf)
    loop = asyncio.new_event_loop()
    running: set[asyncio.Task[None]] = set()

    async def answer(request: dict[str, Any]) -> None:
        try:
            reply = await _serve(request, tasksets)
        except _Refused as exc:
            reply = {"ok": False, "kind": exc.kind, "message": str(exc)}
        except Exception as exc:  # a bug here or in verifiers: the request fails, the worker goes on
            reply = {"ok": False, "kind": "failed", "message": f"{type(exc).__name__}: {exc}"}
        send({"n": request.get("n"), **reply})

    def dispatch(line: str) -> None:
        try:
            request = json.loads(line)
        except ValueError:
            send({"n": None, "ok": False, "kind": "task", "message": f"not JSON: {line[:200]!r}"})
            return
        task = loop.create_task(answer(request))
        running.add(task)
        task.add_done_callback(running.discard)

    def read() -> None:  # stdin in a thread of its own: the loop stays free for the rubrics
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(dispatch, line)
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read, daemon=True).start()
    loop.run_forever()
    os._exit(0)  # stdin closed: the parent is gone or done; rubrics still running are abandoned


if __name__ == "__main__":
    main(sys.argv[1:])
