#!/bin/sh
# Build the sandbox-server image from this checkout with a minimal context (no .venv, no .git):
#   images/sandbox-server/build.sh [TAG] [docker build options...]
# AGENTRL_WHEELS=DIR copies DIR into the context's wheels/ for an offline build (with
# --build-arg PIP_ARGS="--no-index --find-links /src/wheels").
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tag=${1:-agentrl-sandbox-server}
[ $# -gt 0 ] && shift
ctx=$(mktemp -d "${TMPDIR:-/tmp}/agentrl-server-ctx.XXXXXX")
trap 'rm -rf "$ctx"' EXIT INT TERM
(cd "$root" && tar --exclude=__pycache__ -cf - pyproject.toml README.md agentrl envs tools sandboxes configs \
    images/sandbox-server) | tar -xf - -C "$ctx"
mkdir -p "$ctx/wheels"
if [ -n "${AGENTRL_WHEELS:-}" ]; then cp "$AGENTRL_WHEELS"/* "$ctx/wheels/"; fi
docker build -f "$ctx/images/sandbox-server/Dockerfile" -t "$tag" "$@" "$ctx"
