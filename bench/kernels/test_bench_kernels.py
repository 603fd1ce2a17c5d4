"""pytest-benchmark view of the kernel cases, for saved runs and ``pytest-benchmark compare``.

    PYTHONPATH=$PWD python -m pytest bench/kernels/test_bench_kernels.py --benchmark-enable \
        --benchmark-json=$OUT/kernels-pytest-benchmark.json

Each round runs the kernel 10 times and synchronises, so the per-call time is round time / 10. The
authoritative GB/s numbers come from ``bench/kernels/run.py`` (CUDA events); this file exists so that
pytest-benchmark can compare a new run against a stored one and flag regressions.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from bench.kernels.run import FAMILY_MODULES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel benchmarks need a CUDA GPU")

SIZE = 1 << 26  # 64M elements: past the L2, big enough to be bandwidth-bound
CALLS_PER_ROUND = 10


@pytest.fixture(scope="module")
def cases_by_module():
    return {m: importlib.import_module(f"bench.kernels.{m}").cases([SIZE]) for m in FAMILY_MODULES}


@pytest.mark.parametrize("module_name", FAMILY_MODULES)
def test_kernel_family(benchmark, cases_by_module, module_name):
    selected = cases_by_module[module_name]
    assert selected, f"no benchmark cases in bench/kernels/{module_name}.py"

    def run_all():
        for case in selected:
            for _ in range(CALLS_PER_ROUND):
                case.shardfuse()
        torch.cuda.synchronize()

    run_all()  # warm-up: compile outside the timed rounds
    benchmark.extra_info["cases"] = [c.name for c in selected]
    benchmark.extra_info["bytes_per_round"] = sum(c.bytes_moved for c in selected) * CALLS_PER_ROUND
    benchmark.pedantic(run_all, rounds=10, iterations=1)
