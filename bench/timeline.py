"""Where the GPU waits: idle gaps in a torch.profiler trace, and what the host did meanwhile.

A kernel that starts after the previous one ended left the GPU idle for that gap. The host
thread that launched it was, at the gap's midpoint, inside some op; the innermost such op
(an aten op, a CUDA runtime call such as `cudaStreamSynchronize` or `cudaMalloc`, an autograd
node) is what the GPU waited for. Summing gaps by that op says which host work to remove.

The profiler slows the host (a few microseconds an op), so gaps read longer than in an
unprofiled run: compare the shares between ops, and take the unprofiled busy share as
(kernel time of the profiled window) / (unprofiled wall time of the same work).

    summary = idle_gaps(json.loads(Path("trace.json").read_text()))
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Chrome-trace categories of work on the device."""


def idle_gaps(trace: dict[str, Any], *, min_gap_us: float = 5.0, top: int = 15) -> dict[str, Any]:
    """The device's busy time, idle time between its first and last kernel, and the idle time by
    the host op that was running (on the launching thread) at each gap's midpoint.

    Args:
      trace: a chrome trace as torch.profiler's `export_chrome_trace` writes it (with CUDA activity).
      min_gap_us: shorter gaps (launch latency) are counted as idle but not attributed.
    Returns: {"span_s", "busy_s", "idle_s", "gaps", "by_host_op": [[name, seconds, count], ...]}.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        return {"span_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "gaps": 0, "by_host_op": []}
    # cuBLAS and cuDNN launch through the driver API (cuLaunchKernelEx), the rest through the runtime.
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    # --- the gaps, each with the thread that launched the kernel after it -------------------------
    busy = idle = 0.0
    gaps: list[tuple[float, float, Any]] = []  # (midpoint, length, launching thread)
    end = device[0]["ts"]
    for kernel in device:
        start, stop = kernel["ts"], kernel["ts"] + kernel.get("dur", 0)
        if start > end:
            idle += start - end
            if start - end >= min_gap_us:
                launch = launches.get(kernel.get("args", {}).get("correlation"))
                gaps.append(((start + end) / 2, start - end, launch["tid"] if launch else None))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)

    # --- what each launching thread was inside at each gap's midpoint --------------------------------
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    threads = {tid for _, _, tid in gaps}
    for tid in threads:
        queries = sorted((moment, length) for moment, length, t in gaps if t == tid)
        names = _innermost_at(_host_events(events, tid), [moment for moment, _ in queries]) if tid is not None \
            else ["no launch recorded"] * len(queries)
        for (_, length), name in zip(queries, names):
            by_op[name][0] += length
            by_op[name][1] += 1
    ranked = sorted(by_op.items(), key=lambda item: -item[1][0])[:top]
    return {
        "span_s": (end - device[0]["ts"]) / 1e6,
        "busy_s": busy / 1e6,
        "idle_s": idle / 1e6,
        "gaps": len(gaps),
        "by_host_op": [[name, seconds / 1e6, count] for name, (seconds, count) in ranked],
    }


HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")


def _host_events(events: list[dict[str, Any]], tid: Any) -> list[dict[str, Any]]:
    """Thread `tid`'s host events, by start (outer before inner at equal starts)."""
    ops = [e for e in events if e.get("tid") == tid and e.get("cat") in HOST_CATEGORIES]
    return sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0)))


def _innermost_at(ops: list[dict[str, Any]], moments: list[float]) -> list[str]:
    """For each of the sorted `moments`, the innermost of the nested `ops` that spans it.

    One sweep: events open in start order onto a stack, and leave it once ended; at a moment the
    top of the stack (the latest-started event still open) is the innermost.
    """
    names, stack, next_op = [], [], 0
    for moment in moments:
        while next_op < len(ops) and ops[next_op]["ts"] <= moment:
            event = ops[next_op]
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < event["ts"]:
                stack.pop()
            stack.append(event)
            next_op += 1
        while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < moment:
            stack.pop()
        names.append(stack[-1]["name"] if stack else "host between ops")
    return names


class HostLead:
    """How far the host runs ahead of the GPU, at marks taken without a profiler.

    Each mark records the host's clock and a CUDA event on the current stream; after a final
    synchronisation, lead = (when the GPU reached the mark) - (when the host enqueued it). A lead
    near zero means the GPU had drained its queue and waited for the host there; a lead that
    stays large means the host is never the bottleneck. Marks: every decoder block's forward
    (forward pre-hook) and backward (full backward pre-hook), labelled by phase.

        with HostLead(blocks) as lead:
            update()
        summary = lead.summary()
    """

    def __init__(self, blocks, *, starved_ms: float = 1.0) -> None:
        self.blocks, self.starved_ms = list(blocks), starved_ms
        self.cuda = torch.cuda.is_available()
        """Without CUDA (CPU tests) the marks carry no events and every lead reads 0."""
        self.marks: list[tuple[str, float, Any]] = []
        self.handles: list[Any] = []

    def mark(self, label: str) -> None:
        event = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if event is not None:
            event.record()
        self.marks.append((label, time.perf_counter(), event))

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __enter__(self) -> "HostLead":
        def forward(module, args):
            self.mark("forward" if torch.is_grad_enabled() else "no-grad forward")

        def backward(module, grad_output):
            self.mark("backward")

        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(forward))
            self.handles.append(block.register_full_backward_pre_hook(backward))
        self._sync()
        self.mark("start")
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        for handle in self.handles:
            handle.remove()

    def summary(self) -> dict[str, Any]:
        """Per label: marks, median and minimum lead (ms), and the share of marks where the GPU
        waited (lead below starved_ms)."""
        _, host0, event0 = self.marks[0]
        by_label: dict[str, list[float]] = defaultdict(list)
        for label, host, event in self.marks[1:]:
            by_label[label].append(event0.elapsed_time(event) - 1e3 * (host - host0) if event else 0.0)
        out = {}
        for label, leads in by_label.items():
            leads.sort()
            out[label] = {"marks": len(leads), "median_ms": leads[len(leads) // 2], "min_ms": leads[0],
                          "starved": sum(lead < self.starved_ms for lead in leads) / len(leads)}
        return out
