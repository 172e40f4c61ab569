"""token_logprobs_from_hidden: the fused lm_head + log-prob, with and without final-logit soft-capping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nla_core import ChunkKernels, chunk_logit_grads, chunk_logprobs, token_logprobs_from_hidden

FAST = settings(max_examples=25, deadline=None)


@st.composite
def hidden_weight_targets(draw):
    t, d, v = draw(st.integers(1, 6)), draw(st.integers(1, 8)), draw(st.integers(1, 33))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.sampled_from([0.1, 3.0, 30.0]))  # 30: logits far past a cap of 5
    hidden = torch.randn(2, t, d, generator=g, dtype=torch.float64) * spread
    weight = torch.randn(v, d, generator=g, dtype=torch.float64)
    return hidden, weight, torch.randint(0, v, (2, t), generator=g)


def reference64(hidden, weight, targets, softcap):
    logits = hidden.double() @ weight.double().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@FAST
@given(hidden_weight_targets(), st.sampled_from([None, 5.0, 30.0]), st.sampled_from([None, 1, 3]))
def test_values_and_gradients_match_float64_autograd(hwt, softcap, chunk):
    hidden, weight, targets = hwt
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = token_logprobs_from_hidden(h, w, targets, softcap=softcap, chunk_size=chunk)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference64(h_ref, w_ref, targets, softcap)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    upstream = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-9, atol=1e-9)


def test_softcap_changes_the_answer_when_logits_exceed_it():
    # logits [40, 0]: uncapped p(0) = 1 - e^-40; capped at 5 the gap is 5 tanh(8) ~ 5, p(1) ~ e^-5.
    hidden, weight, targets = torch.tensor([[1.0]]), torch.tensor([[40.0], [0.0]]), torch.tensor([1])
    plain = token_logprobs_from_hidden(hidden, weight, targets)
    capped = token_logprobs_from_hidden(hidden, weight, targets, softcap=5.0)
    torch.testing.assert_close(plain, torch.tensor([-40.0]), atol=1e-4, rtol=0)
    expected = -torch.log1p(torch.exp(torch.tensor(5.0 * torch.tanh(torch.tensor(8.0)).item())))
    torch.testing.assert_close(capped, expected.reshape(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("softcap", [0.0, -1.0])
def test_non_positive_softcap_rejected(softcap):
    with pytest.raises(ValueError, match="softcap"):
        token_logprobs_from_hidden(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long), softcap=softcap)


@FAST
@given(hidden_weight_targets(), st.sampled_from([None, 5.0, 30.0]))
def test_chunk_logit_grads_is_the_gradient_of_chunk_logprobs(hwt, softcap):
    """The hand-written chunk backward against autograd through the chunk forward, in float64;
    and the forward's log-sum-exp is the logits' own."""
    hidden, weight, targets = hwt
    logits = (hidden[0] @ weight.T).requires_grad_()
    logp, lse = chunk_logprobs(logits, targets[0], softcap)
    capped = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    torch.testing.assert_close(lse, torch.logsumexp(capped, -1), rtol=1e-12, atol=1e-12)
    grad = torch.linspace(-1, 1, logp.numel(), dtype=torch.float64)
    (expected,) = torch.autograd.grad((logp * grad).sum(), logits)
    got = chunk_logit_grads(logits.detach(), targets[0], lse.detach(), grad, softcap)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_the_given_chunk_kernels_do_the_arithmetic():
    """token_logprobs_from_hidden runs whatever ChunkKernels it is given, forward and backward
    (how the shell swaps in compiled copies); here copies that count their calls."""
    calls = {"logprobs": 0, "logit_grads": 0}

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)
        return run

    kernels = ChunkKernels(counted("logprobs", chunk_logprobs), counted("logit_grads", chunk_logit_grads))
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64)
    targets = torch.randint(0, 7, (5,))
    out = token_logprobs_from_hidden(hidden, weight, targets, chunk_size=2, kernels=kernels)
    out.sum().backward()
    assert calls == {"logprobs": 3, "logit_grads": 3}  # 5 rows in chunks of 2
    torch.testing.assert_close(out, reference64(hidden.detach(), weight, targets, None), rtol=1e-9, atol=1e-9)
