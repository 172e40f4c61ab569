"""denormalize_activation / random_at_same_error: the vectors splice-KL puts back into the LM."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nla_core import denormalize_activation, normalize_activation, random_at_same_error, reconstruction_mse

FAST = settings(max_examples=50, deadline=None)

shapes = st.tuples(st.integers(1, 5), st.integers(2, 12))
scales = st.sampled_from([None, 1.0, 8.0])


def _vectors(seed: int, shape: tuple[int, int], count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Norms from 0.1 to 100: residual streams are far from unit norm.
    return [torch.randn(shape, generator=g, dtype=torch.float64) * 10 ** (3 * torch.rand(shape[0], 1, generator=g,
            dtype=torch.float64) - 1) for _ in range(count)]


def test_hand_worked():
    gold = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # ||gold|| = 5
    u = torch.tensor([[0.0, 2.0]], dtype=torch.float64)  # normalised space, scale 2
    torch.testing.assert_close(denormalize_activation(u, gold, scale=2.0), torch.tensor([[0.0, 5.0]], dtype=torch.float64))
    torch.testing.assert_close(denormalize_activation(u, gold, scale=None), u)
    # A 90-degree error, rotated towards the only direction orthogonal to gold (the noise's).
    spliced = torch.tensor([[-4.0, 3.0]], dtype=torch.float64)
    noise = torch.tensor([[4.0, -3.0]], dtype=torch.float64)
    torch.testing.assert_close(random_at_same_error(gold, spliced, noise, scale=2.0), noise)
    # Raw errors: gold + ||spliced - gold|| * unit(noise) = (3, 4) + 5 * sqrt(2) * (0, 1).
    torch.testing.assert_close(random_at_same_error(gold, spliced, torch.tensor([[0.0, 7.0]], dtype=torch.float64),
                                                    scale=None), torch.tensor([[3.0, 4.0 + 50 ** 0.5]], dtype=torch.float64))


@FAST
@given(st.integers(0, 2**16), shapes, scales)
def test_denormalize_inverts_normalize_and_keeps_the_error(seed, shape, scale):
    gold, pred = _vectors(seed, shape, 2)
    torch.testing.assert_close(denormalize_activation(normalize_activation(gold, scale), gold, scale=scale), gold)
    spliced = denormalize_activation(normalize_activation(pred, scale), gold, scale=scale)
    # What reconstruction_mse sees of pred is unchanged by going back to gold's units. The MSE is
    # float32 inside and a small error is a difference of near-equal vectors, so its relative
    # rounding reaches ~2e-5 (seed 19007, shape (2, 2), scale 8: 1.8e-5): rtol 1e-4.
    torch.testing.assert_close(reconstruction_mse(spliced.double(), gold, scale=scale).double(),
                               reconstruction_mse(pred, gold, scale=scale).double(), rtol=1e-4, atol=1e-9)
    if scale is not None:
        torch.testing.assert_close(spliced.norm(dim=-1), gold.norm(dim=-1))


@FAST
@given(st.integers(0, 2**16), shapes, scales)
def test_random_reference_has_the_same_error_in_another_direction(seed, shape, scale):
    gold, pred, noise = _vectors(seed, shape, 3)
    spliced = denormalize_activation(normalize_activation(pred, scale), gold, scale=scale)
    rand = random_at_same_error(gold, spliced, noise, scale=scale)
    assert rand.dtype == torch.float64 and rand.shape == gold.shape
    mse = lambda x: reconstruction_mse(x, gold, scale=scale).double()  # noqa: E731 (float32 inside: loose rtol)
    torch.testing.assert_close(mse(rand), mse(spliced), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close((rand - gold).norm(dim=-1), (spliced - gold).norm(dim=-1))
    if scale is not None:
        torch.testing.assert_close(rand.norm(dim=-1), gold.norm(dim=-1))
    # The error's direction comes from the noise: along it (raw), or in the plane of gold and noise (sphere).
    big = (spliced - gold).norm(dim=-1) > 1e-6
    if scale is None:
        cos = torch.nn.functional.cosine_similarity(rand - gold, noise, dim=-1)
        torch.testing.assert_close(cos[big], torch.ones_like(cos[big]))
    else:
        basis, _ = torch.linalg.qr(torch.stack([gold, noise], dim=-1))  # [N, D, 2]
        off_plane = rand - (basis @ (basis.transpose(1, 2) @ rand.unsqueeze(-1))).squeeze(-1)
        torch.testing.assert_close(off_plane, torch.zeros_like(off_plane), atol=1e-8 * float(gold.norm()), rtol=0)


def test_zero_error_stays_at_gold_and_shapes_are_checked():
    gold = torch.randn(3, 6, dtype=torch.float64)
    for scale in (None, 2.0):
        torch.testing.assert_close(random_at_same_error(gold, gold, torch.randn(3, 6, dtype=torch.float64), scale=scale),
                                   gold)
    with pytest.raises(ValueError, match="shape"):
        denormalize_activation(torch.zeros(3, 5), torch.zeros(3, 6), scale=1.0)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        random_at_same_error(torch.zeros(6), torch.zeros(6), torch.zeros(6), scale=1.0)
