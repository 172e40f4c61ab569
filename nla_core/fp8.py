"""Rowwise-scaled FP8 (e4m3) matrix products through `torch._scaled_mm` (cuBLASLt on Hopper).

Shapes: N rows of input, K input features, M output features. Both operands of x @ w.T are
quantised along K, one float32 scale per row:

    s_i = max(amax_k |x_ik|, AMAX_FLOOR) / E4M3_MAX,    q_ik = e4m3(clamp(x_ik / s_i, +-E4M3_MAX)),
    x_ik ~= q_ik * s_i,

so a row's largest entry lands on e4m3's largest finite value (448) and every row uses the whole
range. Rounding to e4m3 (3 mantissa bits, round to nearest even) gives, per element,

    |x_ik - q_ik s_i| <= u |x_ik| + v s_i,    u = 2^-4 + 2^-23,  v = 2^-10,

u being half of e4m3's relative spacing 2^-3 (plus the float32 division's rounding) and v half
of its subnormal spacing 2^-9 (values below 2^-6 in scaled units). The product
    y_ij = s_i t_j sum_k q_ik r_jk       (w ~= r t, quantised the same way)
is formed exactly in fp8 x fp8 and accumulated by the kernel, then rounded to out_dtype. The CPU's
kernel sums in float32; the H200's is off by up to about 3e-5 of sum_k |q_ik s_i r_jk t_j| with fast
accumulation off, about 4e-4 with it on (`fast_accum=True`: the tensor cores' partial sums are not promoted
to float32 along K; run AC, bench/RESULTS.md "The device's FP8 accumulation"): more than float32's, and both
far below FP8's own rounding (about 2^-3 of the same sum at worst). The CPU ignores `fast_accum`.

Non-finite inputs are propagated, not rejected (a check would need a device synchronisation):
a NaN or inf in x's row i makes s_i or q_i NaN, so row i of the output is NaN; likewise a
non-finite weight row j makes column j NaN.
"""

from __future__ import annotations

import torch

from nla_core._checks import require_floating, require_ndim, require_tensor

