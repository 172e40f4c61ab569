"""Issue #13: every engine learns like the trainer.

Eval scores the current actor, rollouts stop on the whole eos list, an SFT adapter is
continued openly (or merged under a fresh LoRA), KL and the critic's grad norm are logged,
and EasyNLA's anti-runaway shaping is available.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

import fixtures
from nla_shell import cli
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.io.data import build_prompt_ids, load_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.stats import PairedShortfall
from nla_shell.models import (
    Injector, eos_token_ids, inner_lm, load_actor, load_generation_config, response_logprobs,
)
from nla_shell.toy import builders as toy
from nla_shell.training import setup as trainer_setup, train as train_module
from nla_shell.training.scoring import Scores, shape_rewards
from nla_shell.training.update import response_batch

CPU = torch.device("cpu")


def _train_args(inputs, save_dir: Path, **overrides) -> list[str]:
    """Two steps of 2 prompts x 2 at a high lr (the policy visibly moves), eval every step."""
    settings = dict(num_steps=2, group_size=2, max_new_tokens=8, lr=1e-2, logp_micro_batch=4, eval_every=1,
                    eval_n_prompts=2, save_every=10)
    return fixtures.train_argv(inputs, save_dir, **{**settings, **overrides})


def _actor_and_requests(av_dir: Path, parquet: Path, *, n: int = 3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(av_dir)
    cfg = load_sidecar(Path(str(parquet) + ".nla_meta.yaml"))
    torch.manual_seed(0)
    actor = load_actor(av_dir, lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=None,
                       dtype=torch.float32, device=CPU)
    injector = Injector(actor, marker_id=cfg.injection_token_id, left_id=cfg.injection_left_neighbor_id,
                        right_id=cfg.injection_right_neighbor_id)
    requests = [RolloutRequest(tuple(build_prompt_ids(r.prompt, cfg, tokenizer)), r.activation)
                for r in load_rows(parquet, cfg, max_rows=n)]
    return actor, injector, tokenizer, requests


def _logprobs(actor, injector, tokenizer, rollouts, activations) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of the rollouts' tokens under `actor`, and the response mask."""
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=CPU)
    with torch.no_grad(), injector.inject(batch.input_ids, activations):
        logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    return logp, batch.mask


# --------------------------------------------------------------------------- 2: the whole eos list


def test_hf_engine_stops_on_every_eos_of_the_generation_config(nla_run_inputs):
    av, _, parquet = nla_run_inputs
    actor, injector, tokenizer, requests = _actor_and_requests(av, parquet)
    eos = tokenizer.eos_token_id
    torch.manual_seed(3)
    free = HFRolloutEngine(actor, injector, tokenizer).generate(requests, group_size=3, max_new_tokens=10)
    sampled = Counter(t for r in free for t in r.full_ids[r.prompt_len :].tolist() if t != eos)
    extra = sampled.most_common(1)[0][0]
    # As Qwen3's generation_config lists <|endoftext|> beside <|im_end|>.
    inner_lm(actor).generation_config.eos_token_id = [eos, extra]
    engine = HFRolloutEngine(actor, injector, tokenizer)
    assert engine.eos_ids == (eos, extra)
    torch.manual_seed(3)
    ended = engine.generate(requests, group_size=3, max_new_tokens=10)
    stops = {eos, extra}
    for r in ended:
        gen = r.full_ids[r.prompt_len :].tolist()
        assert not stops & set(gen[:-1]), gen  # nothing is generated past a stop id
        assert len(gen) == 10 or gen[-1] in stops
        assert r.behavior_logp.numel() == len(gen)
    assert any(r.full_ids[-1] == extra for r in ended)


def test_eos_list_is_read_from_a_saved_checkpoint(tmp_path, tiny_tokenizer):
    # The vLLM engine reads it this way from the base model dir (vLLM itself is told to ignore it).
    model = toy.build_tiny_qwen3(tiny_tokenizer, hidden_size=16, num_layers=1, seed=0)
    directory = toy.save_av_checkpoint(model, tiny_tokenizer, tmp_path / "m")
    eos = tiny_tokenizer.eos_token_id
    assert eos_token_ids(load_generation_config(directory), tiny_tokenizer) == (eos,)
    model.generation_config.eos_token_id = [7, eos]
    model.generation_config.save_pretrained(directory)
    assert eos_token_ids(load_generation_config(directory), tiny_tokenizer) == (7, eos)
    (directory / "generation_config.json").unlink()  # falls back to config.json's eos
    assert eos_token_ids(load_generation_config(directory), tiny_tokenizer) == (eos,)


