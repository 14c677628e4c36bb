"""The tool contract: typed async functions the model can call.

A tool is a Python function (or a `Tool` subclass's `run` method) with type hints and a
Google-style docstring. Its OpenAI function schema is derived from that signature and docstring by
pydantic, never written by hand, and the same pydantic model validates the model's arguments.

    @agentrl.tool
    async def python(code: str, ctx: ToolContext) -> str:
        '''Run a Python program and return what it printed.

        Args:
            code: The complete program to run.
        '''

Stateful tools have a per-episode lifecycle: `create(ctx)` before the first call of an episode,
`run(ctx, ...)` for each call, `release(ctx)` when the episode ends (always, even after errors).
`ToolContext` carries the episode's id, its sandbox session and a scratch `state` dict; a
parameter annotated `ToolContext` is passed in by agentrl and is not part of the schema.

`Tool.invoke` never raises for a failed call: it returns a `ToolResult` whose `fault` says whether
the model is to blame (bad arguments, its code failed) or the infrastructure (sandbox down, the
call exceeded its deadline). This module does not parse tool calls out of text; see
`agentrl.tools.parsers`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast, get_type_hints, overload

import pydantic

from agentrl.errors import ToolArgumentError, ToolError
from agentrl.types import Fault, ToolResult, ToolSchema

if TYPE_CHECKING:
    from agentrl.sandboxes.protocol import Sandbox, SandboxSession

__all__ = ["FunctionTool", "Tool", "ToolContext", "tool"]

_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class ToolContext:
    """What a tool call knows about its episode. Built by the environment, one per episode."""

    episode_id: str = ""
    sandbox: SandboxSession | Sandbox | None = None
    """The episode's `SandboxSession` (or a `Sandbox`), when the environment provides one."""
    state: dict[str, Any] = field(default_factory=dict)
    """Scratch space a stateful tool keeps between calls of one episode."""