__all__ = ["E4M3_MAX", "AMAX_FLOOR", "FP8_DTYPE", "quantize_rowwise", "fp8_linear", "fp8_linear_ste"]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)
"""448: e4m3fn's largest finite value, where each row's largest entry is scaled to."""
AMAX_FLOOR = 1e-12
"""The row amax is clamped to at least this before dividing (torchao's EPS), so an all-zero row
gets a positive scale (and quantises to zeros) instead of 0 / 0."""


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) with x ~= q * s: e4m3 values and one float32 scale per row (see the module docstring).

    s_i = max(amax_k |x_ik|, AMAX_FLOOR) / 448, q_ik = e4m3(clamp(x_ik / s_i, -448, 448)), the
    division in float32; |x_ik - q_ik s_i| <= (2^-4 + 2^-23) |x_ik| + 2^-10 s_i.

    Args: x: [N, K] floating (fp16 / bf16 / fp32 / fp64).
    Returns: q [N, K] float8_e4m3fn (contiguous), s [N, 1] float32. A row holding NaN or inf
      gets a NaN scale or NaN entries.
    """
    require_floating("x", x)
    require_ndim("x", x, 2, "[N, K]")
    if x.dtype == FP8_DTYPE:
        raise ValueError("x is already float8_e4m3fn; quantize_rowwise takes the high-precision tensor")
    # AMAX_FLOOR and E4M3_MAX written out: under torch.compile(dynamic=True) dynamo makes a module-level
    # float a graph input, which it cannot pass into an autograd.Function's forward (fp8_linear_ste's).
    e4m3_max = torch.finfo(FP8_DTYPE).max
    with torch.no_grad():
        x32 = x.float()
        scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / e4m3_max
        # The clamp only catches the division's rounding just past 448 (clamp keeps NaN).
        q = (x32 / scale).clamp(-e4m3_max, e4m3_max).to(FP8_DTYPE).contiguous()
    return q, scale


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """y = x @ w.T (+ bias) with w held as `quantize_rowwise(w)` and x quantised per row here.

    y_ij = s_i t_j sum_k q_ik r_jk (+ b_j), (q, s) = quantize_rowwise(x), (r, t) = (w_fp8, w_scale),
    by `torch._scaled_mm(q, r.T, scale_a=s, scale_b=t.T, out_dtype)`; the bias is added after, in
    out_dtype. Error against the exact product: with e_ik = u|x_ik| + v s_i and f_jk = u|w_jk| + v t_j
    (u = 2^-4 + 2^-23, v = 2^-10), the element bounds of the module docstring,

        |y_ij - (x w^T)_ij| <= sum_k (e_ik |w_jk| + |x_ik| f_jk + e_ik f_jk)
                               + ulp_out/2 |y_ij| + K 2^-23 sum_k |q_ik s_i| |r_jk t_j|,

    the last two terms the output rounding (2^-8 relative for bf16, plus half the subnormal spacing
    for results that small) and float32 accumulation (the CPU's; the H200's accumulator errs more, see
    the module docstring). For
    entries that quantise as normal e4m3 values this is about (2u + u^2) sum_k |x_ik w_jk| ~= 2^-3
    of the absolute product: FP8 is for products whose sum, not each term, carries the signal.

    Shape rules of the device's kernel (on Hopper, K and M multiples of 16) are the caller's:
    this function checks shapes and dtypes only.

    Args:
      x: [..., K] floating (the activations; leading dims are flattened to N rows and restored).
      w_fp8: [M, K] float8_e4m3fn, w_scale: [M, 1] float32 (`quantize_rowwise` of the weight).
      bias: [M] or None.
      out_dtype: the result's dtype (torch.bfloat16 for rowwise scaling on Hopper).
      fast_accum: the kernel's fast accumulation (`_scaled_mm(use_fast_accum=True)`; see the module docstring).
    Returns: [..., M] out_dtype, no autograd graph (the quantisation is not differentiable).
    """
    require_floating("x", x)
    require_tensor("w_fp8", w_fp8)
    require_tensor("w_scale", w_scale)
    require_ndim("w_fp8", w_fp8, 2, "[M, K]")
    if w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"w_fp8 must be {FP8_DTYPE} (quantize_rowwise of the weight), got {w_fp8.dtype}")
    m, k = w_fp8.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} must be [..., K] with K = {k}, w_fp8's in-features {tuple(w_fp8.shape)}")
    if w_scale.shape != (m, 1) or w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be [M, 1] = [{m}, 1] float32, got {tuple(w_scale.shape)} {w_scale.dtype}")
    if bias is not None and bias.shape != (m,):
        raise ValueError(f"bias must be [M] = [{m}], got {tuple(bias.shape)}")
    if not out_dtype.is_floating_point or out_dtype == FP8_DTYPE:
        raise ValueError(f"out_dtype must be a high-precision floating dtype, got {out_dtype}")
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:  # _scaled_mm refuses an empty [0, 1] scale
        y = rows.new_zeros((0, m), dtype=out_dtype)
    else:
        x_fp8, x_scale = quantize_rowwise(rows)
        y = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=out_dtype,
                             use_fast_accum=fast_accum)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.reshape(*x.shape[:-1], m)


class _StraightThroughFP8Linear(torch.autograd.Function):
    """Forward: fp8_linear. Backward: the linear map's gradients, dL/dx in W's dtype or, given the
    transposed copy, by fp8_linear (see fp8_linear_ste)."""

    @staticmethod
    def forward(ctx, x, weight, w_fp8, w_scale, bias, out_dtype, wt_fp8, wt_scale, fast_accum, grad_fast_accum):
        trains = ctx.needs_input_grad[1]
        # A frozen weight needs only itself for dL/dx (no copy kept); a trained one also x, for dL/dW.
        ctx.save_for_backward(weight, x if trains else None, wt_fp8, wt_scale)
        ctx.x_dtype, ctx.out_dtype, ctx.grad_fast_accum = x.dtype, out_dtype, grad_fast_accum
        return fp8_linear(x, w_fp8, w_scale, bias=bias, out_dtype=out_dtype, fast_accum=fast_accum)

    @staticmethod
    def backward(ctx, grad_y):
        weight, x, wt_fp8, wt_scale = ctx.saved_tensors
        g = grad_y.to(weight.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight if wt_fp8 is None
                      else fp8_linear(grad_y, wt_fp8, wt_scale, out_dtype=ctx.out_dtype,
                                      fast_accum=ctx.grad_fast_accum))
            grad_x = grad_x.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(weight.dtype)
        if ctx.needs_input_grad[4]:
            grad_b = g.reshape(-1, g.shape[-1]).sum(dim=0)
        return grad_x, grad_w, None, None, grad_b, None, None, None, None, None


def fp8_linear_ste(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype,
    wt_fp8: torch.Tensor | None = None,
    wt_scale: torch.Tensor | None = None,
    fast_accum: bool = False,
    grad_fast_accum: bool = False,
) -> torch.Tensor:
    """`fp8_linear` in the forward, differentiated as the linear map x W^T + b (straight-through).

    Forward: y = fp8_linear(x, w_fp8, w_scale, bias=bias, out_dtype=out_dtype), [..., M].
    Backward, with g = dL/dy rounded to W's dtype and N the rows of x flattened:
        dL/dx = g @ W                      [..., K], in x's dtype;
        dL/dW = g^T @ x  (summed over N)   [M, K], only when W requires grad (x is then kept for it);
        dL/db = sum_N g                    [M],    only when the bias requires grad;
    each a product in W's own dtype (float32 accumulation), nothing for the FP8 copy. So the backward
    adds no quantisation error: against the float64 product of the same operands, each entry is off
    by at most ulp/2 of itself plus (inner size) 2^-23 of the product of absolute values (ulp/2 =
    2^-8 in bf16, 2^-24 in float32, plus half the dtype's subnormal spacing for results that small).
    These are the exact gradients of the linear map at the FP8 forward's activations (the forward's
    rounding passed straight through, as quantised-forward training does). A frozen weight (a LoRA's
    base layer in the policy update) keeps no copy of x; a trained one (a co-trained AR's backbone)
    keeps x as nn.Linear does.

    FP8 backward (wt_fp8, wt_scale given: `quantize_rowwise(weight.T)`, W^T quantised per input feature):
        dL/dx = fp8_linear(dL/dy, wt_fp8, wt_scale, out_dtype=out_dtype)      [..., K], in x's dtype,
    the gradient's rows quantised along M, so dL/dx carries fp8_linear's error for the operands (g, W^T):
    about 2^-3 of sum_m |g_im W_mk| per entry. dL/dW and dL/db stay as above (the input gradient is
    the product a frozen layer's backward spends its time on). Costs another byte per weight.

    Args: x: [..., K] floating; weight: [M, K], the weight the FP8 copy was made from (trained or
      frozen); w_fp8, w_scale: `quantize_rowwise(weight)`; bias: [M] or None; out_dtype: as for fp8_linear;
      wt_fp8 [K, M] float8_e4m3fn, wt_scale [K, 1] float32: `quantize_rowwise(weight.T)`, both or neither.
      fast_accum: fp8_linear's, for the forward product.
      grad_fast_accum: fp8_linear's, for the FP8 input gradient's product (with wt_fp8). torchao's float8
        training keeps it off while the forward's is on (torchao/float8/config.py, Float8LinearConfig:
        gemm_config_output fast, gemm_config_grad_input not).
    Returns: [..., M] out_dtype, in the autograd graph of x, weight and bias.
    """
    require_floating("weight", weight)
    if weight.shape != w_fp8.shape:
        raise ValueError(f"weight {tuple(weight.shape)} and its FP8 copy w_fp8 {tuple(w_fp8.shape)} must match")
    if (wt_fp8 is None) != (wt_scale is None):
        raise ValueError("wt_fp8 and wt_scale come together (quantize_rowwise(weight.T)), or neither")
    if wt_fp8 is not None and wt_fp8.shape != weight.shape[::-1]:
        raise ValueError(f"wt_fp8 {tuple(wt_fp8.shape)} must be the transposed weight's [K, M] = "
                         f"{tuple(weight.shape[::-1])}")
    return _StraightThroughFP8Linear.apply(x, weight, w_fp8, w_scale, bias, out_dtype, wt_fp8, wt_scale, fast_accum,
                                           grad_fast_accum)
