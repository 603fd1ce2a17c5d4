#!/usr/bin/env bash
# One GPU call (~8 minutes on one H100) for the offload work of issue 30: the host tier's GPU tests, then the
# clipped 2.9B step with compute-dtype gradients (the default), speculative clipping (never firing: every step
# commits; and at max norm 1.0), step_in_backward, the fp32-gradient path (SHARDFUSE_LOWP_GRADS=0) and
# keep_params_gib=auto. Logs and JSON under $OUT; the step lines last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 BIG_TRACE=1 BIG_PROFILE=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout "${CHECK_TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout=150 \
  tests/sharding/test_speculative_clip_gpu.py tests/sharding/test_offload_transfers_gpu.py \
  tests/sharding/test_offload_optim_gpu.py tests/kernels/test_plan_cache.py tests/kernels/test_fp8.py \
  >"$OUT/gpu_tests.log" 2>&1
tail -n 8 "$OUT/gpu_tests.log"
run() {  # run NAME IMPLS ENV...
  local name=$1 impls=$2; shift 2
  env "$@" timeout 260 python3 -m bench.offload.big --configs 2.9b-4k --impls "$impls" --steps 4 --warmup 2 \
    --no-floor --out "$OUT/big_$name.json" >"$OUT/big_$name.log" 2>&1
  grep -E '^2.9b-4k|GPU side|host optimizer busy' "$OUT/big_$name.log"
}
run new shardfuse,shardfuse-spec-nofire,shardfuse-spec
run fp32grads shardfuse SHARDFUSE_LOWP_GRADS=0
run keep shardfuse-spec-nofire BIG_KEEP_GIB=auto
