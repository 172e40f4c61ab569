"""bench/bench_update.py at a tiny shape on the CPU: it runs the trainer's update, and micro-batches sum
the same gradient."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_update_bench_runs_and_micro_batches_give_the_same_update(tmp_path):
    out = tmp_path / "update.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_update.py"), "--tiny", "--cases", "3x2",
                    "--variants", "2,4", "--profile-micro-batches", "0", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["errors"] == []
    cases = {c["variant"]: c for c in record["cases"]}
    assert set(cases) == {"2", "4"}
    # Another micro-batch sums the same gradient (float32 rounding only).
    assert abs(cases["4"]["grad_norm"] - cases["2"]["grad_norm"]) <= 1e-5 * cases["2"]["grad_norm"]
    assert all(c["s"] > 0 and c["loss"] == c["loss"] for c in cases.values())


def test_sites_without_tables_is_refused_before_any_work(tmp_path):
    out = tmp_path / "update.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_update.py"), "--tiny", "--sites",
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--sites writes beside the profiler tables: give --tables DIR" in result.stderr.splitlines()[-1]
    assert not out.exists()


def test_a_retired_option_is_refused_in_one_line_before_any_work(tmp_path):
    # RESULTS.md still cites `mlpcompile`'s command (retired after fad6eb1): a run of it says so, with no trace.
    out = tmp_path / "update.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_update.py"), "--tiny", "--variants",
                             "2,64:bf16+mlpcompile", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("bench_update.py: error: variant '64:bf16+mlpcompile': ")
    assert not out.exists()
