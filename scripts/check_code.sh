#!/usr/bin/env bash
# Machine-checked contracts, run by .ci/run: DESIGN.md's layers and "torch only where needed" as
# import contracts (import-linter), and the type checker (mypy) over agentrl/, envs/, tools/ and
# sandboxes/. envs/, tools/ and sandboxes/ install inside the agentrl namespace (setuptools
# package-dir), which neither tool follows, so both run over a tree of symlinks that lays the
# package out as it is installed. Usage: bash scripts/check_code.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/agentrl"
for entry in "$repo"/agentrl/*; do
  [[ "$(basename "$entry")" == __pycache__ ]] || ln -s "$entry" "$tree/agentrl/"
done
for family in envs tools sandboxes configs; do ln -s "$repo/$family" "$tree/agentrl/$family"; done
cd "$tree"
echo "== import contracts (pyproject.toml [tool.importlinter])"
PYTHONPATH="$tree" lint-imports --config "$repo/pyproject.toml"
echo "== mypy (pyproject.toml [tool.mypy])"
PYTHONPATH="$tree" python -m mypy --config-file "$repo/pyproject.toml" -p agentrl
