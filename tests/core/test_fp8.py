"""quantize_rowwise / fp8_linear: rowwise e4m3 quantisation and the scaled FP8 product, against float64.

Bounds (nla_core.fp8's docstring): per element |x - q s| <= u|x| + v s with u = 2^-4 + 2^-23 (half of
e4m3's relative spacing, plus the float32 division) and v = 2^-10 (half its subnormal spacing).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nla_core import AMAX_FLOOR, E4M3_MAX, FP8_DTYPE, fp8_linear, fp8_linear_ste, quantize_rowwise

FAST = settings(max_examples=60, deadline=None)
U = 2.0**-4 + 2.0**-23
V = 2.0**-10
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
SUBNORMAL_FLOOR = {dtype: HALF_ULP[dtype] * torch.finfo(dtype).tiny for dtype in HALF_ULP}
"""Half the spacing of each dtype's subnormals: the rounding floor where a result is that small."""

# Entries spread over many binades, with exact zeros and values that quantise as e4m3 subnormals.
entries = st.one_of(st.just(0.0), st.floats(-1e-3, 1e-3), st.floats(-1e3, 1e3)).map(float)


@st.composite
def matrices(draw, *, max_rows=6, max_cols=24, cols=None):
    rows = draw(st.integers(1, max_rows))
    cols = cols if cols is not None else draw(st.integers(1, max_cols))
    values = draw(st.lists(entries, min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(values, dtype=torch.float32).reshape(rows, cols)


@st.composite
def operands(draw):
    x = draw(matrices())
    w = draw(matrices(max_rows=8, cols=x.shape[1]))
    return x, w


def dequantised(x):
    q, s = quantize_rowwise(x)
    return q.double() * s.double(), s.double()


# ---------------------------------------------------------------- quantize_rowwise


@FAST
@given(matrices())
@example(torch.tensor([[448.0, 1e-30, 3e-3, -1.0], [0.0, 0.0, 0.0, 0.0]]))
def test_round_trip_error_is_within_half_an_e4m3_ulp(x):
    q, s = quantize_rowwise(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and s.shape == (x.shape[0], 1) and s.dtype == torch.float32
    assert bool((s > 0).all())
    err = (q.double() * s.double() - x.double()).abs()
    assert bool((err <= U * x.double().abs() + V * s.double()).all()), (err, x)


@FAST
@given(matrices())
def test_each_nonzero_row_spans_the_e4m3_range(x):
    q, _ = quantize_rowwise(x)
    nonzero = x.abs().amax(1) > 1e-12
    assert torch.equal(q.float().abs().amax(1)[nonzero], torch.full((int(nonzero.sum()),), E4M3_MAX))


def test_zero_rows_quantise_to_zeros_with_a_positive_scale():
    q, s = quantize_rowwise(torch.zeros(3, 16))
    assert torch.equal(q.float(), torch.zeros(3, 16)) and torch.equal(s, torch.full((3, 1), AMAX_FLOOR / E4M3_MAX))


# ---------------------------------------------------------------- fp8_linear


def product(xw, out_dtype):
    """(x, w, fp8_linear(x, quantize_rowwise(w))) for a drawn pair of operands."""
    x, w = xw
    q, s = quantize_rowwise(w)
    return x, w, fp8_linear(x, q, s, out_dtype=out_dtype)


@FAST
@given(operands(), st.sampled_from([torch.bfloat16, torch.float32]))
def test_product_is_the_dequantised_operands_product_to_output_rounding(xw, out_dtype):
    x, w, y = product(xw, out_dtype)
    assert y.dtype == out_dtype and y.shape == (x.shape[0], w.shape[0])
    xd, _ = dequantised(x)
    wd, _ = dequantised(w)
    exact = xd @ wd.T
    accumulation = x.shape[1] * 2.0**-23 * (xd.abs() @ wd.abs().T)
    err = (y.double() - exact).abs()
    assert bool((err <= HALF_ULP[out_dtype] * exact.abs() + accumulation + SUBNORMAL_FLOOR[out_dtype]).all()), err


def derived_bound(x, w, y, out_dtype):
    """fp8_linear's error bound (its docstring) for y = fp8_linear(x, quantize_rowwise(w)): quantisation of
    both operands, the output's rounding and float32 accumulation."""
    x64, w64 = x.double(), w.double()
    (xd, sx), (wd, sw) = dequantised(x), dequantised(w)
    e = U * x64.abs() + V * sx  # per-element quantisation bounds of x and w
    f = U * w64.abs() + V * sw
    quantisation = e @ w64.abs().T + x64.abs() @ f.T + e @ f.T
    rounding = HALF_ULP[out_dtype] * y.double().abs() + x.shape[1] * 2.0**-23 * (xd.abs() @ wd.abs().T)
    return quantisation + rounding + SUBNORMAL_FLOOR[out_dtype]


@FAST
@given(operands(), st.sampled_from([torch.bfloat16, torch.float32]))
def test_error_against_the_exact_product_is_within_the_derived_bound(xw, out_dtype):
    x, w, y = product(xw, out_dtype)
    err = (y.double() - x.double() @ w.double().T).abs()
    assert bool((err <= derived_bound(x, w, y, out_dtype)).all()), err


def test_the_derived_bound_is_nearly_reached():
    # Not vacuous: a = 1 + 0.999 * 2^-4 sits just under the midpoint of e4m3's 1 and 1.125 (scale 1,
    # set by the row's 448), so it rounds to 1, an error of ~0.94 of u |a| |w|.
    a = 1.0 + 0.999 * 2.0**-4
    x, w = torch.tensor([[448.0, a]]), torch.tensor([[0.0, 1.0]])
    q, s = quantize_rowwise(w)
    y = fp8_linear(x, q, s, out_dtype=torch.float32)
    bound = U * a + V * 1.0
    err = abs(y.item() - a)
    assert 0.9 * bound < err <= bound


def test_leading_dims_bias_and_empty_batches():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 32), torch.randn(16, 32), torch.randn(16)
    q, s = quantize_rowwise(w)
    y = fp8_linear(x, q, s, bias=b, out_dtype=torch.float32)
    flat = fp8_linear(x.reshape(6, 32), q, s, out_dtype=torch.float32) + b
    assert y.shape == (2, 3, 16) and torch.equal(y.reshape(6, 16), flat)
    assert fp8_linear(torch.zeros(0, 32), q, s, out_dtype=torch.bfloat16).shape == (0, 16)
    assert fp8_linear(torch.zeros(2, 0, 32), q, s, bias=b, out_dtype=torch.bfloat16).shape == (2, 0, 16)


def test_zero_rows_give_zero_outputs():
    torch.manual_seed(1)
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    x[2] = 0.0
    q, s = quantize_rowwise(w)
    y = fp8_linear(x, q, s, out_dtype=torch.bfloat16)
    assert torch.equal(y[2], torch.zeros(16, dtype=torch.bfloat16)) and bool(y[[0, 1, 3]].ne(0).any())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_entries_propagate_as_nan_rows_and_columns(bad):
    torch.manual_seed(2)
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    q, s = quantize_rowwise(w)
    clean = fp8_linear(x, q, s, out_dtype=torch.bfloat16)
    x[1, 5] = bad
    y = fp8_linear(x, q, s, out_dtype=torch.bfloat16)
    assert bool(y[1].isnan().all())
    assert torch.equal(y[[0, 2, 3]], clean[[0, 2, 3]])  # rows are quantised independently
    w[7, 3] = bad
    q, s = quantize_rowwise(w)
    y = fp8_linear(torch.randn(4, 32), q, s, out_dtype=torch.bfloat16)
    assert bool(y[:, 7].isnan().all()) and bool(y[:, [0, 1, 8, 15]].isfinite().all())


@pytest.mark.parametrize("change, match", [
    (dict(x=torch.randn(3, 31)), "K = 32"),
    (dict(x=torch.randint(0, 3, (3, 32))), "floating"),
    (dict(w_fp8=torch.randn(16, 32)), "float8_e4m3fn"),
    (dict(w_fp8=torch.zeros(2, 16, 32, dtype=FP8_DTYPE)), r"\[M, K\]"),
    (dict(w_scale=torch.ones(1, 16)), r"\[M, 1\]"),
    (dict(w_scale=torch.ones(16, 1, dtype=torch.float64)), "float32"),
    (dict(bias=torch.ones(15)), r"\[M\]"),
    (dict(out_dtype=FP8_DTYPE), "high-precision"),
])
def test_bad_arguments_are_refused_up_front(change, match):
    q, s = quantize_rowwise(torch.randn(16, 32))
    args = dict(x=torch.randn(3, 32), w_fp8=q, w_scale=s, bias=None, out_dtype=torch.bfloat16) | change
    with pytest.raises(ValueError, match=match):
        fp8_linear(args.pop("x"), args.pop("w_fp8"), args.pop("w_scale"), **args)


def test_quantize_refuses_other_layouts():
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_rowwise(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="already"):
        quantize_rowwise(torch.zeros(2, 4, dtype=FP8_DTYPE))


# ---------------------------------------------------------------- fp8_linear_ste (the trainer's FP8 layers)


def product_bound(exact, a, b, inner, dtype):
    """|computed - exact| of a product in `dtype` (float32 accumulation): its rounding and the summation's."""
    return HALF_ULP[dtype] * exact.abs() + inner * 2.0**-23 * (a.double().abs() @ b.double().abs()) + SUBNORMAL_FLOOR[dtype]


@FAST
@given(operands(), st.sampled_from([torch.bfloat16, torch.float32]), st.integers(0, 2**31 - 1))
def test_input_gradient_is_the_weights_product_to_its_rounding(xw, dtype, seed):
    x, w = (t.to(dtype) for t in xw)
    q, s = quantize_rowwise(w)
    x.requires_grad_(True)
    y = fp8_linear_ste(x, w, q, s, out_dtype=torch.bfloat16)
    assert torch.equal(y, fp8_linear(x.detach(), q, s, out_dtype=torch.bfloat16))  # the forward is fp8_linear's
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    y.backward(g)
    exact = g.to(dtype).double() @ w.double()
    assert x.grad.dtype == dtype
    assert bool(((x.grad.double() - exact).abs() <= product_bound(exact, g, w, w.shape[0], dtype)).all())


@FAST
@given(operands(), st.sampled_from([torch.bfloat16, torch.float32]), st.integers(0, 2**31 - 1))
def test_trained_weight_and_bias_get_the_linear_maps_gradients(xw, dtype, seed):
    x, w = (t.to(dtype) for t in xw)
    q, s = quantize_rowwise(w)
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).requires_grad_(True)
    w.requires_grad_(True)
    y = fp8_linear_ste(x, w, q, s, bias=bias, out_dtype=torch.bfloat16)
    g = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(g)
    gd = g.to(dtype)
    exact_w = gd.double().t() @ x.double()
    assert w.grad.dtype == dtype and x.grad is None
    assert bool(((w.grad.double() - exact_w).abs() <= product_bound(exact_w, gd.t(), x, x.shape[0], dtype)).all())
    exact_b = gd.double().sum(dim=0)
    b_bound = HALF_ULP[dtype] * exact_b.abs() + x.shape[0] * 2.0**-23 * gd.double().abs().sum(dim=0)
    assert bool(((bias.grad.double() - exact_b).abs() <= b_bound + SUBNORMAL_FLOOR[dtype]).all())


def test_frozen_weight_gets_no_gradient_and_keeps_no_input():
    w = torch.randn(16, 32)
    q, s = quantize_rowwise(w)
    x = torch.randn(3, 32, requires_grad=True)
    y = fp8_linear_ste(x, w, q, s, out_dtype=torch.float32)
    assert [t is None for t in y.grad_fn.saved_tensors] == [False, True, True, True]  # the weight, not x
    y.sum().backward()
    assert w.grad is None and x.grad is not None and bool(x.grad.ne(0).any())
    with pytest.raises(ValueError, match="must match"):
        fp8_linear_ste(x, torch.randn(16, 31), q, s, out_dtype=torch.float32)


@FAST
@given(operands(), st.integers(0, 2**31 - 1))
def test_the_fp8_backward_input_gradient_is_within_fp8_linears_bound_for_g_and_w_transposed(xw, seed):
    x, w = (t.to(torch.bfloat16) for t in xw)
    q, s = quantize_rowwise(w)
    qt, st_ = quantize_rowwise(w.t())
    assert qt.shape == (w.shape[1], w.shape[0]) and st_.shape == (w.shape[1], 1)
    x.requires_grad_(True)
    y = fp8_linear_ste(x, w, q, s, out_dtype=torch.bfloat16, wt_fp8=qt, wt_scale=st_)
    assert torch.equal(y, fp8_linear(x.detach(), q, s, out_dtype=torch.bfloat16))  # the forward is unchanged
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    y.backward(g)
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, fp8_linear(g, qt, st_, out_dtype=torch.bfloat16), rtol=0, atol=0)
    err = (x.grad.double() - g.double() @ w.double()).abs()
    assert bool((err <= derived_bound(g, w.t(), x.grad, torch.bfloat16)).all()), err


