"""``python -m bench.scale``: predicted step time and scaling efficiency of flat vs hybrid sharding.

    python -m bench.scale --gpus 8,64,512 --model 7b --inter-node-gbps 400 --plot docs/img/scale_7b.png
    python -m bench.scale --model 8b --wire fp8      # the fp8 all-gather against bf16: scale_model_8b_fp8.json

Prints every assumption, the 2-GPU validation against the stored measurements, then the table; ``--json`` writes
the ``scale_model`` record (default ``bench/results/scale_model.json``; ``scale_model_<model>_<wire>.json`` with
``--wire fp8``), ``--plot`` a PNG of efficiency vs GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.scale.calibrate import load_measured, make_calibration, make_hardware
from bench.scale.model import MODELS, WIRES
from bench.scale.report import assumptions, build_record, plot, table_text, validate, validation_text

DEFAULT_TOKENS = {"953m": 8192, "7b": 4096, "70b": 4096, "8b": 8192}
DEFAULT_SEQ = {"953m": 2048, "7b": 4096, "70b": 4096, "8b": 8192}
RESULTS = Path(__file__).resolve().parents[1] / "results"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--gpus", default="8,64,512", help="comma-separated GPU counts (default 8,64,512)")
    p.add_argument("--model", choices=sorted(MODELS), default="953m")
    p.add_argument("--tokens-per-gpu", type=int, default=None, help="default: 8192 (953m, 8b), 4096 (7b, 70b)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048 for 953m, 8192 for 8b, "
                   "else 4096)")
    p.add_argument("--wire", choices=WIRES, default="bf16",
                   help="the dtype of the layers' all-gathered weights: fp8 also predicts bf16 and the ratio")
    p.add_argument("--intra-node-gbps", type=float, default=None,
                   help="NVLink bus bandwidth in GB/s (default: fitted to the measured H200 bus bandwidths)")
    p.add_argument("--inter-node-gbps", type=float, default=400.0, help="network Gb/s per GPU (default 400)")
    p.add_argument("--inter-node-alpha-us", type=float, default=10.0, help="latency per inter-node ring step")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--calibrate", type=Path, default=RESULTS, help="results directory with h200/ and logs/")
    p.add_argument("--json", type=Path, default=None,
                   help="where to write the record (default bench/results/scale_model.json, with --wire fp8 "
                        "scale_model_<model>_fp8.json)")
    p.add_argument("--no-json", action="store_true", help="write no JSON")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of efficiency vs GPUs")
    args = p.parse_args(argv)
    if args.json is None:
        wire_name = "" if args.wire == "bf16" else f"_{args.model}_{args.wire}"
        args.json = RESULTS / f"scale_model{wire_name}.json"
    try:
        args.gpu_list = sorted({int(g) for g in args.gpus.split(",") if g.strip()})
    except ValueError:
        p.error(f"--gpus takes comma-separated integers, got {args.gpus!r}")
    if not args.gpu_list or min(args.gpu_list) < 1:
        p.error("--gpus needs at least one count >= 1")
    bad = [g for g in args.gpu_list if g > args.gpus_per_node and g % args.gpus_per_node]
    if bad:
        p.error(f"GPU counts {bad} are not whole nodes of {args.gpus_per_node}: hybrid sharding needs whole nodes")
    if args.inter_node_gbps <= 0 or (args.intra_node_gbps is not None and args.intra_node_gbps <= 0):
        p.error("bandwidths must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tokens = args.tokens_per_gpu or DEFAULT_TOKENS[args.model]
    seq = min(args.seq or DEFAULT_SEQ[args.model], tokens)
    measured = load_measured(args.calibrate)
    cal = make_calibration(measured)
    hw = make_hardware(args.inter_node_gbps, args.inter_node_alpha_us, args.gpus_per_node, args.intra_node_gbps)
    shape = MODELS[args.model]
    print("\n".join(assumptions(shape, tokens, seq, hw, cal, measured, args.inter_node_gbps, args.wire)))
    rows = validate(args.calibrate, hw, cal)
    print()
    print(validation_text(rows))
    record = build_record(shape, tokens, seq, args.gpu_list, hw, cal, measured, rows, args.inter_node_gbps, args.wire)
    print()
    print(table_text(record))
    if not args.no_json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if args.plot is not None:
        plot(record, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
