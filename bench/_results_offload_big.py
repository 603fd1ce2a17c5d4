"""The typed records of an ``offload_big.json``; ``bench.results_io`` re-exports them (split off to keep it short).

``bench.offload.big``: models that outgrow the GPU, every implementation in its own process, each configuration
held against its floor max(GPU compute, PCIe, CPU optimizer) measured in the same job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench._results_fields import Env, _int, _obj, _objs, _pos, _text, num

OFFLOAD_BIG_OK = "ok"


@dataclass(frozen=True)
class OffloadBigRow:
    """One implementation (and variant) in one configuration: a row of ``results``."""

    impl: str
    config: str
    variant: str | None = None  # an extra shardfuse setting ("step-in-backward, no clipping", "host-accum")
    status: str = "error"  # "ok", "skipped", "oom", "error", "compute-only" (resident: forward+backward only)
    reason: str | None = None
    tokens_per_step: int | None = None
    params: float | None = None
    micro_batches: int | None = None
    batch: int | None = None
    seq: int | None = None
    step_ms: float | None = None
    step_ms_min: float | None = None
    step_ms_max: float | None = None
    floor_ms: float | None = None
    tokens_per_s: float | None = None
    gpu_peak_gib: float | None = None
    host_rss_gib: float | None = None
    gpu_budget_gib: float | None = None
    fwd_bwd_ms: float | None = None
    # shardfuse-ssd: the floor the disk's measured bandwidth sets, the bytes the tier moved per step, its I/O mode
    disk_floor_ms: float | None = None
    ssd_read_gb_per_step: float | None = None
    ssd_written_gb_per_step: float | None = None
    ssd_io_mode: str | None = None
    commit: str | None = None  # the commit of the call that measured the row (merged files)
    host_load: str | None = None  # set (why) when the host was loaded while the row was measured (bench.host_load)
    host_cores: int | None = None  # the measuring host's cores (merged files; else the file's ``host``)

    @classmethod
    def parse(cls, r: dict[str, Any]) -> OffloadBigRow:
        ints = ("tokens_per_step", "micro_batches", "batch", "seq")
        floats = ("params", "step_ms", "step_ms_min", "step_ms_max", "floor_ms", "tokens_per_s", "gpu_peak_gib",
                  "host_rss_gib", "gpu_budget_gib", "fwd_bwd_ms", "disk_floor_ms", "ssd_read_gb_per_step",
                  "ssd_written_gb_per_step")  # fmt: skip
        return cls(
            impl=str(r["impl"]), config=str(r["config"]), variant=_text(r.get("variant")),
            status=_text(r.get("status")) or "error", reason=_text(r.get("reason")),
            **{k: _int(r.get(k)) for k in ints}, **{k: num(r.get(k)) for k in floats},
            ssd_io_mode=_text(r.get("ssd_io_mode")), commit=_text(r.get("commit")),
            host_load=_text(r.get("host_load")), host_cores=_int(r.get("host_cores")),
        )  # fmt: skip

    @property
    def measured(self) -> bool:
        """Whether the row has a step time to show (status "ok" and a positive ``step_ms``)."""
        return self.status == OFFLOAD_BIG_OK and _pos(self.step_ms) is not None

    @property
    def name(self) -> str:
        """``impl``, with the variant in brackets where there is one."""
        return f"{self.impl} [{self.variant}]" if self.variant else self.impl


@dataclass(frozen=True)
class OffloadBigFloor:
    """``floors[config]``: the floor of one configuration and its terms, in ms (None: not measured)."""

    config: str
    params: float | None = None
    compute_ms: float | None = None
    pcie_ms: float | None = None
    h2d_ms: float | None = None
    d2h_ms: float | None = None
    cpu_opt_ms: float | None = None
    floor_ms: float | None = None
    bound: str | None = None  # the term that sets the floor: "compute_ms", "pcie_ms" or "cpu_opt_ms"
    bytes: str | None = None  # what crosses PCIe per optimizer step, in words

    @classmethod
    def parse(cls, config: str, f: dict[str, Any]) -> OffloadBigFloor:
        keys = ("params", "compute_ms", "pcie_ms", "h2d_ms", "d2h_ms", "cpu_opt_ms", "floor_ms")
        return cls(config, **{k: num(f.get(k)) for k in keys}, bound=_text(f.get("bound")),
                   bytes=_text(f.get("bytes")))  # fmt: skip


@dataclass(frozen=True)
class OffloadBigHardware:
    """``hardware_floor``: the pinned PCIe bandwidths and the CPU optimizer's speed, measured in the same job."""

    status: str | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    bw_bytes: float | None = None
    opt_s: float | None = None
    opt_params_measured: float | None = None
    opt_s_per_param: float | None = None
    opt_threads: int | None = None
    opt_impl: str | None = None
    gpu_total_gib: float | None = None
    host_copy_gbps: float | None = None  # host memory bandwidth (torch copy, read + write)

    @classmethod
    def parse(cls, v: Any) -> OffloadBigHardware:
        h = _obj(v)
        keys = ("h2d_gbps", "d2h_gbps", "bw_bytes", "opt_s", "opt_params_measured", "opt_s_per_param",
                "gpu_total_gib", "host_copy_gbps")  # fmt: skip
        return cls(status=_text(h.get("status")), **{k: num(h.get(k)) for k in keys},
                   opt_threads=_int(h.get("opt_threads")), opt_impl=_text(h.get("opt_impl")))  # fmt: skip


