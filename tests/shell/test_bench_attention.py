"""bench/bench_attention.py at its tiny shape on the CPU: every variant runs, and within each family the variants
compute the same attention (or rotary embedding) and gradients as its first, transformers' own path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_attention_bench_variants_agree_with_the_masked_path(tmp_path):
    out = tmp_path / "attention.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_attention.py"), "--tiny", "--reps", "1",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["family"], r["variant"]) for r in rows] == [
        ("response", "hf_mask"), ("response", "lower_right"), ("ar", "hf_mask"), ("ar", "causal"),
        ("rotary", "eager"), ("rotary", "compiled_dynamic"), ("rotary", "compiled_static"),
        ("rotary", "compiled_head_dims_static")]
    for row in rows:  # float32 on the CPU: the same arithmetic to rounding
        assert row["ms"] > 0 and row["max_abs_diff"] < 1e-4, row
