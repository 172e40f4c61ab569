"""nla_core.fp8 on the GPU: the device's rowwise-scaled `_scaled_mm` takes the widths `fp8=` converts and
agrees with the float64 product of the same FP8 operands, and an FP8 swap of a bf16 module changes its
output by FP8's bound.

Skipped without a GPU of compute capability >= 9.0 (`nla_shell.models.fp8.MIN_CAPABILITY`). The CPU
suite checks the arithmetic against float64 (tests/core/test_fp8.py); this file checks what only the
device can say: that cuBLASLt accepts the shapes, strides and bf16 output the CPU path uses, and that its
sum of the exact fp8 x fp8 terms matches the float64 one to the output's rounding plus its accumulator's
error. (The reference is float64, not the CPU's `_scaled_mm`: torch 2.11's CPU kernel, the device image's,
takes per-tensor scales only; run Z, 2026-12-01.)

Both references take the device's own quantisation of the activations (or gradients), not the CPU's:
on CUDA, torch divides by a Python scalar as a product with its float32 reciprocal, so the scales amax / 448
can differ from the CPU's by an ulp and an element at a rounding tie lands on the other e4m3 value (19 of
40 row scales and 55 of 163,840 elements for the backward case's gradient, on the CPU, with the two
divisions). Run AC's first call (2026-12-02) quantised on the CPU, and the backward case failed at two widths
(an error of 0.035 against its bound of 0.019 at K = M = 4096).

The device's accumulator is not float32's either: run AC (bench/RESULTS.md, "The device's FP8 accumulation")
measured the largest error beyond the bf16 rounding at 6e-6 to 3.4e-5 of an entry's sum of absolute terms
with `_scaled_mm`'s fast accumulation off (what nla uses), and 2.8e-4 to 4.1e-4 with it on; the CPU's float32
sum gives about 1e-8. ACCUMULATION = 2^-13 (1.2e-4) sits between the two, so a kernel that accumulated as
fast mode does fails.
"""

from __future__ import annotations

import pytest
import torch

import nla_core
from nla_shell.models.fp8 import MIN_CAPABILITY, FP8Linears, fp8_matmuls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY,
                       reason="needs a GPU of compute capability >= 9.0"),
]

CUDA = torch.device("cuda")
ACCUMULATION = 2**-13
"""The device accumulator's error allowed, relative to an entry's sum of absolute terms (see above)."""
QWEN3_8B_WIDTHS = [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)]
"""(K, M) of the 8B shape's q/o, k/v, gate/up and down projections."""


@pytest.mark.parametrize("k, m", QWEN3_8B_WIDTHS)
def test_device_product_equals_the_exact_product_of_its_operands(k, m):
    gen = torch.Generator().manual_seed(k + m)
    x = torch.randn(3, 5, k, generator=gen).to(torch.bfloat16)  # leading dims flattened to 15 rows
    w = (torch.randn(m, k, generator=gen) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(m, generator=gen).to(torch.bfloat16)
    w_fp8, w_scale = nla_core.quantize_rowwise(w)
    x_fp8, x_scale = (t.cpu() for t in nla_core.quantize_rowwise(x.reshape(-1, k).to(CUDA)))  # as fp8_linear does
    ex, ew = x_fp8.double() * x_scale.double(), w_fp8.double() * w_scale.double()
    operands, terms = ex @ ew.T, ex.abs() @ ew.abs().T
    on_gpu = nla_core.fp8_linear(x.to(CUDA), w_fp8.to(CUDA), w_scale.to(CUDA), bias=bias.to(CUDA),
                                 out_dtype=torch.bfloat16).cpu()
    assert on_gpu.shape == (3, 5, m) and on_gpu.dtype == torch.bfloat16
    # The same fp8 operands and scales: only the device's accumulation and the bf16 roundings (the product's,
    # the bias's and the sum's) stand between the two.
    reference = operands + bias.double()
    err = (on_gpu.double().reshape(-1, m) - reference).abs()
    bound = 2 * 2**-8 * (operands.abs() + bias.double().abs()) + ACCUMULATION * terms + 2**-133
    assert bool((err <= bound).all()), float((err / bound).max())
    # And the product is FP8's approximation of the bf16 one (about 2^-3 of sum |x w| at most; far less typically).
    exact = x.float().reshape(-1, k) @ w.float().T + bias.float()
    rel = (on_gpu.float().reshape(-1, m) - exact).norm() / exact.norm()
    assert float(rel) < 0.05


def test_fp8_swap_of_a_bf16_mlp_on_the_device():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    mlp = mlp.to(CUDA, torch.bfloat16).requires_grad_(False)
    x = torch.randn(64, 256, device=CUDA, dtype=torch.bfloat16)
    copies = FP8Linears(mlp, label="test")
    assert len(copies.layers) == 2 and copies.total == 2
    with torch.no_grad():
        ref = mlp(x).float()
        with fp8_matmuls(copies):
            got = mlp(x).float()
        back = mlp(x).float()
    assert torch.equal(back, ref)  # the eager forwards are back after the block
    rel = (got - ref).norm() / ref.norm()
    assert 0 < float(rel) < 0.1


@pytest.mark.parametrize("k, m", QWEN3_8B_WIDTHS)
def test_the_fp8_backward_input_gradient_on_the_device(k, m):
    """fp8=...,backward: dL/dx from the transposed copy (W^T quantised per input feature) is the device's FP8
    product of the gradient and W^T, and FP8's approximation of the bf16 g @ W."""
    gen = torch.Generator().manual_seed(k * m)
    w = (torch.randn(m, k, generator=gen) / k**0.5).to(torch.bfloat16)
    g = torch.randn(40, m, generator=gen).to(torch.bfloat16)
    w_fp8, w_scale = (t.to(CUDA) for t in nla_core.quantize_rowwise(w))
    wt_fp8, wt_scale = (t.to(CUDA) for t in nla_core.quantize_rowwise(w.t()))
    x = torch.randn(40, k, generator=gen).to(CUDA, torch.bfloat16).requires_grad_(True)
    y = nla_core.fp8_linear_ste(x, w.to(CUDA), w_fp8, w_scale, out_dtype=torch.bfloat16, wt_fp8=wt_fp8,
                                wt_scale=wt_scale)
    y.backward(g.to(CUDA))
    grad = x.grad.cpu()
    g_fp8, g_scale = (t.cpu() for t in nla_core.quantize_rowwise(g.to(CUDA)))  # the device's own rounding
    eg, ewt = g_fp8.double() * g_scale.double(), wt_fp8.cpu().double() * wt_scale.cpu().double()
    operands, terms = eg @ ewt.T, eg.abs() @ ewt.abs().T
    err = (grad.double() - operands).abs()
    bound = 2**-8 * operands.abs() + ACCUMULATION * terms + 2**-133  # one bf16 rounding, the accumulator
    assert bool((err <= bound).all()), float((err / bound).max())
    exact = g.float() @ w.float()
    assert float((grad.float() - exact).norm() / exact.norm()) < 0.05
