"""PLACEHOLDER"""

if __name__ != "agentrl.envs":
    # This folder sits at the repository root but installs as agentrl.envs (DESIGN.md §1); loading
    # it under a second name would create a second copy of every class and registry.
    raise ImportError(
        f"'{__name__}' is agentrl's envs package: import it as 'agentrl.envs', not '{__name__}'."
    )
