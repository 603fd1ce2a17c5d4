#!/usr/bin/env bash
# Loop DCP save/load round trips under torchrun (gloo, CPU) and count the runs that abort (issue 29, item 3).
#
#   bash bench/dcp_loop/loop.sh N                    # N rounds, the workaround on (run() returns, gc.collect())
#   DCP_LOOP_KEEP=1 bash bench/dcp_loop/loop.sh N    # objects kept alive until interpreter exit
#
# Each round is 6 torchrun runs: save at 2 ranks and load at 3, save and load at 3, save at 3 and load at 2
# (bench/dcp_loop/run.py: both checkpoint paths, bit-exact checks). DCP_LOOP_BUSY busy processes (default 2) load
# the CPUs meanwhile, as in the measurement of docs/troubleshooting.md. Each run's log and a summary go to
# DCP_LOOP_OUT (default /tmp/dcp_loop-<time>); never commit them. Exit status: 0 when no run failed.
set -u
ROUNDS=${1:-1}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${DCP_LOOP_OUT:-/tmp/dcp_loop-$(date +%Y%m%d-%H%M%S)}
BUSY=${DCP_LOOP_BUSY:-2}
KEEP=${DCP_LOOP_KEEP:-0}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DCP_LOOP_KEEP=$KEEP

busy_pids=()
stop_busy() {
  for pid in "${busy_pids[@]}"; do kill "$pid" 2>/dev/null; done
}
trap stop_busy EXIT
for _ in $(seq 1 "$BUSY"); do
  "$PY" -c "while True: pass" &
  busy_pids+=($!)
done

runs=0 failed=0 aborted=0
failures=()
one() {  # one torchrun run: $1 ranks, $2 save|load, $3 checkpoint dir, $4 log name
  local log="$OUT/$4.log"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$1" "$ROOT/bench/dcp_loop/run.py" "$2" --dir "$3" \
    >"$log" 2>&1
  local rc=$?
  runs=$((runs + 1))
  if [ $rc -ne 0 ]; then
    failed=$((failed + 1))
    if grep -q "terminate called\|SIGABRT\|Signal 6" "$log"; then
      aborted=$((aborted + 1))
    fi
    failures+=("$4 (rc $rc)")
  fi
}

for round in $(seq 1 "$ROUNDS"); do
  for pair in "2 3" "3 3" "3 2"; do
    set -- $pair
    ck="$OUT/ckpt-r$round-$1to$2"
    one "$1" save "$ck" "r$round-save$1-for$2"
    one "$2" load "$ck" "r$round-load$2-from$1"
    rm -rf "$ck"
  done
  echo "round $round/$ROUNDS: $runs runs, $failed failed, $aborted aborted"
done

{
  echo "bench/dcp_loop/loop.sh $ROUNDS (DCP_LOOP_KEEP=$KEEP, $BUSY busy processes, $(nproc) CPUs, $(date -u +%FT%TZ))"
  echo "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)')"
  echo "runs $runs failed $failed aborted $aborted"
  for f in "${failures[@]+"${failures[@]}"}"; do echo "failed: $f"; done
} | tee "$OUT/summary.txt"
[ "$failed" -eq 0 ]
