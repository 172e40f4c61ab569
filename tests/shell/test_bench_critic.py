"""bench/bench_critic.py at a tiny shape on the CPU: every variant runs and scores every input,
and the AR reads exactly the explanation's tokens plus the template's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_critic_bench_runs_every_variant_on_inputs_of_the_asked_length(tmp_path):
    out = tmp_path / "critic.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_critic.py"), "--tiny", "--inputs", "6",
                    "--tokens", "7", "--variants", "2,3", "--profile-micro-batches", "0", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["errors"] == []
    assert [c["variant"] for c in record["cases"]] == ["2", "3"]
    for case in record["cases"]:
        assert case["scored"] == 6
        assert case["ar_tokens"] == 7 + 5  # "Text: " is 5 toy tokens
        assert math.isfinite(case["loss"]) and case["s"] > 0
