"""token_logprobs: log_softmax(logits in float32) gathered at the targets, chunked over tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nla_core import token_logprobs

FAST = settings(max_examples=30, deadline=None)


@st.composite
def logits_and_targets(draw, max_lead=2):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=max_lead)))
    t = draw(st.integers(1, 6))
    v = draw(st.integers(1, 33))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.1, 3.0, 30.0]))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*lead, t, v, generator=g) * spread
    targets = torch.randint(0, v, (*lead, t), generator=g)
    return logits, targets


def naive64(logits, targets):
    return torch.log_softmax(logits.double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------- hand-worked


def test_hand_worked_uniform_and_two_way():
    # uniform over 4 -> log(1/4); logits [0, log 3] -> p = [1/4, 3/4]
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, float(torch.log(torch.tensor(3.0))), -1e9, -1e9]])
    targets = torch.tensor([2, 1])
    out = token_logprobs(logits, targets)
    torch.testing.assert_close(out, torch.log(torch.tensor([0.25, 0.75])))


# ---------------------------------------------------------------- properties


@FAST
@given(logits_and_targets())
@example((torch.tensor([[1e4, -1e4, 0.0]]), torch.tensor([1])))  # extreme logits, T=1
@example((torch.zeros(1, 1), torch.tensor([0])))  # V=1: log 1 = 0
def test_equals_naive_float64(lt):
    logits, targets = lt
    out = token_logprobs(logits, targets)
    assert out.shape == targets.shape
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive64(logits, targets), rtol=1e-5, atol=1e-4)


@FAST
@given(logits_and_targets(), st.integers(1, 8))
def test_chunked_equals_unchunked(lt, chunk):
    logits, targets = lt
    a = token_logprobs(logits, targets)
    b = token_logprobs(logits, targets, chunk_size=chunk)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


@FAST
@given(logits_and_targets(), st.sampled_from([None, 1, 2, 5]))
def test_gradient_matches_float64(lt, chunk):
    # d/dlogits sum_t w_t log p(target_t) = w_t (onehot - softmax)
    logits, targets = lt
    w = torch.linspace(-1.0, 2.0, targets.numel()).reshape(targets.shape)
    x = logits.clone().requires_grad_(True)
    (token_logprobs(x, targets, chunk_size=chunk) * w).sum().backward()
    x64 = logits.double().requires_grad_(True)
    (naive64(x64, targets) * w.double()).sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.shape == logits.shape
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)


@FAST
@given(logits_and_targets(), st.sampled_from([None, 1, 3]))
def test_bfloat16_input_gives_float32_output(lt, chunk):
    logits, targets = lt
    lb = logits.to(torch.bfloat16)
    out = token_logprobs(lb, targets, chunk_size=chunk)
    assert out.dtype == torch.float32
    # computed in float32 from the bf16 values: compare to float64 on the same bf16 values
    torch.testing.assert_close(out.double(), naive64(lb.float(), targets), rtol=1e-5, atol=1e-4)
    x = lb.clone().requires_grad_(True)
    token_logprobs(x, targets, chunk_size=chunk).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


def test_chunk_boundaries_hand_picked():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 11, generator=g)
    targets = torch.randint(0, 11, (2, 7), generator=g)
    ref = naive64(logits, targets)
    for chunk in (1, 2, 3, 7, 14, 15, 1000):
        torch.testing.assert_close(token_logprobs(logits, targets, chunk_size=chunk).double(), ref, rtol=1e-5, atol=1e-5)


def test_input_not_modified():
    logits = torch.randn(3, 5)
    before = logits.clone()
    token_logprobs(logits, torch.tensor([0, 1, 4]), chunk_size=2)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- bad input


def test_target_shape_mismatch_names_shapes():
    with pytest.raises(ValueError) as ei:
        token_logprobs(torch.zeros(2, 7, 13), torch.zeros(2, 11, dtype=torch.long))
    msg = str(ei.value)
    assert "7" in msg and "11" in msg


def test_float_targets_rejected():
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(3, 5), torch.zeros(3))


def test_integer_logits_rejected():
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def test_non_contiguous_logits_as_sliced_from_a_model_output():
    # the usual call: logits[:, :-1] of a [B, S, V] output, targets = input_ids[:, 1:]
    g = torch.Generator().manual_seed(5)
    full = torch.randn(2, 6, 9, generator=g, requires_grad=True)
    ids = torch.randint(0, 9, (2, 6), generator=g)
    sliced = full[:, :-1]
    assert not sliced.is_contiguous()
    out = token_logprobs(sliced, ids[:, 1:], chunk_size=3)
    torch.testing.assert_close(out.double(), naive64(sliced.detach(), ids[:, 1:]), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    full64 = full.detach().double().requires_grad_(True)
    naive64(full64[:, :-1], ids[:, 1:]).sum().backward()
    torch.testing.assert_close(full.grad.double(), full64.grad, rtol=1e-5, atol=1e-6)
    assert (full.grad[:, -1] == 0).all()


def test_minus_inf_logits_off_target():
    # vocab entries masked with -inf (padded vocabularies) are fine as long as the target is finite
    x = torch.tensor([[0.0, float("-inf"), 1.0], [2.0, 0.5, float("-inf")]], requires_grad=True)
    targets = torch.tensor([0, 1])
    out = token_logprobs(x, targets, chunk_size=1)
    x64 = x.detach().double().requires_grad_(True)
    ref = naive64(x64, targets)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    ref.sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-6)
