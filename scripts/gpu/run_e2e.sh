#!/usr/bin/env bash
# On the GPU machine, from the project root, after .gpu/verl-call-*/install.sh
# (scripts/gpu/prepare_verl.sh): the steps of benchmarks/verl_gpu_e2e.py, each a device call.
#
#   bash scripts/gpu/run_e2e.sh setup            # imports checked, data + model in $E2E
#   bash scripts/gpu/run_e2e.sh train pipeline   # verl's trainer with our PipelineAgentLoop
#   bash scripts/gpu/run_e2e.sh train verl       # the same with verl's ToolAgentLoop
#   bash scripts/gpu/run_e2e.sh report           # benchmarks/results/verl_gpu_e2e.json
#
# A train that may outlast one device call (10 minutes; a start-up of ~4 minutes plus five
# steps of ~65 s did, on an H200 on 2026-11-27) runs in the background instead, in its own
# process session so it outlives the call; the machine must be kept (calls back to back):
#
#   bash scripts/gpu/run_e2e.sh start pipeline   # returns at once
#   bash scripts/gpu/run_e2e.sh wait pipeline    # until it ended, at most 570 s; again if not
#
# Extra arguments after the loop go to verl_gpu_e2e.py train (hydra overrides after "--").
# Logs and per-step records are copied to $OUT (the device call's return folder) when set.
set -uo pipefail
source "${VERL_GPU_ROOT:-/tmp/verl-gpu}/env.sh"
E2E=${E2E:-/tmp/e2e}
what=$1; shift
case "$what" in
  setup)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 - <<'PY'
import importlib
for name in ("torch", "transformers", "vllm", "verl", "ray", "tensordict", "transfer_queue",
             "hydra", "omegaconf", "datasets", "pyarrow", "pandas", "peft", "torchdata"):
    module = importlib.import_module(name)
    print(f"{name} {getattr(module, '__version__', '?')} {module.__file__}")
PY
    mkdir -p "$E2E/tokenizer" && tar -C "$E2E/tokenizer" -xJf .gpu/tok.tar.xz
    python3 benchmarks/verl_gpu_e2e.py prepare --out "$E2E" --tokenizer "$E2E/tokenizer"
    ;;
  train)
    loop=$1; shift
    ray stop --force >/dev/null 2>&1  # a Ray cluster left by an earlier, stopped run
    python3 benchmarks/verl_gpu_e2e.py train --work "$E2E" --loop "$loop" "$@"
    code=$?
    if [ -n "${OUT:-}" ]; then
      tail -c 15000000 "$E2E/$loop.log" > "$OUT/$loop.log"
      cp "$E2E/$loop.steps.json" "$E2E/$loop.command.json" "$OUT/" 2>/dev/null
    fi
    exit $code
    ;;
  start)
    loop=$1; shift
    ray stop --force >/dev/null 2>&1
    rm -f "$E2E/$loop.steps.json"
    setsid nohup python3 benchmarks/verl_gpu_e2e.py train --work "$E2E" --loop "$loop" \
      --timeout-s 1500 "$@" > "$E2E/$loop.driver.log" 2>&1 < /dev/null &
    echo "started $loop in the background (pid $!)"
    ;;
  wait)
    loop=$1; limit=${2:-570}; end=$((SECONDS + limit))
    while [ ! -f "$E2E/$loop.steps.json" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    grep -o "step:[0-9]* " "$E2E/$loop.log" | sort -u | tail -1
    if [ -n "${OUT:-}" ]; then
      tail -c 15000000 "$E2E/$loop.log" > "$OUT/$loop.log"
      cp "$E2E/$loop.steps.json" "$E2E/$loop.command.json" "$E2E/$loop.driver.log" "$OUT/" \
        2>/dev/null
    fi
    [ -f "$E2E/$loop.steps.json" ] && cat "$E2E/$loop.driver.log" || echo "$loop still running"
    ;;
  report)
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    python3 benchmarks/verl_gpu_e2e.py report --work "$E2E" --card "$card" "$@"
    [ -n "${OUT:-}" ] && cp benchmarks/results/verl_gpu_e2e.json "$OUT/"
    ;;
  *) echo "unknown step $what (setup, train|start|wait LOOP, report)" >&2; exit 2 ;;
esac
