"""How a sandbox run is shown to the model: output cut in the middle, and a plain account of failure.

`truncate_middle` keeps the head and the tail of long text (a traceback's last lines and a
program's first lines are what a model needs) and says how much it left out. `format_exec_result`
turns an `ExecResult` into the tool message text and says whether the failure, if any, was the
model's (a non-zero exit, a timeout, a limit hit). It does not run anything.
"""

from __future__ import annotations

from agentrl.errors import ToolInfrastructureError
from agentrl.types import ExecResult

__all__ = ["format_exec_result", "truncate_middle"]

_REASONS = {
    "timeout": "it ran past its time limit of {timeout}",
    "memory": "it used more memory than the sandbox allows",
    "output": "it printed more output than the sandbox keeps",
    "cpu": "it used more CPU time than the sandbox allows",
    "signal": "it was killed by a signal",
}


def truncate_middle(text: str, max_chars: int) -> str:
    """`text` if it fits in `max_chars`, else its head and tail around a note of what was cut."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    head = max_chars * 2 // 5
    tail = max_chars - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[-tail:]}"


def format_exec_result(result: ExecResult, *, max_chars: int = 4000, timeout_s: float | None = None) -> tuple[str, bool]:
    """The text the model sees for `result`, and whether the run failed (by the model's doing).

    A job cut short because its sandbox session was closed (killed_reason "closed") is no result of
    the program's: it raises ToolInfrastructureError, an infrastructure failure of the call."""
    if result.killed_reason == "closed":
        raise ToolInfrastructureError("The sandbox session was closed while the program ran (not the program's doing).")
    failed = not result.ok
    out, err = result.stdout, result.stderr
    if out and err:
        budget_out = max(max_chars // 2, max_chars - len(err))
        out = truncate_middle(out, budget_out)
        err = truncate_middle(err, max_chars - len(out))
    else:
        out, err = truncate_middle(out, max_chars), truncate_middle(err, max_chars)
    parts = []
    if out:
        parts.append(out if not err and not failed else f"[stdout]\n{out}")
    if err:
        parts.append(f"[stderr]\n{err}")
    if result.killed_reason:
        why = _REASONS.get(result.killed_reason, result.killed_reason).format(
            timeout=f"{timeout_s:g} s" if timeout_s else "the limit"
        )
        parts.append(f"[the program was stopped: {why}]")
    elif result.exit_code not in (0, None):
        parts.append(f"[exit code {result.exit_code}]")
    if not parts:
        parts.append("[no output; use print() to show results]" if not failed else "[failed with no output]")
    return "\n".join(p.rstrip("\n") for p in parts), failed
