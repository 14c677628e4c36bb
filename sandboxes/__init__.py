"""Code-execution backends (installed as `agentrl.sandboxes`).

The contract lives in `agentrl.sandboxes.protocol` (`Sandbox`, `SandboxSession`, `ExecResult`);
backends register by name in `agentrl.registry.SANDBOXES` and are imported only when used:
`local` (bubblewrap, the default), `docker`, and `remote` (HTTP; served by `agentrl sandbox serve`,
see `agentrl.sandboxes.server`, or any SandboxFusion server).

Layer L1 (DESIGN.md §2), beside `agentrl.inference`: it imports only the core modules of L0 and
never torch.
"""

if __name__ != "agentrl.sandboxes":
    # This folder sits at the repository root but installs as agentrl.sandboxes (DESIGN.md §1):
    # loading it under a second name would create a second copy of every class and registry.
    raise ImportError(
        f"'{__name__}' is agentrl's sandboxes package: import it as 'agentrl.sandboxes', not '{__name__}'."
    )

from typing import Any

from agentrl.sandboxes.protocol import ExecResult, Sandbox, SandboxSession

# Backends load on first use: the server pulls in FastAPI, the remote client httpx, docker its SDK.
_BACKENDS = {
    "DockerSandbox": "agentrl.sandboxes.docker",
    "LocalSandbox": "agentrl.sandboxes.local",
    "RemoteSandbox": "agentrl.sandboxes.remote",
}

__all__ = ["DockerSandbox", "ExecResult", "LocalSandbox", "RemoteSandbox", "Sandbox", "SandboxSession"]


def __getattr__(name: str) -> Any:
    module = _BACKENDS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.sandboxes' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
