"""bench/bench_step.py: its stand-in explanations (what a random model's rollout gives the AR to read), and its
step being the trainer's."""

from __future__ import annotations

import math
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


def test_the_benchmarks_step_is_the_trainers(monkeypatch):
    """From the same state, the benchmark's step (its "after" path: the trainer's rollout, score and
    update phases on a synthetic RunState) and the trainer's `train_step` give the same numbers."""
    from nla_shell.training import step

    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--tiny", "--paths", "after"])
    args = bench_step.parse_args()
    args.new_tokens = 8

    def same_start():
        torch.manual_seed(0)
        ctx = bench_step.Context(args, torch.device("cpu"), torch.float32)
        requests = synthetic.make_requests(2, args.prompt_len, ctx.config.hidden_size, ctx.tokens,
                                           vocab=min(ctx.config.vocab_size, len(ctx.tokenizer)), seed=4)
        return ctx, requests

    ctx, requests = same_start()
    results, _ = bench_step.grpo_step(ctx, requests, 2, args, paths=["after"])
    bench = results["after"][1]
    ctx, requests = same_start()
    record = step.train_step(bench_step.trainer_state(ctx, requests, 2), 0)
    for key in ("loss", "grad_norm", "kl_mean", "clip_frac", "logp_diff_mean", "critic_loss", "critic_grad_norm"):
        assert bench[key] == record[key], key
    assert record["extraction_rate"] == 1.0  # every stand-in explanation was extracted and scored
    assert sum(bench["reward"]) / len(bench["reward"]) == pytest.approx(record["reward_mean"], rel=1e-12)


def test_the_fp8_path_runs_the_trainers_fp8_copies(monkeypatch, capsys):
    """after_fp8 is "after" with `nla train fp8=score,reference,update`'s copies: its numbers move off "after"'s
    (the KL reference, the policy and the co-trained AR read FP8 products); a phase it does not know is refused."""
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--tiny", "--paths", "after_fp8", "--fp8", "score,rollout"])
    with pytest.raises(SystemExit):
        bench_step.parse_args()
    assert "--fp8: config key 'fp8'" in capsys.readouterr().err  # nla train's own check and message
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--tiny", "--paths", "after_all_fp8_backward", "--fp8", "backward"])
    with pytest.raises(SystemExit):  # backward alone names no phase whose backward it could make FP8
        bench_step.parse_args()
    assert "name update or score beside it" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--tiny", "--paths", "after_fp8", "--fp8", ""])
    with pytest.raises(SystemExit):  # nla train's empty fp8 (no phase) is no FP8 path
        bench_step.parse_args()
    assert "an FP8 path needs a phase" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--tiny", "--paths", "after_all_fp8_backward", "--fp8",
                                      "update,backward"])
    assert bench_step.parse_args().fp8 == ("update", "backward")
    results = tiny_step(monkeypatch, ["after", "after_fp8"], prompts=2)
    after, fp8 = results["after"][1], results["after_fp8"][1]
    out = capsys.readouterr().out
    assert "[fp8] score: " in out and "[fp8] reference+update: " in out
    assert fp8["critic_loss"] != after["critic_loss"] and math.isfinite(fp8["critic_grad_norm"])
    assert fp8["kl_mean"] != after["kl_mean"] and fp8["reward"] != after["reward"]


def test_a_best_path_is_the_trainers_critic_rollouts_best(monkeypatch, capsys):
    """PATH+best is PATH with `critic_rollouts=best`: on the same rollouts its policy numbers are PATH's, its
    critic trains on one rollout a group (so its loss moves), and its score phase counts a no-grad AR forward
    over every rollout plus the critic's forward and backward over the best ones; --critic off refuses it."""
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--tiny", "--critic", "off", "--paths", "after+best"])
    with pytest.raises(SystemExit):
        bench_step.parse_args()
    assert "leave --critic on" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--tiny", "--paths", "before"])  # retired: its numbers are in RESULTS
    with pytest.raises(SystemExit):
        bench_step.parse_args()
    results = tiny_step(monkeypatch, ["after", "after+best"], prompts=3)
    (_, after, after_flops), (_, best, best_flops) = results["after"], results["after+best"]
    for key in ("loss", "grad_norm", "kl_mean", "reward"):
        assert best[key] == after[key], key
    assert best["critic_loss"] != after["critic_loss"] and best["critic_grad_norm"] > 0
    # all: one AR forward + backward (3 forwards) over 6 inputs; best: 1 forward over 6 + 3 over the 3 best.
    # The stand-ins all have the generated length, so each input costs the same.
    per_input = after_flops["score"] / (3 * 6)
    assert best_flops["score"] == pytest.approx(per_input * (6 + 3 * 3), rel=1e-9)
    assert best_flops["update"] == after_flops["update"]


def tiny_step(monkeypatch, paths: list[str], *, prompts: int) -> dict:
    """bench_step's grpo_step on the tiny models (critic on), `prompts` x 2, the given paths on the same rollouts."""
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--tiny", "--critic", "on", "--paths", ",".join(paths)])
    args = bench_step.parse_args()
    args.new_tokens = 8
    torch.manual_seed(0)
    ctx = bench_step.Context(args, torch.device("cpu"), torch.float32)
    requests = synthetic.make_requests(prompts, args.prompt_len, ctx.config.hidden_size, ctx.tokens,
                                       vocab=min(ctx.config.vocab_size, len(ctx.tokenizer)), seed=4)
    results, _ = bench_step.grpo_step(ctx, requests, 2, args, paths=paths)
    return results
