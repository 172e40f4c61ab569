"""The update's matrix products alone at the Qwen3-8B widths: bf16 against rowwise FP8 (issue 31).

One micro-batch of the update is N = 64 x 160 rows. For each layer width (K in, M out) this times
`torch._scaled_mm` on operands already in e4m3 (the product alone), with cuBLAS's fast accumulation
off (what nla_core.fp8_linear runs) and on, the bf16 product of the same shape, and the input's
rowwise quantisation (`nla_core.quantize_rowwise`, compiled with dynamic shapes), each the median of
--reps runs between CUDA events, in TFLOP/s (2 N K M / seconds). The events bracket the host's call
too: the products keep the GPU busier than their launch takes, but `quantize_x`'s time includes the
compiled function's host overhead (its guards), so it is not a kernel time. The fused widths (q|k|v:
4096 -> 6144, gate|up: 4096 -> 24576) are the products one quantised input would feed if the
layers that read the same input were one.

    python bench/bench_fp8_products.py --out $OUT/products.json            # H200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import nla_core  # noqa: E402

WIDTHS = {"q,o": (4096, 4096), "k,v": (4096, 1024), "gate,up": (4096, 12288), "down": (12288, 4096),
          "q|k|v": (4096, 6144), "gate|up": (4096, 24576), "lm_head chunk": (4096, 151936)}


def median_seconds(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps + 3):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times[3:])[len(times[3:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=64 * 160)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    quantize = torch.compile(nla_core.quantize_rowwise, dynamic=True)
    rows = []
    for name, (k, m) in WIDTHS.items():
        n = 1024 if name == "lm_head chunk" else args.rows
        x = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(m, k, device=device, dtype=torch.bfloat16) / k**0.5
        xq, xs = nla_core.quantize_rowwise(x)
        wq, ws = nla_core.quantize_rowwise(w)
        flops = 2 * n * k * m
        timings = {
            "bf16": lambda: x @ w.t(),
            "fp8": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16),
            "fp8_fast_accum": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(),
                                                       out_dtype=torch.bfloat16, use_fast_accum=True),
            "quantize_x": lambda: quantize(x),
        }
        row = {"width": name, "n": n, "k": k, "m": m}
        for label, fn in timings.items():
            seconds = median_seconds(fn, args.reps)
            row[f"{label}_ms"] = seconds * 1e3
            if label != "quantize_x":
                row[f"{label}_tflops"] = flops / seconds / 1e12
        rows.append(row)
        print(f"[products] {name} N={n} K={k} M={m}: " + ", ".join(
            f"{label} {row[f'{label}_ms']:.3f} ms" + (f" ({row[f'{label}_tflops']:.0f} TF/s)" if label != "quantize_x" else "")
            for label in timings), flush=True)
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "reps": args.reps, "rows": rows}
    Path(args.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
