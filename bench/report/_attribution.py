"""The page's section of an ``offload_attribution.json``: where one offloaded step's time goes (issue 30).

The file is an ``offload_big.json`` run with ``BIG_PROFILE=1 BIG_TRACE=1`` (its ``kind`` set to
``offload_attribution`` when stored, so its rows are not read as result rows): per implementation the timed steps,
then one more step profiled to the end of its host updates: the GPU engines' busy times
(``bench.offload.gpu_timeline``) and the host worker's timeline (``bench.offload.host_timeline``). The explanation
of the gap, line by line, is hand-written beside it (``offload_attribution.md``, same stem) and shown under the table.
"""

from __future__ import annotations

from typing import Any

from bench.report._common import env_line, table
from bench.results_io import Result

HEADER = ["run", "step ms (spread)", "profiled: fwd+bwd ms", "host updates after bwd ms", "GPU compute", "H2D",
          "D2H", "GPU idle", "next forward waited for updates", "worker waited for grad copies", "lower bound ms"]


def _name(r: dict[str, Any]) -> str:
    impl = str(r.get("impl", "?"))
    clip = "clip 1.0" if r.get("clipping", not r.get("step_in_backward")) else "no clip, step_in_backward"
    where = f"budget {r['gpu_budget_gib']:.0f} GiB" if r.get("gpu_budget_gib") else "full offload"
    return f"{impl}: {where}, {clip}" if impl.startswith("shardfuse") else impl


def lower_bound_ms(r: dict[str, Any], floor: dict[str, Any]) -> float | None:
    """Full offload only: clipped = backward (2/3 of the resident forward+backward) + the host update alone (the
    floor's fused CPU AdamW time); unclipped = the configuration's floor, max(GPU, PCIe, CPU optimizer)."""
    if not str(r.get("impl", "")).startswith("shardfuse") or r.get("gpu_budget_gib"):
        return None
    if not floor.get("cpu_opt_ms") or not floor.get("compute_ms"):
        return None
    if r.get("clipping", True) and not r.get("step_in_backward"):
        return 2 / 3 * float(floor["compute_ms"]) + float(floor["cpu_opt_ms"])
    return float(floor.get("floor_ms") or 0) or None


def _row(r: dict[str, Any], floor: dict[str, Any]) -> list[Any]:
    g, h = r.get("gpu_timeline") or {}, r.get("profiled_host_timeline") or {}
    fb = r.get("profiled_step_ms")
    after = (g.get("window_ms", 0.0) - fb) if fb is not None and g else None
    fmt = lambda v: "-" if v is None else f"{float(v):.0f}"  # noqa: E731
    spread = f"{fmt(r.get('step_ms'))} ({fmt(r.get('step_ms_min'))}-{fmt(r.get('step_ms_max'))})"
    return [_name(r), spread, fmt(fb), fmt(after), fmt(g.get("compute_ms")), fmt(g.get("h2d_ms")),
            fmt(g.get("d2h_ms")), fmt(g.get("gpu_idle_ms")), fmt(h.get("caller_wait_ms")), fmt(h.get("grad_wait_ms")),
            fmt(lower_bound_ms(r, floor))]


def attribution_section(res: Result, explanation: str | None) -> list[str]:
    d = res.data
    raw = d.get("floors") or {}
    floors = raw if isinstance(raw, dict) else {f.get("config"): f for f in raw if isinstance(f, dict)}
    hw = d.get("hardware_floor") or {}
    lines = [f"### Where an offloaded step's time goes (`{res.name}.json`)", "", env_line(res.env), ""]
    host = d.get("host") or hw.get("host") or {}
    for config, f in floors.items():
        rows = [r for r in d.get("results") or [] if r.get("config") == config and r.get("status") == "ok"]
        lines += [f"#### `{config}` ({float(f.get('params', 0)) / 1e9:.2f}B parameters; host "
                  f"{host.get('cpu_count', '?')} cores): GPU compute {f.get('compute_ms', 0):.0f} ms (resident "
                  f"forward+backward), CPU optimizer alone {f.get('cpu_opt_ms', 0):.0f} ms, PCIe "
                  f"{f.get('pcie_ms', 0):.0f} ms per direction", "",
                  "The profiled step starts with no update pending (its forward waits for nothing), so its "
                  "forward + backward and the host updates after it are apart; in the timed steps the next forward "
                  "hides under the updates. GPU columns: busy ms of each engine in that window (intervals merged).",
                  "", *table(HEADER, [_row(r, f) for r in rows if r.get("gpu_timeline") or r.get("impl") ==
                                      "resident"]), ""]
    if explanation and explanation.strip():
        lines += [explanation.strip(), ""]
    return lines
