"""YAML run presets, shipped as package data (installed as `agentrl.configs`).

Each `NAME.yaml` here is a preset: `agentrl run env=NAME` starts from it when it exists, and
`agentrl config --presets` lists them. This package holds no code.
"""

if __name__ != "agentrl.configs":
    # This folder sits at the repository root but installs as agentrl.configs (DESIGN.md §1):
    # loading it under a second name would create a second copy of it.
    raise ImportError(
        f"'{__name__}' is agentrl's configs package: import it as 'agentrl.configs', not '{__name__}'."
    )
