#!/usr/bin/env bash
# Issue 30's attribution of the clipped full-offload step's host update (one GPU, ~9 minutes): the host step alone
# with page-locked buffers (as in training) and pinned copies beside it, then the clipped 2.9B step with one knob
# changed at a time (host threads, the GIL switch interval, reshard_after_forward=False, host_compute_copy).
# Logs and JSON under $OUT; the step lines last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 BIG_TRACE=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 150 python3 -m bench.offload.host_step --params 1.0 --threads "${DIAG_THREADS:-15,8}" --chunks 8388608 \
  --rounds 3 --pinned --dma --out "$OUT/host_step_pinned.json" >"$OUT/host_step_pinned.log" 2>&1
tail -n 16 "$OUT/host_step_pinned.log"
run() {  # run NAME ENV... -- IMPLS
  local name=$1; shift
  env "$@" timeout 200 python3 -m bench.offload.big --configs 2.9b-4k --impls "${IMPLS:-shardfuse}" --steps 4 \
    --warmup 2 --no-floor --out "$OUT/big_$name.json" >"$OUT/big_$name.log" 2>&1
  echo "== $name: $(grep -E '^2.9b-4k' "$OUT/big_$name.log" | tr -s ' ' | tr '\n' ';')"
  grep -E 'host optimizer busy' "$OUT/big_$name.log"
}
run base
run threads8 BIG_HOST_THREADS=8
run switch200us BIG_SWITCH_INTERVAL=0.0002
IMPLS=shardfuse-keep,shardfuse-hcc run keep_hcc