class Tool:
    """Base class of every tool.

    Subclass it and define `async def run(self, ctx: ToolContext, <typed args>) -> str` with a
    docstring; or decorate a plain function with `@agentrl.tool`. Override `create` and `release`
    for per-episode resources. Class attributes `name` and `description` default to the class
    name in snake case and the docstring of `run`.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    timeout_s: float | None = None
    """Deadline for one call; past it the call is cancelled and reported as an infra error."""

    def __init__(self) -> None:
        self._bind(self.run, type(self).name or _snake_case(type(self).__name__),
                   type(self).description)

    # ── lifecycle, overridden by stateful tools ─────────────────────────────────────────────
    async def create(self, ctx: ToolContext) -> None:
        """Prepare per-episode resources before the first call of an episode."""

    async def run(self, ctx: ToolContext, *args: Any, **arguments: Any) -> Any:
        # `*args: Any, **arguments: Any`: a subclass's typed signature (its schema) overrides it
        raise NotImplementedError(f"{type(self).__name__} must define `async def run(self, ctx, ...)`.")

    async def release(self, ctx: ToolContext) -> None:
        """Free per-episode resources. Always called, even when the episode failed."""

    # ── schema and invocation, shared ───────────────────────────────────────────────────────
    def _bind(self, fn: Callable[..., Any], name: str, description: str) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(
                f"Tool name {name!r} is not valid: use 1-64 letters, digits, '_' or '-' (OpenAI's rule)."
            )
        summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        self._fn = fn
        self._tool_name = name
        self._description = description or summary
        self._args_model, self._ctx_param = _arguments_model(fn, name, arg_docs)
        self._is_async = inspect.iscoroutinefunction(fn)
        self._schema = self._build_schema()

    @property
    def tool_name(self) -> str:
        return self._tool_name

    @property
    def schema(self) -> ToolSchema:
        """The OpenAI function-tool schema, derived from the signature and docstring (a fresh copy)."""
        return cast(ToolSchema, _copy_json(self._schema))  # a copy of JSON data has the type of its original

    def _build_schema(self) -> ToolSchema:
        params = self._args_model.model_json_schema()
        params.pop("title", None)
        for prop in params.get("properties", {}).values():
            prop.pop("title", None)
        params.setdefault("properties", {})
        params.setdefault("required", [])
        return {
            "type": "function",
            "function": {"name": self._tool_name, "description": self._description, "parameters": params},
        }

    def validate_arguments(self, arguments: dict[str, Any] | str) -> dict[str, Any]:
        """Check the model's arguments against the schema; raise ToolArgumentError saying what is wrong."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ToolArgumentError(
                    f"Arguments for '{self._tool_name}' are not valid JSON ({exc.msg}); "
                    "send a JSON object of named arguments."
                ) from exc
        if not isinstance(arguments, dict):
            raise ToolArgumentError(
                f"Arguments for '{self._tool_name}' must be a JSON object, got {type(arguments).__name__}."
            )
        try:
            validated = self._args_model.model_validate(arguments)
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"'{'.'.join(str(p) for p in e['loc']) or '(arguments)'}': {e['msg']}" for e in exc.errors()
            )
            expected = ", ".join(self._schema["function"]["parameters"]["properties"]) or "none"
            raise ToolArgumentError(
                f"Invalid arguments for '{self._tool_name}': {problems}. Expected arguments: {expected}."
            ) from exc
        return {k: getattr(validated, k) for k in type(validated).model_fields}

    async def invoke(
        self,
        arguments: dict[str, Any] | str,
        ctx: ToolContext | None = None,
        *,
        tool_call_id: str = "",
        timeout_s: float | None = None,
    ) -> ToolResult:
        """Validate and run one call; never raises for a failed call (see the module docstring)."""
        ctx = ctx if ctx is not None else ToolContext()
        deadline = timeout_s if timeout_s is not None else self.timeout_s
        start = time.perf_counter()

        def result(content: str, fault: Fault | None) -> ToolResult:
            return ToolResult(
                content=content,
                fault=fault,
                tool_name=self._tool_name,
                tool_call_id=tool_call_id,
                duration_s=time.perf_counter() - start,
            )

        try:
            kwargs = self.validate_arguments(arguments)
            if self._ctx_param:
                kwargs[self._ctx_param] = ctx
            if self._is_async:
                call: Awaitable[Any] = self._fn(**kwargs)
            else:
                call = asyncio.to_thread(self._fn, **kwargs)
            output = await asyncio.wait_for(call, deadline) if deadline else await call
        except TimeoutError:
            return result(
                f"Error: the '{self._tool_name}' tool did not answer within {deadline:g} s "
                "(an infrastructure problem, not your call's fault).",
                "infra",
            )
        except ToolError as exc:
            return result(f"Error: {exc}", exc.fault)
        except (ValueError, TypeError, ArithmeticError) as exc:
            # Raised by the tool's own checks on what the model asked for: the model's fault.
            return result(f"Error: {exc}", "model")
        except Exception as exc:  # any other failure is the machinery's, not the model's
            return result(
                f"Error: the '{self._tool_name}' tool failed internally ({type(exc).__name__}: {exc}).",
                "infra",
            )
        if isinstance(output, ToolResult):
            return ToolResult(output.content, output.fault, self._tool_name, tool_call_id,
                              time.perf_counter() - start)
        if not isinstance(output, str):
            output = json.dumps(output, default=str)
        return result(output, None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._tool_name!r}>"


