"""How exactly the device's FP8 product sums its terms: `nla_core.fp8_linear` against the float64
product of the same e4m3 operands, at the Qwen3-8B widths, forward (x @ W^T, summed over K) and the
FP8 backward's input gradient (g @ W, summed over M), with `torch._scaled_mm`'s fast accumulation off
(what nla uses) and on.

Per case: the largest error relative to the entry's sum of absolute terms, max_ij |y_ij - ref_ij| /
sum_k |q_ik s_i r_jk t_j| after removing the bf16 output's own rounding (|err| - 2^-8 |ref|, floored at 0),
so a float32 accumulator reads about (inner size) x 2^-24 or less and a narrower one more.

    python bench/fp8_accumulation.py --out $OUT/fp8_accumulation.json    # a GPU of compute capability >= 9.0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import nla_core  # noqa: E402

WIDTHS = [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)]
"""(K, M) of the 8B shape's q/o, k/v, gate/up and down projections."""


def accumulation_error(a: torch.Tensor, b: torch.Tensor, *, fast: bool) -> float:
    """a [N, I] @ b [J, I]^T through rowwise e4m3 on the device: the largest |error| / sum |terms|."""
    a_q, a_s = nla_core.quantize_rowwise(a)
    b_q, b_s = nla_core.quantize_rowwise(b)
    y = torch._scaled_mm(a_q, b_q.t(), scale_a=a_s, scale_b=b_s.t(), out_dtype=torch.bfloat16, use_fast_accum=fast)
    ea, eb = a_q.double() * a_s.double(), b_q.double() * b_s.double()
    ref, terms = ea @ eb.T, ea.abs() @ eb.abs().T
    beyond_rounding = ((y.double() - ref).abs() - 2**-8 * ref.abs()).clamp(min=0)
    return float((beyond_rounding / terms).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (torch's CPU kernel sums in float32)")
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    cases = []
    for k, m in WIDTHS:
        w = (torch.randn(m, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
        x = torch.randn(args.rows, k, device=device, generator=gen).to(torch.bfloat16)
        g = torch.randn(args.rows, m, device=device, generator=gen).to(torch.bfloat16)
        for fast in (False, True):
            for name, a, b, inner in (("forward", x, w, k), ("input_gradient", g, w.t(), m)):
                err = accumulation_error(a, b, fast=fast)
                cases.append({"k": k, "m": m, "product": name, "inner": inner, "fast_accum": fast,
                              "max_err_over_abs_terms": err})
                print(f"K {k:5d} M {m:5d} {name:14s} inner {inner:5d} fast_accum {fast!s:5s}: "
                      f"max |err| / sum|terms| = {err:.3e}", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(args.out).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": args.rows, "cases": cases},
                                         indent=1))


if __name__ == "__main__":
    main()
