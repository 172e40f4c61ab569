"""splice_kl on a tiny LM: zero for the activation itself, growing with the error, the same in any batching."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nla_shell.models import pad_right
from nla_shell.pipeline.datagen import capture_activations
from nla_shell.pipeline.splice import splice_kl

LAYER = 1
TEXTS = ("The cat sat on the mat", "A dog ran", "Paris is the capital of France; Rome", "def add(a, b):")


@pytest.fixture(scope="module")
def lm_and_sites(tiny_av_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_av_dir, dtype=torch.float32).eval()
    contexts = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    ids, mask = pad_right(contexts, tiny_tokenizer.pad_token_id, torch.device("cpu"))
    acts = capture_activations(model, ids, mask, LAYER)
    # The residual at each context's last token, captured as datagen does (right padding, no splice).
    resid = torch.stack([acts[i, len(c) - 1] for i, c in enumerate(contexts)])
    return model, contexts, resid, tiny_tokenizer.pad_token_id


def test_splicing_the_activation_itself_changes_nothing(lm_and_sites):
    model, contexts, resid, pad_id = lm_and_sites
    out = splice_kl(model, contexts, {"same": resid}, layer=LAYER, pad_id=pad_id, micro_batch=3)
    torch.testing.assert_close(out.resid, resid, atol=1e-5, rtol=1e-5)  # left-padded + position ids = datagen's sites
    assert out.kl["same"].shape == (len(TEXTS),)
    assert float(out.kl["same"].abs().max()) < 1e-6


def test_splice_kl_grows_with_the_error_and_ignores_batching(lm_and_sites):
    model, contexts, resid, pad_id = lm_and_sites
    direction = torch.randn(resid.shape, generator=torch.Generator().manual_seed(0))
    direction = direction / direction.norm(dim=-1, keepdim=True) * resid.norm(dim=-1, keepdim=True)
    sizes = (0.03, 0.1, 0.3, 1.0)
    replacements = {f"{t}": resid + t * direction for t in sizes}
    out = splice_kl(model, contexts, replacements, layer=LAYER, pad_id=pad_id, micro_batch=len(TEXTS))
    kl = torch.stack([out.kl[f"{t}"] for t in sizes])  # [sizes, N]
    assert bool((kl > 1e-8).all())
    assert bool((kl[1:] > kl[:-1]).all()), kl  # every row's KL rises with the error's size
    one_by_one = splice_kl(model, contexts, replacements, layer=LAYER, pad_id=pad_id, micro_batch=1)
    for name in replacements:
        torch.testing.assert_close(one_by_one.kl[name], out.kl[name], rtol=1e-4, atol=1e-6)  # float32 sums of ~V terms


def test_replacements_must_have_one_row_per_context(lm_and_sites):
    model, contexts, resid, pad_id = lm_and_sites
    with pytest.raises(ValueError, match=r"replacement 'short' has shape \(2, 64\)"):
        splice_kl(model, contexts, {"short": resid[:2]}, layer=LAYER, pad_id=pad_id, micro_batch=2)
