#!/usr/bin/env bash
# The on-policy check's GPU column: `agentrl check onpolicy` with the FSDP2 trainer and the hf engine
# on CUDA, in bfloat16 and float32 (bench/onpolicy_gpu.py does the work; see docs/onpolicy.md).
# For one GPU, no network, agentrl carried as source; it stops within 8 minutes. Not run yet.
#   bash scripts/gpu_onpolicy.sh                 # assets in shared/assets or $AGENTRL_ASSETS; results in $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 470 python bench/onpolicy_gpu.py --assets "${AGENTRL_ASSETS:-shared/assets}" --out "${OUT:-gpu-onpolicy}" "$@"
