"""bench/timeline.py: idle gaps between kernels, attributed to the innermost host op running
on the launching thread at each gap's midpoint (a hand-built chrome trace with known answers)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from timeline import idle_gaps  # noqa: E402


def _x(cat: str, name: str, ts: float, dur: float, *, tid=1, correlation=None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_gaps_are_summed_and_named_by_the_innermost_host_op():
    events = [
        # host thread 1: a backward node holding a sync, then an allocation, then a bare stretch
        _x("cpu_op", "autograd::engine::evaluate_function", 0, 400),
        _x("cuda_runtime", "cudaStreamSynchronize", 120, 60),
        _x("cpu_op", "aten::empty", 300, 90),
        _x("cuda_runtime", "cudaMalloc", 310, 70),
        # launches (thread 1) of the kernels after each gap, and one on thread 2
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 190, 2, correlation=2),
        _x("cuda_driver", "cuLaunchKernelEx", 385, 2, correlation=3),  # cuBLAS launches through the driver
        _x("cuda_runtime", "cudaLaunchKernel", 590, 2, correlation=4),
        _x("cuda_runtime", "cudaLaunchKernel", 600, 2, tid=2, correlation=5),
        # device: busy 10-100, idle 100-200 (sync), busy 200-300 with an overlapping memcpy,
        # idle 300-400 (malloc), busy 400-500, idle 500-600 (nothing on thread 1), 600-602 (too short)
        _x("kernel", "k1", 10, 90, correlation=1),
        _x("kernel", "k2", 200, 100, correlation=2),
        _x("gpu_memcpy", "copy", 250, 20),
        _x("kernel", "k3", 400, 100, correlation=3),
        _x("kernel", "k4", 600, 1, correlation=4),
        _x("kernel", "k5", 603, 7, correlation=5),
    ]
    summary = idle_gaps({"traceEvents": events}, min_gap_us=5.0)
    assert summary["span_s"] == (610 - 10) / 1e6
    assert summary["busy_s"] == (90 + 100 + 100 + 1 + 7) / 1e6
    assert abs(summary["idle_s"] - (100 + 100 + 100 + 2) / 1e6) < 1e-12
    assert summary["gaps"] == 3  # the 2 us gap is idle but not attributed
    named = {name: (seconds, count) for name, seconds, count in summary["by_host_op"]}
    assert named == {
        "cudaStreamSynchronize": (100 / 1e6, 1),
        "cudaMalloc": (100 / 1e6, 1),
        "host between ops": (100 / 1e6, 1),
    }


def test_a_trace_without_device_work_is_all_zero():
    summary = idle_gaps({"traceEvents": [_x("cpu_op", "aten::mm", 0, 10)]})
    assert summary == {"span_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "gaps": 0, "by_host_op": []}


def test_host_lead_marks_every_block_in_every_pass_of_an_update(tmp_path):
    import json
    import subprocess

    out = tmp_path / "update.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_update.py"), "--tiny", "--cases", "2x2",
                    "--variants", "2", "--profile-micro-batches", "0", "--lead", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    lead = json.loads(out.read_text())["cases"][0]["lead"]
    # 3 tiny blocks; 2 groups of 2 in micro-batches of 2: 2 micro-batches sharing one prompt forward
    # (a prompt block) and its deferred backward, each with a response forward and backward; the
    # reference pass (micro-batch 64) runs both groups in one prompt and one response forward.
    assert lead["forward"]["marks"] == 3 * (1 + 2)
    assert lead["no-grad forward"]["marks"] == 3 * 2
    assert lead["backward"]["marks"] == 3 * (2 + 1)
