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
          "D2H", "GPU idle", "next forward waited for updates", "worker waited for grad copies", "lower bound ms",
          "host-memory bound ms"]

# Host-memory bytes per parameter of one fully offloaded step (fp32 shards, fp32 AdamW state on the host). The
# update's own bandwidth is the floor's: UPDATE_BYTES per parameter in the CPU optimizer's time alone.
UPDATE_BYTES = 28  # fused AdamW: reads param, grad, exp_avg, exp_avg_sq (16), writes param and both moments (12)
CLIP_BYTES = 4  # clipping's scale: the chunked pass writes the scaled gradient back once
FORWARD_COPY_BYTES = 4  # the forward's host->device copy of the fp32 shard reads it from host memory
BACKWARD_COPY_BYTES = 4  # the backward's re-gather reads the fp32 shard again (reshard_after_forward=True)
GRAD_COPY_BYTES = 4  # the fp32 gradient's device->host copy writes it into host memory
# With exact clipping no update starts before backward ends: the bytes that pass during backward (its fp32 copy
# and the gradient copy) hide under it; the update, the clip and the next forward's copies (which run beside the
# update, sharing the bandwidth) follow it.
AFTER_BACKWARD_BYTES = UPDATE_BYTES + CLIP_BYTES + FORWARD_COPY_BYTES
UNCLIPPED_BYTES = UPDATE_BYTES + FORWARD_COPY_BYTES + BACKWARD_COPY_BYTES + GRAD_COPY_BYTES


def _name(r: dict[str, Any]) -> str:
    impl = str(r.get("impl", "?"))
    clip = "clip 1.0" if r.get("clipping", not r.get("step_in_backward")) else "no clip, step_in_backward"
    where = f"budget {r['gpu_budget_gib']:.0f} GiB" if r.get("gpu_budget_gib") else "full offload"
    how = ", clip_in_update" if r.get("clip_in_update") else ""
    if r.get("gpu_update_share"):
        how += f", gpu_update_share {r['gpu_update_share']:g}"
    if r.get("max_norm") and r["max_norm"] > 1e6:
        how += ", never fires"
    return f"{impl}: {where}, {clip}{how}" if impl.startswith("shardfuse") else impl


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


def host_memory_bound_ms(r: dict[str, Any], floor: dict[str, Any], backward_ms: float | None = None) -> float | None:
    """Full offload only: the step's bytes through host memory at the update's own measured bandwidth
    (``UPDATE_BYTES`` per parameter in ``cpu_opt_ms``). Clipped: backward (``backward_ms``, default 2/3 of the
    resident forward+backward) + ``AFTER_BACKWARD_BYTES`` per parameter; unclipped (the update overlaps backward):
    the larger of the GPU compute and all ``UNCLIPPED_BYTES`` per parameter."""
    if not str(r.get("impl", "")).startswith("shardfuse") or r.get("gpu_budget_gib"):
        return None
    if not floor.get("cpu_opt_ms") or not floor.get("compute_ms"):
        return None
    ms_per_byte_per_param = float(floor["cpu_opt_ms"]) / UPDATE_BYTES
    if r.get("clipping", True) and not r.get("step_in_backward"):
        backward = 2 / 3 * float(floor["compute_ms"]) if backward_ms is None else backward_ms
        return backward + AFTER_BACKWARD_BYTES * ms_per_byte_per_param
    return max(float(floor["compute_ms"]), UNCLIPPED_BYTES * ms_per_byte_per_param)


def _row(r: dict[str, Any], floor: dict[str, Any]) -> list[Any]:
    g, h = r.get("gpu_timeline") or {}, r.get("profiled_host_timeline") or {}
    fb = r.get("profiled_step_ms")
    after = (g.get("window_ms", 0.0) - fb) if fb is not None and g else None
    fmt = lambda v: "-" if v is None else f"{float(v):.0f}"  # noqa: E731
    spread = f"{fmt(r.get('step_ms'))} ({fmt(r.get('step_ms_min'))}-{fmt(r.get('step_ms_max'))})"
    return [_name(r), spread, fmt(fb), fmt(after), fmt(g.get("compute_ms")), fmt(g.get("h2d_ms")),
            fmt(g.get("d2h_ms")), fmt(g.get("gpu_idle_ms")), fmt(h.get("caller_wait_ms")), fmt(h.get("grad_wait_ms")),
            fmt(lower_bound_ms(r, floor)), fmt(host_memory_bound_ms(r, floor))]


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
                  "hides under the updates. GPU columns: busy ms of each engine in that window (intervals merged). "
                  f"Host-memory bound: the step's host-memory bytes at the update's own bandwidth ({UPDATE_BYTES} "
                  f"B/param in the CPU optimizer's time); clipped: backward + {AFTER_BACKWARD_BYTES} B/param (update "
                  f"{UPDATE_BYTES}, clip {CLIP_BYTES}, the next forward's fp32 copy {FORWARD_COPY_BYTES}), the "
                  f"backward's copy and the gradient copy ({BACKWARD_COPY_BYTES} + {GRAD_COPY_BYTES}) under "
                  f"backward; unclipped: max(GPU compute, {UNCLIPPED_BYTES} B/param).",
                  "", *table(HEADER, [_row(r, f) for r in rows if r.get("gpu_timeline") or r.get("impl") ==
                                      "resident"]), ""]
    if explanation and explanation.strip():
        lines += [explanation.strip(), ""]
    return lines
