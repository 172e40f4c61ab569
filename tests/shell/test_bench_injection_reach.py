"""bench/injection_reach.py: its cached-prefix features equal a whole forward, and its ridge read-back tells signal from
noise."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import injection_reach  # noqa: E402

from nla_shell.models import Injector  # noqa: E402

MARKER, LEFT, RIGHT = 7, 5, 9
PROMPT = [1, 3, 4, LEFT, MARKER, RIGHT, 11, 12, 2]


def _tiny_llama() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64)
    return tf.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(("style", "norm", "block"), [("residual_add", None, 0), ("residual_add", None, 1),
                                                      ("residual_add", None, 2), ("embedding_replace", 4.0, 1)])
def test_features_from_the_cached_prefix_equal_a_whole_forward_with_the_injection(style, norm, block):
    model = _tiny_llama()
    injector = Injector(model, marker_id=MARKER, left_id=LEFT, right_id=RIGHT, style=style, injection_norm=norm,
                        layer_index=block)
    vectors = np.random.default_rng(0).normal(size=(5, 32)).astype(np.float32) * 3
    got = injection_reach.features(model, injector, PROMPT, PROMPT.index(MARKER), vectors, batch=2)
    ids = torch.tensor([PROMPT] * len(vectors))
    with torch.no_grad(), injector.inject(ids, torch.from_numpy(vectors)):
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    np.testing.assert_allclose(got["marker"], hidden[:, PROMPT.index(MARKER)].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["last"], hidden[:, -1].numpy(), rtol=1e-4, atol=1e-5)
    # another row's vector gives other features at the marker, and at the last position unless the vector is added
    # after the last attention (the last block's output reaches no other position)
    assert not np.allclose(got["marker"][0], got["marker"][1], atol=1e-3)
    assert np.allclose(got["last"][0], got["last"][1], atol=1e-3) == (block == 2)


def test_ridge_read_back_is_near_one_for_a_linear_map_and_near_zero_for_noise():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 16))
    mixed = x @ rng.normal(size=(16, 8)) + 0.01 * rng.normal(size=(2000, 8))
    noise = rng.normal(size=(2000, 8))
    assert injection_reach.ridge_fve(x[:1500], mixed[:1500], x[1500:], mixed[1500:])["fve"] > 0.99
    assert abs(injection_reach.ridge_fve(x[:1500], noise[:1500], x[1500:], noise[1500:])["fve"]) < 0.03
