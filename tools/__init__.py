"""PLACEHOLDER"""

if __name__ != "agentrl.tools":
    # This folder sits at the repository root but installs as agentrl.tools (DESIGN.md §1); loading
    # it under a second name would create a second copy of every class and registry.
    raise ImportError(
        f"'{__name__}' is agentrl's tools package: import it as 'agentrl.tools', not '{__name__}'."
    )
