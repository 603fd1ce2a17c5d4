#!/usr/bin/env bash
# One GPU call (~7 minutes on one H100) for issue 30's speculative clipping: the host step alone, in place against
# the speculative out-of-place update per chunk (`bench.offload.host_step --spec --pinned --dma`), then the full
# clipped 2.9B step at the fastest out-of-place chunk (BIG_SPEC_CHUNK): clipped, speculation never firing, and the
# same two with keep_params_gib="auto" (keep, keep + spec). Each step under `timeout`; logs and JSON under $OUT;
# the table last (python -m bench.offload.spec_table).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 BIG_TRACE=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout "${SPEC_HOST_S:-240}" python3 -m bench.offload.host_step --spec --pinned --dma --params 1.0 \
  --chunks "${SPEC_CHUNKS:-262144,524288,1048576,2097152}" --rounds 3 --out "$OUT/host_step_spec.json" \
  >"$OUT/host_step_spec.log" 2>&1
grep -E "^out of place|^fastest" "$OUT/host_step_spec.log"
CHUNK=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("spec_fastest_chunk") or "")' \
  "$OUT/host_step_spec.json" 2>/dev/null)
echo "BIG_SPEC_CHUNK=${CHUNK:-(none: the library default)}"
run() {  # run NAME IMPLS ENV...
  local name=$1 impls=$2; shift 2
  env BIG_SPEC_CHUNK="$CHUNK" "$@" timeout "${SPEC_BIG_S:-260}" python3 -m bench.offload.big --configs 2.9b-4k \
    --impls "$impls" --steps 4 --warmup 2 --no-floor --out "$OUT/big_$name.json" >"$OUT/big_$name.log" 2>&1
  grep -E '^2.9b-4k|speculative clip' "$OUT/big_$name.log"
}
run spec shardfuse,shardfuse-spec-nofire
run keep shardfuse,shardfuse-spec-nofire BIG_KEEP_GIB=auto
python3 -m bench.offload.spec_table "$OUT" | tee "$OUT/spec_table.txt"
