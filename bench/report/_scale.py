"""The page's section of ``scale_model.json`` (``python -m bench.scale``): a model of flat vs hybrid sharding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_scale(results_dir: Path) -> dict[str, Any] | None:
    """The scale model's stored file under ``results_dir`` (None when there is none)."""
    path = results_dir / "scale_model.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) and data.get("kind") == "scale_model" else None


def scale_section(data: dict[str, Any]) -> list[str]:
    """A table of the 2-GPU validation and one of flat vs hybrid per GPU count; details in scale.md."""
    model = data.get("model", {})
    hw = data.get("hardware", {})
    lines = [
        "## Scale model: flat vs hybrid sharding (a model, not a measurement)",
        "",
        f"`python -m bench.scale`, the {model.get('name', '?')} decoder at {data.get('tokens_per_gpu', '?')} "
        f"tokens per GPU, {hw.get('gpus_per_node', '?')} GPUs per node, {hw.get('inter_node_gbps', '?')} Gb/s "
        "per GPU between nodes; calibrated on the 2-GPU H200 runs. Formula, assumptions and the 7B/70B tables: "
        "[scale.md](scale.md).",
        "",
        "| 2-GPU regime | predicted ms | measured ms | error |",
        "|---|---:|---:|---:|",
    ]
    for v in data.get("validation_2gpu", []):
        lines.append(f"| {v['regime']} | {v['predicted_ms']:.1f} | {v['measured_ms']:.1f} | {100 * v['error']:+.1f}% |")
    lines += ["", "| GPUs | strategy | step ms | tokens/s/GPU | efficiency |", "|---:|---|---:|---:|---:|"]
    for r in data.get("rows", []):
        lines.append(f"| {r['gpus']} | {r['strategy']} | {r['step_ms']:.1f} | {r['tok_s_gpu']:,.0f} | "
                     f"{100 * r['efficiency']:.1f}% |")
    return [*lines, ""]