def test_the_fp8_backward_leaves_a_trained_weights_gradient_as_it_was():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=gen)
    x, g = torch.randn(5, 32, generator=gen), torch.randn(5, 16, generator=gen).bfloat16().float()
    q, s = quantize_rowwise(w)
    qt, st_ = quantize_rowwise(w.t())
    grads = []
    for transposed in ({}, {"wt_fp8": qt, "wt_scale": st_}):
        weight, inputs = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
        fp8_linear_ste(inputs, weight, q, s, out_dtype=torch.float32, **transposed).backward(g)
        grads.append((weight.grad, inputs.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    assert not torch.equal(grads[0][1], grads[1][1])  # the input's gradient is the FP8 product's
    with pytest.raises(ValueError, match="both|neither"):
        fp8_linear_ste(x, w, q, s, out_dtype=torch.float32, wt_fp8=qt)
    with pytest.raises(ValueError, match=r"\[K, M\]"):
        fp8_linear_ste(x, w, q, s, out_dtype=torch.float32, wt_fp8=q, wt_scale=s)


def test_fast_accumulation_is_asked_of_the_kernel_only_when_given(monkeypatch):
    """fast_accum is the forward product's `use_fast_accum`, grad_fast_accum the FP8 input gradient's, each only
    when given (the CPU's kernel ignores it: the products agree bit for bit)."""
    requested = []
    scaled_mm = torch._scaled_mm

    def recording(*args, use_fast_accum=False, **kwargs):
        requested.append(use_fast_accum)
        return scaled_mm(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    x, w = torch.randn(3, 32), torch.randn(16, 32)
    q, s = quantize_rowwise(w)
    qt, st_ = quantize_rowwise(w.t())
    outputs = []
    for fast, grad_fast in ((False, False), (True, False), (False, True), (True, True)):
        xg = x.clone().requires_grad_()
        y = fp8_linear_ste(xg, w, q, s, out_dtype=torch.float32, wt_fp8=qt, wt_scale=st_, fast_accum=fast,
                           grad_fast_accum=grad_fast)
        y.sum().backward()
        outputs.append((y.detach(), xg.grad))
        assert requested == [fast, grad_fast]
        requested.clear()
    assert all(torch.equal(a, b) for first, other in zip(outputs, outputs[1:]) for a, b in zip(first, other))
    fp8_linear(x, q, s, out_dtype=torch.float32)
    assert requested == [False]
