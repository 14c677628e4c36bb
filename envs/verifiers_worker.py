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
- `{"op": "play", "taskset": ID, "kwargs": {...}, "data": TaskData as JSON, "base_url": URL,
  "model": NAME, "max_turns": N or null, "timeout_s": S}`: one episode of a multi-turn taskset
  (one whose package exports a `vf.Env` with one agent seat, or that declares toolsets), played by verifiers itself
  (`Env.run_episode`), its seat's model calls sent to `base_url`; the answer is the seat's trace
  as scored by verifiers, `{"ok": true, "reward": R, "rewards": ..., "metrics": ..., "turns": N,
  "stop": STOP_CONDITION, "reply": LAST_REPLY}`.

`load` also says how the taskset is played: `"multi_turn": true` with the `"env"` class that plays it
when its package exports a `vf.Env` (the model and that env take turns) or when it or its tasks
declare toolsets (verifiers' `SingleAgentEnv`: the model and the tools take turns), false for a plain
taskset (one reply, scored by `score`). Toolsets start as verifiers starts them in its subprocess
runtime, `sys.executable -m MODULE` (`_ToolServers` makes that find verifiers and a taskset file);
other toolset runtimes are refused. The seat's program is verifiers' own chat program (the `null`
harness's), run by this interpreter with the verifiers folder first on its path instead of by `uv`
(which would download its dependencies: they are in the folder already), in verifiers' subprocess
runtime; it talks to the model through verifiers' interception server, as every verifiers harness does.

A failure answers `{"ok": false, "kind": K, "message": ...}`, K being `config` (the taskset or its
kwargs are wrong), `unavailable` (the taskset needs what env=verifiers does not run), `task` (the
task data does not fit the taskset), `timeout` (the rubric, or the episode, ran past `timeout_s`) or
`failed` (the rubric raised, or verifiers recorded the episode as failed: its errors are the message). Requests run concurrently on one event loop. Whatever the taskset's code prints goes
to stderr: stdout carries the protocol only. The worker exits when its stdin closes.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.util
import inspect
import json
import os
import site
import sys
import tempfile
import threading
import types
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
    """The tasksets loaded so far, by (id, kwargs), with how each is played."""

    def __init__(self, vf: Any, folder: str) -> None:
        self.vf = vf
        self.folder = folder
        self.loaded: dict[str, Any] = {}
        self.players: dict[str, tuple[str, type, str]] = {}  # key -> (plugin id, vf.Env class, seat)
        self.harness = _ChatHarness(vf, folder)
        self.tool_servers = _ToolServers(folder)

    def get(self, taskset_id: str, kwargs: dict[str, Any]) -> Any:
        key = json.dumps([taskset_id, kwargs], sort_keys=True)
        if key not in self.loaded:
            self.loaded[key] = self._load(taskset_id, kwargs, key)
        return self.loaded[key]

    def player(self, taskset_id: str, kwargs: dict[str, Any]) -> tuple[str, type, str] | None:
        """The plugin id, `vf.Env` class and seat that play a multi-turn taskset; None for a plain one."""
        self.get(taskset_id, kwargs)
        return self.players.get(json.dumps([taskset_id, kwargs], sort_keys=True))

    def _load(self, taskset_id: str, kwargs: dict[str, Any], key: str) -> Any:
        vf = self.vf
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.envs.single_agent import SingleAgentEnv
        from verifiers.v1.utils.generic import concrete_type
        from verifiers.v1.utils.loaders import environment_class, taskset_class

        plugin_id = taskset_id
        try:
            if taskset_id.endswith(".py"):
                if not Path(taskset_id).is_file():
                    raise _Refused("config", f"env.kwargs.id '{taskset_id}' is not a file.")
                # verifiers finds a taskset's Env (and its config) by plugin id, an importable module: the
                # file is registered as one under a name of its own, so its loaders take it like a package.
                plugin_id = "agentrl_taskset_" + hashlib.sha1(taskset_id.encode()).hexdigest()[:12]
                if plugin_id not in sys.modules:
                    _import_file(plugin_id, taskset_id)
            cls = taskset_class(plugin_id)
            env_cls = environment_class(plugin_id)
        except ModuleNotFoundError as exc:  # verifiers' loader says so when the id names no module
            raise _Refused("config", f"env.kwargs.id '{taskset_id}' names no verifiers taskset: {exc}") from exc
        except ImportError as exc:  # the taskset's module raised it: a package of its own is missing
            raise _Refused(
                "unavailable",
                f"the verifiers taskset '{taskset_id}' does not import: {exc}. The packages it needs must be in the "
                f"verifiers folder, {self.folder}, beside verifiers' pinned ones (pip install --target there, with "
                "verifiers==0.4.0 and its extra, e.g. 'verifiers[ta]==0.4.0' for TextArena).") from exc
        except (AttributeError, TypeError, ValueError) as exc:
            raise _Refused("config", f"env.kwargs.id '{taskset_id}' names no verifiers taskset: "
                                     f"{type(exc).__name__}: {exc}") from exc
        config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        try:
            config = config_cls(**({} if plugin_id != taskset_id else {"id": taskset_id}), **kwargs)
        except Exception as exc:  # pydantic's ValidationError: the user's taskset_kwargs
            raise _Refused("config", f"env.kwargs.taskset_kwargs do not fit {config_cls.__name__}: {exc}") from exc
        taskset = cls(config)
        toolsets = [*cls.toolsets(config), *cls.task_type().toolsets(config.task)]
        self._check_toolsets(taskset_id, toolsets)
        if toolsets:
            self.tool_servers.allow(plugin_id, taskset_id)
        if env_cls is not SingleAgentEnv:
            env_config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
            seats = [n for n, f in env_config_cls.model_fields.items() if isinstance(f.default, AgentConfig)]
            if len(seats) != 1:
                raise _Refused(
                    "unavailable",
                    f"the verifiers taskset '{taskset_id}' is played by {env_cls.__name__}, whose episodes have "
                    f"{len(seats)} agent seats ({', '.join(seats) or 'none'}); env=verifiers plays the policy in "
                    "one seat, so it runs envs of exactly one (a user simulator or a judge seat needs a second "
                    "model, which an offline run does not have).")
            self.players[key] = (plugin_id, env_cls, seats[0])
        elif toolsets:  # a plain taskset with tools: verifiers' SingleAgentEnv plays it, its one seat `agent`
            self.players[key] = (plugin_id, env_cls, "agent")
        return taskset

    @staticmethod
    def _check_toolsets(taskset_id: str, toolsets: list[Any]) -> None:
        """Refuse the tool servers that verifiers would start outside this machine's processes: a
        toolset whose runtime is a container or a cloud sandbox (verifiers builds the toolset's package
        with `uv` and installs it there, which needs the runtime's daemon or account and the network)."""
        for toolset in toolsets:
            runtime = toolset.config.runtime.type
            if toolset.config.url is None and not _runs_as_main(type(toolset).__module__):
                module = type(toolset).__module__
                where = taskset_id if module.startswith("agentrl_taskset_") else module
                raise _Refused(
                    "config",
                    f"the verifiers taskset '{taskset_id}' declares the tool server {type(toolset).__name__}, but "
                    f"{where} has no `if __name__ == \"__main__\":` block: verifiers starts a tool server by running "
                    f"its module (`python -m`), which then serves nothing. End {where} with\n"
                    f"if __name__ == \"__main__\":\n    {type(toolset).__name__}.run()")
            if toolset.config.url is None and runtime != "subprocess":
                raise _Refused(
                    "unavailable",
                    f"the verifiers taskset '{taskset_id}' runs its tool server '{toolset.server_name}' "
                    f"({type(toolset).__name__}) in a '{runtime}' runtime, where verifiers builds and installs the "
                    "toolset with uv (a container daemon or a cloud account, and the network); env=verifiers starts "
                    "tool servers only as local processes. Give the toolset runtime={'type': 'subprocess'} (its "
                    "default), or serve the tools yourself and set the toolset's url, or use env=mcp, which runs "
                    "stdio MCP servers under agentrl's sandbox.")


def _runs_as_main(module: str) -> bool:
    """Whether `module` has a top-level `if __name__ == "__main__":` block (True when its source is not
    to be found: then verifiers' own failure, after its wait for the server's port, says what is wrong)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module]))
    except (KeyError, OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)
               for node in tree.body)


def _import_file(name: str, path: str) -> None:
    """Import the file `path` as the module `name`, in sys.modules while it runs, as an import would
    (pydantic resolves a model's postponed annotations, `from __future__ import annotations`, there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import a module from {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _scripts_dir() -> Path:
    """This user's folder for what the worker writes for its children to run (one per user, shared by
    every worker: each file there is named by what it holds and written once, atomically)."""
    scripts = Path(tempfile.gettempdir()) / f"agentrl-verifiers-{os.getuid()}"
    scripts.mkdir(mode=0o700, exist_ok=True)
    return scripts


def _write_once(path: Path, data: bytes) -> None:
    if not path.exists():
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_bytes(data)
        partial.replace(path)  # atomic: another worker never runs half a file


class _ToolServers:
    """What verifiers' tool servers need to start from this worker. verifiers starts a toolset in its
    subprocess runtime as `sys.executable -m MODULE` (the toolset class's module), with this process's
    environment: so `PYTHONPATH` names the verifiers folder (this interpreter finds verifiers only by
    `_use_folder`) and, for a taskset given as a file, a module of the name the file was imported under
    here, which runs the file (its `__main__` block starts the server; a task class is imported from it)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.modules = _scripts_dir() / "modules"

    def allow(self, plugin_id: str, taskset_id: str) -> None:
        if plugin_id != taskset_id:  # a file: `python -m agentrl_taskset_...` must find a module of that name
            self.modules.mkdir(mode=0o700, exist_ok=True)
            path = str(Path(taskset_id).resolve())
            _write_once(self.modules / f"{plugin_id}.py", (
                f"# written by agentrl's verifiers worker: runs {path} as this module\n"
                f"__file__ = {path!r}\n"
                f"with open(__file__, encoding='utf-8') as _source:\n"
                f"    exec(compile(_source.read(), __file__, 'exec'))\n").encode())
        os.environ["PYTHONPATH"] = os.pathsep.join([str(self.modules), self.folder])


class _ChatHarness:
    """verifiers' own chat program (the `null` harness: a chat loop with no tools of its own), run by
    this interpreter with the verifiers folder first on its path instead of by `uv`, which would
    download its dependencies (openai, mcp, ...) though the folder holds them: an offline run can."""

    ID = "agentrl_chat"

    def __init__(self, vf: Any, folder: str) -> None:
        from verifiers.v1.harnesses.null import NullHarness

        scripts = _scripts_dir()
        argv = [sys.executable, "-I", "-c", _BOOT, folder]

        class PreparedRuntime:
            """A runtime whose PEP 723 scripts run on this interpreter (the rest is the runtime's)."""

            def __init__(self, runtime: Any) -> None:
                self._runtime = runtime

            def __getattr__(self, name: str) -> Any:
                return getattr(self._runtime, name)

            async def prepare_uv_script(self, script: str | bytes, env: Any = None, *, activate: bool = True
                                        ) -> list[str]:
                data = script.encode() if isinstance(script, str) else script
                path = scripts / f"{hashlib.sha256(data).hexdigest()}.py"
                _write_once(path, data)
                return [*argv, str(path)]

        class AgentrlChatHarness(NullHarness):  # type: ignore[misc]  # verifiers ships no types: NullHarness is Any
            async def setup(self, runtime: Any) -> None:
                """Nothing to install: the program's packages are in the verifiers folder."""

            async def launch(self, ctx: Any, trace: Any, runtime: Any, *args: Any, **kwargs: Any) -> Any:
                return await super().launch(ctx, trace, PreparedRuntime(runtime), *args, **kwargs)

        module = types.ModuleType(self.ID)
        setattr(module, "AgentrlChatHarness", AgentrlChatHarness)  # noqa: B010 (a module made at run time)
        setattr(module, "__all__", ["AgentrlChatHarness"])  # noqa: B010
        sys.modules[self.ID] = module  # where verifiers' loader finds a harness by its id


_BOOT = ("import runpy, site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); "
         "sys.path[:] = [p for p in sys.path if p not in before] + before; sys.argv = sys.argv[2:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')")
"""Runs a script (argv[2:]) with the verifiers folder (argv[1]) first on sys.path, as `_use_folder` does here."""


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
    player = tasksets.player(str(request["taskset"]), dict(request.get("kwargs") or {}))
    if request["op"] == "load":
        tasks = [{"data": t.data.model_dump(mode="json"), "key": t.key}  # None kept: a required field may be None
                 for t in taskset.take(int(request["max_rows"]))]
        return {"ok": True, "tasks": tasks, "multi_turn": player is not None,
                "env": None if player is None else player[1].__name__}
    if request["op"] not in ("score", "play"):
        raise _Refused("task", f"unknown op {request['op']!r}")
    task_cls = type(taskset).task_type()
    try:
        task = task_cls(task_cls.data_type().model_validate(request["data"]), taskset.config.task)
    except Exception as exc:  # pydantic's ValidationError: a row whose task data this taskset does not take
        raise _Refused("task", f"the row's task data does not fit {task_cls.data_type().__name__}: {exc}") from exc
    if request["op"] == "play":
        if player is None:
            raise _Refused("task", f"the verifiers taskset '{request['taskset']}' is played in one reply (op score).")
        return await _play(request, task, player, tasksets)
    trace = _trace(vf, task, list(request["messages"]))
    timeout_s = float(request["timeout_s"])
    try:
        await asyncio.wait_for(task.score(trace), timeout_s)
    except TimeoutError as exc:
        raise _Refused("timeout", f"did not finish within {timeout_s:.0f} s") from exc
    except Exception as exc:  # the task's own reward code: whatever it raises, the episode was not scored
        raise _Refused("failed", f"{type(exc).__name__}: {exc}") from exc
    return _scores(trace)


def _scores(trace: Any) -> dict[str, Any]:
    """A scored trace's answer: its reward (None when a reward went unscored), rewards and metrics."""
    rewards = {name: (None if r is None else float(r.score)) for name, r in trace.rewards.items()}
    metrics = {name: float(v) for name, v in trace.metrics.items()
               if isinstance(v, int | float) and not isinstance(v, bool)}
    unscored = any(r is None for r in rewards.values())
    return {"ok": True, "reward": None if unscored else float(trace.reward), "rewards": rewards, "metrics": metrics}


async def _play(request: dict[str, Any], task: Any, player: tuple[str, type, str], tasksets: _Tasksets) -> dict[str, Any]:
    """One episode of a multi-turn taskset, played by verifiers (`Env.run_episode`) with its seat's model
    calls sent to `request["base_url"]`; each episode gets an env of its own (and so its own interception
    server and model client), as the base URL is the episode's."""
    from verifiers.v1.clients import EvalClientConfig, ModelContext
    from verifiers.v1.types import SamplingConfig
    from verifiers.v1.utils.loaders import resolve_env_config

    plugin_id, env_cls, seat = player
    config = resolve_env_config({
        "taskset": {**dict(request.get("kwargs") or {}), "id": plugin_id},
        seat: {"harness": {"id": _ChatHarness.ID}, "runtime": {"type": "subprocess"},
               "max_turns": request.get("max_turns")},
    })
    env = env_cls(config)
    # No API key: the base URL alone selects the episode's gateway session (an unset variable reads "EMPTY").
    ctx = ModelContext(model=str(request["model"]), sampling=SamplingConfig(),
                       client=EvalClientConfig(base_url=str(request["base_url"]), api_key_var="AGENTRL_NO_API_KEY"))
    timeout_s = float(request["timeout_s"])
    try:
        async with asyncio.timeout(timeout_s), env.serving():
            episode = await env.run_episode(task, ctx)
    except TimeoutError as exc:
        raise _Refused("timeout", f"the episode did not finish within {timeout_s:.0f} s") from exc
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if errors or not episode.ok or len(episode.traces) != 1:
        detail = "; ".join(f"{e.type}: {e.message}" for e in errors) or f"{len(episode.traces)} traces, not ok"
        raise _Refused("failed", f"verifiers' {env_cls.__name__} episode failed: {detail[-2000:]}")
    trace = episode.traces[0]
    return {**_scores(trace), "turns": trace.num_turns, "stop": trace.stop_condition, "reply": trace.last_reply}


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
    tasksets = _Tasksets(vf, argv[1])
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
