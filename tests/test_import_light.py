"""``import shardfuse`` loads no heavy part of torch that only some features need.

``torch.distributed.tensor`` (DTensor, ~0.6 s with the sympy it pulls in), ``torch._dynamo`` (~0.5 s, loaded by
``torch.compiler.disable``) and ``torch.distributed.checkpoint`` are imported where a feature first needs them
(a sharded checkpoint, a ``torch.compile`` trace), so that ``import shardfuse`` costs about what ``import torch``
and Triton cost. The check is the set of modules a fresh interpreter holds after the import, not a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Loaded on first use only. sympy and torch.fx's symbolic shapes come with the first two; torch._inductor and
# torch.distributed.fsdp with torch._dynamo.
LAZY = (
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch._inductor",
    "torch.distributed.fsdp",
    "torch.fx.experimental.symbolic_shapes",
    "sympy",
)

# Run in a fresh interpreter: records, for each module of LAZY, the shardfuse frames that were importing when it
# was first looked up, then prints which of them `import <target>` left loaded.
_PROBE = r"""
import importlib.abc, json, sys, traceback
watch, target = json.loads(sys.argv[1]), sys.argv[2]
baseline = {m for m in watch if m in sys.modules}
chains = {}

class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in watch and name not in chains:
            chains[name] = [f"{f.filename}:{f.lineno}: {(f.line or '').strip()}" for f in traceback.extract_stack()
                            if "shardfuse" in f.filename]
        return None

sys.meta_path.insert(0, Recorder())
__import__(target)
print(json.dumps({"baseline": sorted(baseline),
                  "loaded": {m: chains.get(m, []) for m in watch if m in sys.modules and m not in baseline}}))
"""


def _loaded_by(target: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(LAZY), target], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"`import {target}` failed in a fresh interpreter:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", ["shardfuse", "shardfuse.kernels", "shardfuse.offload", "shardfuse.sharding"])
def test_import_leaves_heavy_torch_modules_unloaded(target: str) -> None:
    result = _loaded_by(target)
    assert not result["baseline"], f"the probe's interpreter had {result['baseline']} loaded before the import"
    loaded = result["loaded"]
    assert not loaded, (
        f"`import {target}` loaded {sorted(loaded)}, which only some features need (each costs up to 0.6 s of "
        "every user's import). Imported from:\n"
        + "\n".join(f"  {m}:\n    " + "\n    ".join(chain or ["(no shardfuse frame: an import below torch's)"])
                    for m, chain in loaded.items())
        + "\nImport it inside the function that needs it (annotations under `if TYPE_CHECKING:`), or make the "
        "call that loads it (e.g. torch.compiler.disable) on first use."
    )


def test_probe_sees_an_eager_import() -> None:
    """The probe itself can fail: a module that imports DTensor at its top is reported, with the line."""
    result = _loaded_by("torch.distributed.tensor")
    assert "torch.distributed.tensor" in result["loaded"] and "sympy" in result["loaded"], result
