"""The PCIe floor of an ``OffloadModel`` variant: the bytes its schedule must move, over the measured link.

``link_bandwidth`` times pinned host<->device copies of one large buffer with CUDA events (median of a few
repetitions), each direction alone and both at once. ``necessary_bytes`` lists, term by term, what one steady-state
training step of a variant has to move across the bus (parameters, master weights, gradients, shadows,
activations); ``floor`` turns that into milliseconds::

    floor = max(host->device bytes / H2D GB/s, device->host bytes / D2H GB/s, resident step time)

the resident step being the plain model's (under bf16 autocast for a bf16 variant). It assumes both directions
and the compute overlap perfectly. The phases of a step limit that: a forward has nothing to send home, and a
backward's first copy home waits for its first slice's gradient. ``phase_floor`` therefore adds the forward's and
the backward's own bus time (each the larger of its two directions); a schedule can reach it only by hiding every
compute behind copies.

The bytes per step (P_i: parameters of slice i, n slices, c: bytes of the compute dtype, 4: fp32 master):

* ``optimizer_in_backward`` (the engine's carried schedule): forward: the compute copy (c P_i) of every slice but
  the first min(2, n - 1), which stay on the device from the previous backward, and the last, loaded as its fp32
  master (4 P_last) and kept for its backward; backward: the fp32 master (4 P_i) of every slice but the last;
  home: every updated master (4 P_i) and, in bf16, the shadow (c P_i) of the slices neither carried nor last.
* otherwise (the optimizer steps on the host between steps): forward: the fp32 master of every slice (the host
  step left the bf16 shadow stale: fp32 crosses and is cast on the device; in bf16 the shadow goes home, c P_i);
  backward: the compute copy of every slice but the last (kept from its forward); home: fp32 gradients (4 P_i).
* activations: with ``checkpoint_activation`` each slice's input (batch x width x c) goes home in the forward and
  comes back in the backward; with ``offload_activations`` every saved activation of every slice but the last
  (per Linear + ReLU pair: the Linear's input, and the slice's last ReLU output) both ways; kept on the device
  otherwise.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

GB = 1e9


def _timed(fn: Any, reps: int) -> float:
    """Median milliseconds of ``fn()`` between two CUDA events on the current stream (after 2 warm-ups)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return statistics.median(ms)


def link_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> dict[str, float]:
    """Pinned host<->device copy bandwidth in GB/s: each direction alone, and each while the other runs."""
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()

    def both() -> None:  # D2H on a side stream, joined back, while H2D runs on the current one
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host_out.copy_(dev_out, non_blocking=True)
        dev_in.copy_(host_in, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    h2d = _timed(lambda: dev_in.copy_(host_in, non_blocking=True), reps)
    d2h = _timed(lambda: host_out.copy_(dev_out, non_blocking=True), reps)
    duplex = _timed(both, reps)
    return {"h2d_gbps": nbytes / h2d / 1e6, "d2h_gbps": nbytes / d2h / 1e6,
            "duplex_gbps": nbytes / duplex / 1e6, "bytes": float(nbytes), "reps": float(reps)}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """What decides a variant's traffic: its slices, dtypes, and where activations and the optimizer live."""

    slice_params: list[int]  # parameters per slice
    slice_linears: list[int]  # Linear layers per slice (the bench model's saved activations)
    act_numel: int  # one activation of the bench model: batch x width
    compute_bytes: int  # 2 for bf16, 4 for fp32
    opt_in_backward: bool = False
    checkpoint: bool = True
    offload_activations: bool = False


def _params(v: Variant) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Parameter, master and gradient bytes by term: (host->device, device->host in backward, in forward)."""
    c, sizes = v.compute_bytes, v.slice_params
    last = len(sizes) - 1
    total = float(sum(sizes))
    h2d: dict[str, float] = {}
    home: dict[str, float] = {}
    fwd_home: dict[str, float] = {}
    if v.opt_in_backward:
        carried = set(range(min(2, last)))
        middle = float(sum(p for i, p in enumerate(sizes) if i not in carried and i != last))
        h2d["forward: compute copy of the slices neither carried nor last"] = c * middle
        h2d["forward: fp32 master of the last slice"] = 4.0 * sizes[last]
        h2d["backward: fp32 master of every slice but the last"] = 4.0 * sum(sizes[:last])
        home["home: updated fp32 masters"] = 4 * total
        if c != 4:
            home["home: bf16 shadow of the slices neither carried nor last"] = c * middle
        return h2d, home, fwd_home
    h2d["forward: fp32 master of every slice"] = 4 * total
    h2d["backward: compute copy of every slice but the last"] = c * float(sum(sizes[:last]))
    if c != 4:
        fwd_home["forward: bf16 shadow refreshed"] = c * total
    home["home: fp32 gradients"] = 4 * total
    return h2d, home, fwd_home


def _activations(v: Variant) -> dict[str, float]:
    """Activation bytes, each way."""
    one = v.act_numel * v.compute_bytes
    if v.checkpoint:
        return {"slice inputs (checkpoint)": len(v.slice_params) * one}
    if v.offload_activations:
        return {"saved activations of every slice but the last": sum(k + 1 for k in v.slice_linears[:-1]) * one}
    return {}


def necessary_bytes(v: Variant) -> dict[str, Any]:
    """Bytes one steady-state step moves each way, by term; ``forward_*`` the forward's part of each direction."""
    h2d, d2h_bwd, d2h_fwd = _params(v)
    acts = _activations(v)
    h2d_terms = {**h2d, **{f"activations back: {k}": b for k, b in acts.items()}}
    d2h_terms = {**d2h_fwd, **d2h_bwd, **{f"activations home: {k}": b for k, b in acts.items()}}
    fwd_h2d = sum(b for k, b in h2d.items() if k.startswith("forward"))
    fwd_d2h = sum(d2h_fwd.values()) + sum(acts.values())  # activations go home during the forward
    return {"h2d": float(sum(h2d_terms.values())), "d2h": float(sum(d2h_terms.values())),
            "forward_h2d": float(fwd_h2d), "forward_d2h": float(fwd_d2h),
            "terms": {"h2d": h2d_terms, "d2h": d2h_terms}}  # fmt: skip


def floor(need: dict[str, Any], link: dict[str, float], compute_ms: float | None) -> dict[str, Any]:
    """The floor in ms (see the module docstring), which term binds, and the per-phase floor."""
    h2d_ms = need["h2d"] / link["h2d_gbps"] / 1e6
    d2h_ms = need["d2h"] / link["d2h_gbps"] / 1e6
    terms = {"h2d": h2d_ms, "d2h": d2h_ms}
    if compute_ms:
        terms["compute"] = compute_ms
    bound = max(terms, key=lambda k: terms[k])
    fwd = max(need["forward_h2d"] / link["h2d_gbps"], need["forward_d2h"] / link["d2h_gbps"]) / 1e6
    bwd = max((need["h2d"] - need["forward_h2d"]) / link["h2d_gbps"],
              (need["d2h"] - need["forward_d2h"]) / link["d2h_gbps"]) / 1e6  # fmt: skip
    return {"floor_ms": terms[bound], "floor_bound": bound, "floor_h2d_ms": h2d_ms, "floor_d2h_ms": d2h_ms,
            "floor_compute_ms": compute_ms, "phase_floor_ms": max(fwd + bwd, compute_ms or 0.0),
            "floor_h2d_gb": need["h2d"] / GB, "floor_d2h_gb": need["d2h"] / GB,
            "floor_terms_gb": {d: {k: b / GB for k, b in t.items()} for d, t in need["terms"].items()}}  # fmt: skip
