"""PLACEHOLDER"""

if __name__ != "agentrl.configs":
    # This folder sits at the repository root but installs as agentrl.configs (DESIGN.md §1); loading
    # it under a second name would create a second copy of every class and registry.
    raise ImportError(
        f"'{__name__}' is agentrl's configs package: import it as 'agentrl.configs', not '{__name__}'."
    )