# --------------------------------------------------------------------------- 1: eval scores the current actor


class StaleCopyEngine:
    """An engine with its own copy of the actor, updated only by sync_weights (as vLLM's is)."""

    shares_actor_weights = False

    def __init__(self, actor, injector, tokenizer) -> None:
        self.copy = copy.deepcopy(actor)
        self.copy_injector = Injector(self.copy, marker_id=injector.marker_id, left_id=injector.left_id,
                                      right_id=injector.right_id, style=injector.style,
                                      injection_norm=injector.injection_norm, layer_index=injector.layer_index)
        self.inner = HFRolloutEngine(self.copy, self.copy_injector, tokenizer)
        self.syncs = 0

    def generate(self, requests, *, group_size, max_new_tokens, generator=None):
        return self.inner.generate(requests, group_size=group_size, max_new_tokens=max_new_tokens)

    def sync_weights(self, actor) -> float:
        self.copy.load_state_dict(actor.state_dict())
        self.syncs += 1
        return 0.0

    def close(self) -> None:
        pass


@pytest.mark.parametrize("sync_every", [0, 1, 3])
def test_eval_scores_the_current_actor_even_when_the_engine_copy_is_stale(nla_run_inputs, tmp_path, monkeypatch,
                                                                           sync_every):
    made, evaluated = {}, []

    def make_engine(cfg, actor, injector, tokenizer, *, eos_ids):
        made.update(engine=StaleCopyEngine(actor, injector, tokenizer), actor=actor, injector=injector,
                    tokenizer=tokenizer)
        return made["engine"]

    original_eval = train_module.evaluate_rows

    def recording_eval(engine, critic, tokenizer, rows, prompt_ids, **kwargs):
        requests = [RolloutRequest(tuple(ids), r.activation) for ids, r in zip(prompt_ids, rows)]
        rollouts = []

        class Recorder:
            shares_actor_weights = engine.shares_actor_weights

            def generate(self, *args, **kw):
                rollouts.extend(engine.generate(*args, **kw))
                return rollouts

        result = original_eval(Recorder(), critic, tokenizer, rows, prompt_ids, **kwargs)
        vectors = torch.stack([requests[r.prompt_index].activation for r in rollouts])
        actor, injector = made["actor"], made["injector"]
        was_training = actor.training
        actor.eval()
        current, mask = _logprobs(actor, injector, tokenizer, rollouts, vectors)
        stale, _ = _logprobs(made["engine"].copy, made["engine"].copy_injector, tokenizer, rollouts, vectors)
        actor.train(was_training)
        behavior = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=CPU).behavior_logp
        evaluated.append((engine is made["engine"], float((behavior - current)[mask].abs().max()),
                          float((stale - current)[mask].abs().max())))
        return result

    monkeypatch.setattr(trainer_setup, "make_engine", make_engine)
    monkeypatch.setattr(train_module, "evaluate_rows", recording_eval)
    assert cli.main(_train_args(nla_run_inputs, tmp_path / "run", vllm_sync_every=sync_every)) == 0
    # Two steps: the initial push, then one after each step whose number is a multiple of sync_every (0: never).
    assert len(evaluated) == 2 and made["engine"].syncs == 1 + (2 // sync_every if sync_every else 0)
    for used_engine, current_gap, stale_gap in evaluated:
        assert current_gap <= 1e-4  # the eval samples came from the actor after this step's update
        # The engine's copy is only used when it holds those weights; otherwise it is visibly stale.
        assert used_engine == (sync_every == 1)
        assert (stale_gap <= 1e-4) == (sync_every == 1)


# --------------------------------------------------------------------------- 3: SFT adapters


def test_continued_sft_adapter_is_announced_and_its_lora_keys_leave_the_run_identity(toy_sft, toy_datasets, tmp_path,
                                                                                  capsys):
    av, ar = toy_sft
    inputs = (av, ar, toy_datasets / "rl.parquet")
    common = dict(eval_every=0, max_rows=None)
    assert cli.main(_train_args(inputs, tmp_path / "run", num_steps=1, **common)) == 0
    out = capsys.readouterr().out
    assert "continuing the SFT adapter" in out and "lora_r/lora_alpha/use_rslora/lora_targets are unused" in out
    # The adapter keeps its own rank and modules: another lora_r or lora_targets is no different run, so it resumes.
    assert cli.main(_train_args(inputs, tmp_path / "run", num_steps=2, lora_r=16, lora_targets="q_proj",
                                **common)) == 0
    assert "[resume]" in capsys.readouterr().out
    assert [line["step"] for line in fixtures.read_metrics(tmp_path / "run")] == [0, 1]


def test_merged_sft_adapter_starts_from_the_sft_policy_with_a_fresh_lora(toy_sft, toy_datasets):
    av, _ = toy_sft
    sft_actor, injector, tokenizer, requests = _actor_and_requests(av, toy_datasets / "rl.parquet")
    rollouts = HFRolloutEngine(sft_actor, injector, tokenizer).generate(requests, group_size=2, max_new_tokens=6)
    vectors = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    sft_logp, mask = _logprobs(sft_actor, injector, tokenizer, rollouts, vectors)

    merged = load_actor(av, lora_r=8, lora_alpha=16, use_rslora=True, resume_adapter=None, dtype=torch.float32,
                        device=CPU, merge_sft_adapter=True)
    assert list(merged.peft_config) == ["default"] and merged.peft_config["default"].r == 8
    merged_injector = Injector(merged, marker_id=injector.marker_id, left_id=injector.left_id,
                               right_id=injector.right_id)
    merged_logp, _ = _logprobs(merged, merged_injector, tokenizer, rollouts, vectors)
    assert float((merged_logp - sft_logp)[mask].abs().max()) <= 1e-4  # zero-init LoRA B: the SFT policy
    with merged.disable_adapter():  # the KL reference is the merged SFT model too
        reference_logp, _ = _logprobs(merged, merged_injector, tokenizer, rollouts, vectors)
    assert float((reference_logp - sft_logp)[mask].abs().max()) <= 1e-4


# --------------------------------------------------------------------------- 4: KL and the critic's grad norm


def test_kl_is_measured_at_kl_beta_zero_and_the_critic_grad_norm_is_logged(nla_run_inputs, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(_train_args(nla_run_inputs, run, kl_beta=0, train_critic="true", critic_lr=1e-3,
                                eval_every=0)) == 0
    first, second = fixtures.read_metrics(run)
    assert first["kl_mean"] == 0.0  # a fresh LoRA (B = 0) is the reference policy
    assert second["kl_mean"] > 0.0  # after a step at lr 1e-2 the policies differ
    assert all(math.isfinite(line["critic_grad_norm"]) and line["critic_grad_norm"] > 0 for line in (first, second))
    for line in (first, second):
        assert 0.0 <= line["clip_frac"] <= line["outside_clip_frac"] <= 1.0
    skipped = tmp_path / "no_reference"
    assert "the reference pass is skipped" not in capsys.readouterr().out
    assert cli.main(_train_args(nla_run_inputs, skipped, kl_beta=0, kl_metric="false", num_steps=1,
                                eval_every=0)) == 0
    assert fixtures.read_metrics(skipped)[0]["kl_mean"] is None  # NaN in metrics.jsonl: not measured, not 0
    assert "[train] kl_beta=0, kl_metric=false: the reference pass is skipped" in capsys.readouterr().out


# --------------------------------------------------------------------------- anti-runaway shaping


def _rollout(generated: list[int]) -> Rollout:
    return Rollout(full_ids=torch.tensor([1, 2, *generated]), prompt_len=2, behavior_logp=torch.zeros(len(generated)),
                   text="", prompt_index=0)


def test_shaping_penalises_tokens_past_the_hinge_and_fails_truncated_rollouts():
    eos = (9, 8)
    rollouts = [_rollout([5] * 10), _rollout([5] * 9 + [8]), _rollout([5] * 7 + [9]), _rollout([5, 9])]
    scores = Scores(mse=torch.tensor([0.5, 0.25, 0.5, math.nan]), reward=torch.tensor([0.7, 1.4, 0.7, -2.0]),
                    valid=torch.tensor([True, True, True, False]), ar_inputs=[[3], [3], [3], None])
    plain = shape_rewards(scores, rollouts, max_new_tokens=10, eos_ids=eos, length_penalty=0.0, length_margin=4,
                          truncated_as_failed=False)
    assert plain.truncated.tolist() == [True, False, False, False]  # 10 tokens ending on eos 8 is not cut
    assert plain.scores is scores and torch.equal(plain.reward, scores.reward)
    shaped = shape_rewards(scores, rollouts, max_new_tokens=10, eos_ids=eos, length_penalty=0.1, length_margin=4,
                           truncated_as_failed=True)
    # hinge at 10 - 4 = 6 tokens: lengths 10, 10, 8, 2 -> 0.4, 0.4, 0.2, 0
    torch.testing.assert_close(shaped.length_penalty, torch.tensor([0.4, 0.4, 0.2, 0.0]))
    torch.testing.assert_close(shaped.reward, torch.tensor([-2.4, 1.0, 0.5, -2.0]))
    assert shaped.scores.valid.tolist() == [False, True, True, False] and math.isnan(shaped.scores.mse[0])
    assert shaped.scores.ar_inputs == scores.ar_inputs  # the critic still learns from the cut text (as EasyNLA)


def test_shaping_options_reach_the_logs(nla_run_inputs, tmp_path):
    run = tmp_path / "run"
    assert cli.main(_train_args(nla_run_inputs, run, num_steps=1, eval_every=0, max_new_tokens=4, length_penalty=0.5,
                                length_margin=2, truncated_as_failed="true")) == 0
    (line,) = fixtures.read_metrics(run)
    assert line["truncated_frac"] > 0 and line["length_penalty_mean"] > 0
    assert line["extraction_rate"] <= 1 - line["truncated_frac"]  # cut rollouts count as failed


# --------------------------------------------------------------------------- the GPU parity test's logic, on CPU


def test_parity_legs_run_in_parallel_lanes_on_cpu_and_their_logprobs_match_the_trainer_at_every_step(
        toy_sft, toy_datasets, tmp_path):
    import pyarrow.parquet as pq

    import parity

    av, ar = toy_sft
    rl = toy_datasets / "rl.parquet"
    inputs = parity.ParityInputs(av=av, ar=ar, rl_parquet=rl, eval_parquet=toy_datasets / "eval.parquet",
                                 rl_rows=pq.ParquetFile(rl).metadata.num_rows)
    legs = [("hf", 1), ("native", 1)]
    runs = parity.run_legs(inputs, tmp_path, legs, lanes=["", ""], dtypes={"hf": "float32", "native": "float32"},
                           steps=2, device="cpu", batch_prompts=2, group_size=2, max_new_tokens=6, eval_rows=8)
    assert [(r.engine, r.seed, r.gpu) for r in runs] == [("hf", 1, ""), ("native", 1, "")]
    for run in runs:
        assert len(run.logp_diff_mean) == len(run.logp_diff_max) == 2  # one record per step
        assert 0 <= run.worst_logp_diff_mean <= run.worst_logp_diff_max <= 1e-3
        # Scored by `nla eval` (NaN here: two SFT steps do not teach the toy AV to close its tags).
        leg = tmp_path / f"{run.engine}_seed1"
        summary = json.loads((leg / "eval" / "eval_summary.json").read_text())
        assert summary["n_rows"] == 8 and (summary["av/fve"] is None) == math.isnan(run.fve)
        assert (leg / "train.log").stat().st_size > 0 and (leg / "eval.log").exists()  # each leg's output, kept
    table = parity.format_table(runs)
    assert table.count("\n") == 3 and "| native |" in table
    parity.write_json(tmp_path / "parity.json", runs, settings={"steps": 2}, failures=["x"])
    written = json.loads((tmp_path / "parity.json").read_text())
    assert [leg["logp_diff_mean"] for leg in written["legs"]] == [list(r.logp_diff_mean) for r in runs]
    assert written["failures"] == ["x"] and written["complete"] and set(written["engines"]) == {"hf", "native"}
    back = parity.read_json(tmp_path / "parity.json")  # FVE NaN here: compared apart (NaN != NaN)
    assert [dataclasses.replace(r, fve=0.0) for r in back] == [dataclasses.replace(r, fve=0.0) for r in runs]
    assert all(a.fve == b.fve or math.isnan(a.fve) and math.isnan(b.fve) for a, b in zip(back, runs))


def _run(engine, seed, fve, gap=1e-5, steps=3):
    import parity

    return parity.ParityRun(engine=engine, seed=seed, fve=fve, logp_diff_mean=(gap,) * steps, logp_diff_max=(gap,) * steps)


TOLERANCE = {"hf": 1e-3, "native": 1e-3, "vllm": 0.05}


def test_parity_verdict_pairs_each_engine_with_hf_by_seed():
    import parity

    hf = [_run("hf", 1, 0.816), _run("hf", 2, 0.809), _run("hf", 3, 0.788)]
    # vLLM synced every 20 steps (issue #13's measurement, seeds 2 and 3): 0.022 and 0.017 below HF's
    # same seeds; even two seeds bound that loss below -0.01.
    stale = [_run("vllm", 2, 0.787), _run("vllm", 3, 0.771)]
    (failure,) = parity.parity_failures(hf + stale, logp_tolerance=TOLERANCE)
    assert failure.startswith("vllm: paired by seed, mean held-out FVE -0.0195") and "lower bound -0.0353" in failure
    # Synced every step (mean 0.812 against 0.804) but with a paired spread of 0.020: three seeds cannot
    # tell it from a one-point loss, and the line says how many could.
    on_policy = [_run("vllm", 2, 0.803, 0.02), _run("vllm", 3, 0.819, 0.02), _run("vllm", 1, 0.814, 0.02)]
    (unresolved,) = parity.parity_failures(hf + on_policy, logp_tolerance=TOLERANCE)
    paired = parity.paired_shortfall(hf + on_policy, "vllm", "hf")
    assert paired.n == 3 and math.isclose(paired.mean, (-0.002 - 0.006 + 0.031) / 3)
    assert f"{paired.seeds_needed()} seeds would resolve" in unresolved and paired.seeds_needed() > 3
    # A log-prob gap at a later step fails as a step-0 gap would.
    late = parity.ParityRun(engine="native", seed=1, fve=0.816, logp_diff_mean=(1e-6, 1e-6, 0.2), logp_diff_max=(1e-5,) * 3)
    (gap,) = parity.parity_failures(hf + [late, _run("native", 2, 0.809)], logp_tolerance=TOLERANCE)
    assert "native seed 1" in gap and "first at step 2 (worst 0.2)" in gap
    (lonely,) = parity.parity_failures(hf + [_run("native", 1, 0.81), _run("native", 7, 0.81)], logp_tolerance=TOLERANCE)
    assert lonely.startswith("native: 1 seed(s) shared with hf")  # seed 7 has no HF leg to pair with
    # Legs run apart from HF's: only their log-prob gaps are judged until the JSONs are combined.
    assert parity.parity_failures(stale, logp_tolerance=TOLERANCE, baseline=None) == []


def test_the_paired_rule_catches_a_one_point_loss_and_passes_equal_engines_given_enough_seeds():
    """Simulated legs: HF's FVE varies by seed (sd 0.015, shared by both engines of a seed), the paired
    difference by 0.004. A true loss of 0.01 fails in nearly every draw, at 4 seeds as at 12; equal
    engines pass at the seed count the rule asks for. The 9-seed hf/native measurement of
    bench/RESULTS.md (2026-11-30), paired: mean -0.0099, which the rule fails."""
    import random

    import parity

    def verdicts(true_difference: float, seeds: int, draws: int = 200) -> float:
        rng, passed = random.Random(0), 0
        for _ in range(draws):
            hf_fves = [0.79 + rng.gauss(0, 0.015) for _ in range(seeds)]
            runs = [_run("hf", s, f) for s, f in enumerate(hf_fves)]
            runs += [_run("native", s, f + true_difference + rng.gauss(0, 0.004)) for s, f in enumerate(hf_fves)]
            passed += parity.parity_failures(runs, logp_tolerance=TOLERANCE) == []
        return passed / draws

    assert verdicts(-0.010, 4) <= 0.06 and verdicts(-0.010, 12) <= 0.06  # a one-point loss is caught
    assert verdicts(-0.015, 4) <= 0.01
    needed = PairedShortfall(n=2, mean=0.0, sd=0.004).seeds_needed()
    assert 4 <= needed <= 8 and verdicts(0.0, needed) >= 0.9  # equal engines pass at that many seeds

    hf_fves = [0.795, 0.786, 0.784, 0.782, 0.783, 0.787, 0.780, 0.804, 0.800]
    native_fves = [0.799, 0.758, 0.771, 0.757, 0.784, 0.800, 0.777, 0.788, 0.778]
    runs = [_run("hf", s, f) for s, f in enumerate(hf_fves, 1)] + [_run("native", s, f) for s, f in enumerate(native_fves, 1)]
    (failure,) = parity.parity_failures(runs, logp_tolerance=TOLERANCE)
    assert failure.startswith("native: paired by seed, mean held-out FVE -0.0099")
