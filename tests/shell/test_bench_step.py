"""bench/bench_step.py's stand-in explanations: what a random model's rollout gives the AR to read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench")]

import bench_step  # noqa: E402
import synthetic  # noqa: E402

from nla_shell.engines.base import Rollout  # noqa: E402


@pytest.fixture(scope="module")
def toy_tokenizer():
    return synthetic.toy_tokenizer()[0]


def _rollout(generated: list[int], prompt_len: int = 5) -> Rollout:
    ids = torch.tensor([7] * prompt_len + generated)
    return Rollout(full_ids=ids, prompt_len=prompt_len, behavior_logp=torch.zeros(len(generated)), text="",
                   prompt_index=0)


@settings(max_examples=25, deadline=None)
@given(generated=st.lists(st.integers(0, 151_935), min_size=1, max_size=160))
def test_stand_in_reads_as_the_generated_length(toy_tokenizer, generated):
    """A real explanation is part of the response: its stand-in feeds the AR as many tokens, not more."""
    text = bench_step.stand_in_explanation(toy_tokenizer, _rollout(generated))
    assert len(toy_tokenizer.encode(text, add_special_tokens=False)) == len(generated)


def test_stand_in_of_a_full_rollout_keeps_its_length(toy_tokenizer):
    """160 random ids (a random model's every rollout) read as 160 tokens, 165 with the AR's template,
    not the ~263 the plain decode of the folded ids re-encodes to (the benchmark's stand-in before)."""
    generated = torch.randint(0, 151_936, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = toy_tokenizer.decode([3 + g % (len(toy_tokenizer) - 3) for g in generated])
    assert len(toy_tokenizer.encode(plain, add_special_tokens=False)) > 200
    text = bench_step.stand_in_explanation(toy_tokenizer, _rollout(generated))
    assert len(toy_tokenizer.encode("Text: " + text, add_special_tokens=False)) == 165