class FunctionTool(Tool):
    """A tool made from a plain function by `@agentrl.tool`; stateless unless it uses `ctx.state`."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None,
                 description: str | None = None, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self._bind(fn, name or fn.__name__, description or "")
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    async def run(self, ctx: ToolContext, **arguments: Any) -> Any:
        if self._ctx_param:
            arguments[self._ctx_param] = ctx
        out = self._fn(**arguments)
        return await out if inspect.isawaitable(out) else out


@overload
def tool(fn: Callable[..., Any], /) -> FunctionTool: ...
@overload
def tool(*, name: str | None = None, description: str | None = None,
         timeout_s: float | None = None) -> Callable[[Callable[..., Any]], FunctionTool]: ...
def tool(fn: Callable[..., Any] | None = None, /, *, name: str | None = None, description: str | None = None,
         timeout_s: float | None = None) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Turn a typed function into a `Tool`; usable bare (`@tool`) or with options (`@tool(name=...)`)."""
    if fn is not None:
        return FunctionTool(fn)
    return lambda f: FunctionTool(f, name=name, description=description, timeout_s=timeout_s)


# ── schema derivation ───────────────────────────────────────────────────────────────────────


def _snake_case(name: str) -> str:
    name = re.sub(r"Tool$", "", name) or name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


_SECTION_RE = re.compile(r"^(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARG_RE = re.compile(r"^(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into its description and per-argument descriptions."""
    lines = doc.splitlines()
    summary_lines: list[str] = []
    args: dict[str, str] = {}
    section = None
    current = None
    arg_indent = None
    for raw in lines:
        stripped = raw.strip()
        m = _SECTION_RE.match(stripped)
        if m and (len(raw) - len(raw.lstrip())) == 0:
            section = m.group(1)
            current, arg_indent = None, None
            continue
        if section is None:
            summary_lines.append(stripped)
        elif section in ("Args", "Arguments", "Parameters") and stripped:
            indent = len(raw) - len(raw.lstrip())
            am = _ARG_RE.match(stripped)
            if am and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = am.group(1).lstrip("*")
                args[current] = am.group(3).strip()
            elif current is not None:
                args[current] = f"{args[current]} {stripped}".strip()
    summary = "\n".join(summary_lines).strip()
    summary = re.sub(r"\n(?!\n)", " ", summary)  # unwrap hard-wrapped lines, keep paragraphs
    return summary, args


def _is_context(annotation: object) -> bool:
    """True for `ToolContext` and `ToolContext | None`."""
    if annotation is ToolContext:
        return True
    args = typing.get_args(annotation)
    return bool(args) and ToolContext in args and all(a in (ToolContext, type(None)) for a in args)


def _arguments_model(
    fn: Callable[..., Any], tool_name: str, arg_docs: dict[str, str]
) -> tuple[type[pydantic.BaseModel], str | None]:
    """A pydantic model of `fn`'s parameters (minus `self` and the ToolContext one)."""
    sig = inspect.signature(fn)
    try:
        hints = get_type_hints(fn)
    except Exception as exc:
        raise TypeError(f"Cannot read the type hints of tool '{tool_name}': {exc}") from exc
    fields: dict[str, Any] = {}
    ctx_param = None
    for pname, param in sig.parameters.items():
        if pname == "self":
            continue
        annotation = hints.get(pname, param.annotation)
        if _is_context(annotation) or (pname == "ctx" and annotation is inspect.Parameter.empty):
            ctx_param = pname
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            if annotation is inspect.Parameter.empty or pname == "arguments":
                continue
            raise TypeError(f"Tool '{tool_name}' cannot take *{pname}: list each argument by name.")
        if annotation is inspect.Parameter.empty:
            raise TypeError(
                f"Parameter '{pname}' of tool '{tool_name}' has no type hint; "
                "every argument needs one so its schema can be derived."
            )
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (annotation, pydantic.Field(default, description=arg_docs.get(pname)))
    model = pydantic.create_model(
        f"{tool_name}_arguments",
        __config__=pydantic.ConfigDict(extra="forbid"),
        **fields,
    )
    return model, ctx_param


def _copy_json(value: Any) -> Any:
    """A deep copy of JSON data (dicts, lists, scalars): every env reset hands out the tool schemas,
    and `copy.deepcopy`'s generality costs several times more on that path."""
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    return value
