"""docs/recipes.md's fine-tuning recipes: the script runs under torchrun on 2 CPU processes, and the page quotes the
scripts verbatim (examples/finetune_hf.py; examples/sft_buckets.py, run by tests/test_capture_shapes.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "finetune_hf.py"
QUOTED = (SCRIPT, REPO / "examples" / "sft_buckets.py")  # the scripts the page's python blocks quote
PAGE = REPO / "docs" / "recipes.md"


def _lines(code: str) -> list[str]:
    return [line.strip() for line in code.splitlines() if line.strip()]


def test_recipe_blocks_are_quoted_from_the_script():
    scripts = ["\n".join(_lines(path.read_text())) for path in QUOTED]
    page = PAGE.read_text()
    quoted = {"## Fine-tune a Hugging Face Llama under torchrun", "## Fine-tune on variable-length samples with a "
              "captured step"}  # the other recipes' code is tested where it runs (the float8 one in tests/float8)
    sections = re.split(r"^(?=## )", page, flags=re.MULTILINE)
    text = "".join(sec for sec in sections if sec.splitlines() and sec.splitlines()[0].strip() in quoted)
    assert len([sec for sec in sections if sec.splitlines() and sec.splitlines()[0].strip() in quoted]) == 2
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) >= 5
    # Each block is a dedented run of consecutive lines of the script.
    stale = [b for b in blocks if not any("\n".join(_lines(b)) in script for script in scripts)]
    assert not stale, f"docs/recipes.md quotes code the script no longer has: {stale}"


def test_finetune_recipe_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "eval before training" in out and "eval after step 6" in out, out[-2000:]
    assert re.search(r"resumed from the checkpoint: loss differences .* PASS", out), out[-2000:]
    assert "generated: [" in out