# Versions of the other implementations that ``bench.offload.big`` records in its ``env``.
OFFLOAD_BIG_VERSIONS = (("fairscale", "FairScale"), ("deepspeed", "DeepSpeed"), ("transformers", "transformers"))


@dataclass(frozen=True)
class OffloadBigFile:
    """An ``offload_big.json`` of ``bench.offload.big``: rows, floors and how they were measured."""

    env: Env
    versions: dict[str, str]  # label -> version, of OFFLOAD_BIG_VERSIONS the env records
    host: dict[str, int]  # cpu_count, affinity_cores, torch_threads (those recorded)
    hardware: OffloadBigHardware
    floors: dict[str, OffloadBigFloor]  # in file order
    rows: list[OffloadBigRow]  # rows with an implementation and a configuration, in file order
    device: str | None = None
    steps: int | None = None
    warmup: int | None = None
    budget_gib: float | None = None
    how: dict[str, str] = field(default_factory=dict)  # config's "step_ms", "gpu_peak", "host_rss", "floor_bytes"
    merged_from: tuple[str, ...] = ()  # the commits of the files ``--merge`` joined (empty: one run)
    disk: dict[str, Any] = field(default_factory=dict)  # the SSD rows' disk probe: dir, read/write_gbps, ...

    @classmethod
    def parse(cls, data: dict[str, Any]) -> OffloadBigFile:
        env, c = _obj(data.get("env")), _obj(data.get("config"))
        versions = {label: str(env[k]) for k, label in OFFLOAD_BIG_VERSIONS if _text(env.get(k))}
        host = {k: v for k, v in _obj(data.get("host")).items() if _int(v) is not None}
        floors = {str(k): OffloadBigFloor.parse(str(k), f) for k, f in _obj(data.get("floors")).items()
                  if isinstance(f, dict)}  # fmt: skip
        rows = [OffloadBigRow.parse(r) for r in _objs(data.get("results")) if r.get("impl") and r.get("config")]
        how = {k: str(c[k]) for k in ("step_ms", "gpu_peak", "host_rss", "floor_bytes") if _text(c.get(k))}
        merged = tuple(str(m.get("commit") or "?") for m in _objs(data.get("merged_from")))
        return cls(Env.parse(data.get("env")), versions, host, OffloadBigHardware.parse(data.get("hardware_floor")),
                   floors, rows, _text(c.get("device")), _int(c.get("steps")), _int(c.get("warmup")),
                   num(c.get("budget_gib")), how, merged, _obj(data.get("disk")))  # fmt: skip

    @property
    def configs(self) -> list[str]:
        """The configurations, in the order of ``floors`` then of the rows."""
        return list(dict.fromkeys([*self.floors, *(r.config for r in self.rows)]))

    def rows_of(self, config: str) -> list[OffloadBigRow]:
        return [r for r in self.rows if r.config == config]

    def floor_ms(self, config: str) -> float | None:
        """The configuration's floor: from ``floors``, else the one its rows carry."""
        f = self.floors.get(config)
        if f is not None and _pos(f.floor_ms):
            return f.floor_ms
        return next((r.floor_ms for r in self.rows_of(config) if _pos(r.floor_ms)), None)

    def find(self, config: str, impl: str, variant: str | None = None) -> OffloadBigRow | None:
        """The row of ``impl`` (with ``variant``, None: the plain one) in ``config``."""
        return next((r for r in self.rows_of(config) if r.impl == impl and r.variant == variant), None)

    def step_ms(self, config: str, impl: str) -> float | None:
        """The plain (un-varianted) row's step time, None where not measured."""
        r = self.find(config, impl)
        return r.step_ms if r is not None and r.measured else None
