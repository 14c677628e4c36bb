"""Code-execution backends (installed as `agentrl.sandboxes`).

The contract lives in `agentrl.sandboxes.protocol` (`Sandbox`, `SandboxSession`, `ExecResult`);
backends register by name in `agentrl.registry.SANDBOXES` and are imported only when used.
"""

if __name__ != "agentrl.sandboxes":
    # This folder sits at the repository root but installs as agentrl.sandboxes (DESIGN.md §1):
    # loading it under a second name would create a second copy of every class and registry.
    raise ImportError(
        f"'{__name__}' is agentrl's sandboxes package: import it as 'agentrl.sandboxes', not '{__name__}'."
    )

from agentrl.sandboxes.protocol import ExecResult, Sandbox, SandboxSession

__all__ = ["ExecResult", "Sandbox", "SandboxSession"]
