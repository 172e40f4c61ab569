"""Issue 30's trainer keys: listed in `nla train --help`, checked, and each one reaching the loss it names.

Each run is `nla train` on the tiny hub-free Qwen3 (fixtures.train_argv) with nla_core's functions
wrapped to record what the trainer hands them.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

import fixtures
import nla_core
from nla_shell import cli
from nla_shell.io.config import ConfigError, load_dataclass
from nla_shell.training.config import TrainConfig
from nla_shell.training import sampling, scoring, setup as trainer_setup, step as step_module

NEW_KEYS = ("policy_loss", "aggregation", "advantage_scale", "token_mask", "dynamic_sampling",
            "dynamic_sampling_max_draws", "critic_rollouts", "critic_ema", "top_entropy_quantile")


def test_help_lists_every_new_key_with_its_meaning(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key in NEW_KEYS:
        assert f"--{key.replace('_', '-')}" in text, key
    for phrase in ("gspo", "cispo", "onpolicy", "seq_mean_token_sum_norm", "prompt_mean", "IcePop", "DAPO",
                   "best-rewarded", "moving average"):
        assert phrase in text, phrase


def test_defaults_are_todays():
    cfg = load_dataclass(TrainConfig, dict(av_ckpt="a", ar_ckpt="b", rl_parquet="c", save_dir="d"))
    assert (cfg.policy_loss, cfg.aggregation, cfg.advantage_scale, cfg.token_mask) == ("grpo", "sequence_mean", "std",
                                                                                       None)
    assert (cfg.dynamic_sampling, cfg.critic_rollouts, cfg.critic_ema) == (False, "all", None)


@pytest.mark.parametrize("overrides, key", [
    (["policy_loss=onpolicy"], "tis"),  # tis=ratio_cap caps a ratio onpolicy does not use
    (["token_mask=2,3"], "token_mask"),
    (["token_mask=0.5"], "token_mask"),
    (["critic_ema=0.9"], "critic_ema"),  # without train_critic
    (["critic_ema=1.5", "train_critic=true"], "critic_ema"),
    (["critic_rollouts=best"], "critic_rollouts"),
    (["dynamic_sampling_max_draws=-1"], "dynamic_sampling_max_draws"),
    (["clip_eps=1.5"], "clip_eps"),
    (["top_entropy_quantile=0"], "top_entropy_quantile"),
    (["top_entropy_quantile=1.5"], "top_entropy_quantile"),
    (["top_entropy_quantile=-0.2"], "top_entropy_quantile"),
])
def test_bad_values_are_refused_naming_the_key(overrides, key):
    base = dict(av_ckpt="a", ar_ckpt="b", rl_parquet="c", save_dir="d")
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_dataclass(TrainConfig, base, overrides)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_top_entropy_quantile_out_of_range_is_one_line_naming_the_key(value):
    base = dict(av_ckpt="a", ar_ckpt="b", rl_parquet="c", save_dir="d")
    with pytest.raises(ConfigError) as err:
        load_dataclass(TrainConfig, base, [f"top_entropy_quantile={value}"])
    message = str(err.value)
    assert "'top_entropy_quantile'" in message and "\n" not in message
    assert load_dataclass(TrainConfig, base, ["top_entropy_quantile=1"]).top_entropy_quantile == 1.0
    assert load_dataclass(TrainConfig, base).top_entropy_quantile == 1.0


def test_cispo_may_drop_the_lower_clip():
    cfg = load_dataclass(TrainConfig, dict(av_ckpt="a", ar_ckpt="b", rl_parquet="c", save_dir="d"),
                         ["policy_loss=cispo", "clip_eps=1", "clip_eps_high=4", "tis_cap=5"])
    assert cfg.clip_eps == 1.0


@pytest.fixture
def loss_calls(monkeypatch):
    calls = []
    real = nla_core.policy_loss

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(nla_core, "policy_loss", recording)
    return calls


def run(nla_run_inputs, tmp_path, **overrides):
    settings = {"num_steps": 1, "eval_every": 0, **overrides}
    assert cli.main(fixtures.train_argv(nla_run_inputs, tmp_path / "run", **settings)) == 0
    return fixtures.read_metrics(tmp_path / "run")


def test_default_run_hands_the_loss_todays_keywords(nla_run_inputs, tmp_path, loss_calls):
    (line,) = run(nla_run_inputs, tmp_path)
    assert loss_calls
    for kw in loss_calls:
        assert kw["kind"] == "grpo" and kw["aggregation"] == "sequence_mean" and kw["token_mask"] is None
        assert kw["tis"] == "ratio_cap" and kw["max_len"] is None and kw["group_ids"] is None
        assert kw["denominator"] == 6  # N = 2 prompts x 3
    assert line["token_mask_frac"] == 0.0 and line["dynamic_sampling_draws"] == 0
    assert all(kw["keep"] is None for kw in loss_calls) and line["entropy_mask_frac"] == 0.0


def test_top_entropy_quantile_reaches_the_loss(nla_run_inputs, tmp_path, loss_calls):
    (line,) = run(nla_run_inputs, tmp_path, top_entropy_quantile=0.5, entropy_metric="false")
    assert loss_calls
    for kw in loss_calls:  # the entropy is computed for the mask even with entropy_metric off
        assert kw["keep"] is not None and kw["keep"].dtype == torch.bool
    assert 0.0 < line["entropy_mask_frac"] < 1.0 and line["entropy_mean"] is None  # NaN: not measured


def test_loss_keys_reach_the_loss(nla_run_inputs, tmp_path, loss_calls, capsys):
    (line,) = run(nla_run_inputs, tmp_path, policy_loss="gspo", aggregation="prompt_mean", token_mask="0.5,2",
                  tis="token_truncate")
    for kw in loss_calls:
        assert kw["kind"] == "gspo" and kw["aggregation"] == "prompt_mean" and kw["token_mask"] == (0.5, 2.0)
        assert kw["denominator"] == 2  # two prompt groups
        assert kw["group_ids"] is not None and kw["group_tokens"].shape == kw["group_ids"].shape
    assert 0.0 <= line["token_mask_frac"] <= 1.0
    assert "policy_loss=gspo with tis=" not in capsys.readouterr().out  # decoupled: the ratio is the trainer's


def test_gspo_against_the_engines_log_probs_is_said_at_start_up(nla_run_inputs, tmp_path, loss_calls, capsys):
    run(nla_run_inputs, tmp_path, policy_loss="gspo")
    assert all(kw["kind"] == "gspo" and kw["tis"] == "ratio_cap" for kw in loss_calls)
    assert "[train] policy_loss=gspo with tis=ratio_cap: the sequence ratio is taken against the engine's" \
        in capsys.readouterr().out


@pytest.mark.parametrize("policy, extra", [
    ("cispo", dict(clip_eps=1, clip_eps_high=4, tis_cap=5, aggregation="seq_mean_token_sum_norm")),
    ("onpolicy", dict(tis="none", kl_clamp=12)),
])
def test_cispo_and_onpolicy_runs(nla_run_inputs, tmp_path, loss_calls, policy, extra):
    (line,) = run(nla_run_inputs, tmp_path, policy_loss=policy, **extra)
    for kw in loss_calls:
        assert kw["kind"] == policy
        if policy == "cispo":
            assert kw["max_len"] == 10 and kw["clip_eps_high"] == 4.0  # max_len = max_new_tokens
        else:
            assert kw["tis"] is None and kw["kl_clamp"] == 12.0
    assert math.isfinite(line["loss"])


def test_advantage_scale_batch_reaches_the_advantages(nla_run_inputs, tmp_path, monkeypatch):
    scales = []
    real = nla_core.group_advantages

    def recording(*args, **kwargs):
        scales.append(kwargs.get("scale"))
        return real(*args, **kwargs)

    monkeypatch.setattr(nla_core, "group_advantages", recording)
    run(nla_run_inputs, tmp_path, advantage_scale="batch")
    assert scales == ["batch"]


def test_dynamic_sampling_draws_are_bounded_and_counted(nla_run_inputs, tmp_path, monkeypatch):
    # No group ever varies: every step draws its dynamic_sampling_max_draws extra batches, then trains on B groups.
    monkeypatch.setattr(nla_core, "group_has_variance", lambda rewards, group_ids: torch.zeros_like(rewards, dtype=torch.bool))
    sizes = []
    real = step_module.policy_update

    def recording(actor, injector, optimizer, rollouts, advantages, activations, **kw):
        sizes.append(len(rollouts))
        return real(actor, injector, optimizer, rollouts, advantages, activations, **kw)

    monkeypatch.setattr(step_module, "policy_update", recording)
    lines = run(nla_run_inputs, tmp_path, num_steps=2, dynamic_sampling="true", dynamic_sampling_max_draws=2)
    assert [line["dynamic_sampling_draws"] for line in lines] == [2, 2]
    assert [line["varied_groups"] for line in lines] == [0, 0]
    assert sizes == [6, 6]  # still batch_prompts x group_size samples


def test_dynamic_sampling_keeps_the_varied_groups():
    from nla_shell.engines.base import Rollout, RolloutRequest

    def draw(rewards_by_group):
        requests = [RolloutRequest((1,), torch.zeros(2)) for _ in rewards_by_group]
        rollouts, rewards = [], []
        for p, group in enumerate(rewards_by_group):
            for r in group:
                rollouts.append(Rollout(torch.tensor([1, 2]), 1, torch.zeros(1), f"{p}:{r}", p))
                rewards.append(r)
        reward = torch.tensor(rewards)
        scores = scoring.Scores(mse=reward, reward=reward, valid=torch.ones(len(rewards), dtype=torch.bool),
                                ar_inputs=[[1]] * len(rewards))
        shaped = scoring.ShapedRewards(scores=scores, reward=reward, truncated=torch.zeros(len(rewards), dtype=torch.bool),
                                       length_penalty=torch.zeros(len(rewards)))
        return sampling.Draw(requests, rollouts, shaped)

    first = draw([[1.0, 1.0], [0.0, 2.0]])  # group 1 varies
    second = draw([[3.0, 4.0], [5.0, 5.0]])  # group 0 varies
    assert sampling.varied_deficit([first], 2) == 1 and sampling.varied_deficit([first, second], 2) == 0
    kept = sampling.keep_varied_groups([first, second], 2)
    assert [r.text for r in kept.rollouts] == ["1:0.0", "1:2.0", "0:3.0", "0:4.0"]
    assert [r.prompt_index for r in kept.rollouts] == [0, 0, 1, 1]
    assert kept.shaped.reward.tolist() == [0.0, 2.0, 3.0, 4.0]
    # too few varied groups: the earliest constant ones fill the batch
    short = sampling.keep_varied_groups([first], 2)
    assert [r.text for r in short.rollouts] == ["1:0.0", "1:2.0", "0:1.0", "0:1.0"]
    # the redraws stop once enough groups vary, and never exceed their bound
    calls = []

    def again():
        calls.append(1)
        return second

    kept, n = sampling.redraw_until_varied(first, again, max_draws=5)
    assert n == 1 and len(calls) == 1 and [r.text for r in kept.rollouts][-2:] == ["0:3.0", "0:4.0"]
    constant = draw([[1.0, 1.0], [2.0, 2.0]])
    kept, n = sampling.redraw_until_varied(constant, lambda: constant, max_draws=3)
    assert n == 3 and [r.prompt_index for r in kept.rollouts] == [0, 0, 1, 1]
    assert sampling.redraw_until_varied(constant, again, max_draws=0)[1] == 0


def test_critic_rollouts_best_trains_on_one_pair_per_group(nla_run_inputs, tmp_path, monkeypatch):
    pairs = []
    real = step_module.critic_step

    def recording(critic, optimizer, ar_inputs, golds, **kw):
        pairs.append(len(ar_inputs))
        return real(critic, optimizer, ar_inputs, golds, **kw)

    monkeypatch.setattr(step_module, "critic_step", recording)
    run(nla_run_inputs, tmp_path, num_steps=2, train_critic="true", critic_rollouts="best")
    assert len(pairs) == 2 and all(n <= 2 for n in pairs)  # at most one per prompt group (B = 2)


def test_critic_ema_averages_the_trained_weights_and_is_checkpointed(nla_run_inputs, tmp_path):
    _, ar, _ = nla_run_inputs
    run(nla_run_inputs, tmp_path, train_critic="true", critic_ema=0.5, critic_lr=1e-2)
    step = tmp_path / "run" / "step_000001"
    ema = load_file(str(step / trainer_setup.CRITIC_EMA_FILE))
    before = load_file(str(ar / "value_head.safetensors"))["weight"]
    after = load_file(str(step / "critic" / "value_head.safetensors"))["weight"]
    assert not torch.equal(before, after)
    expected = 0.5 * before + 0.5 * after  # ema = decay * initial + (1 - decay) * stepped, after one step
    assert any(t.shape == expected.shape and torch.allclose(t, expected, rtol=1e-5, atol=1e-6) for t in ema.values())
    assert not any(t.shape == expected.shape and torch.equal(t, after) for t in ema.values())


def test_resume_is_exact_with_the_new_keys(nla_run_inputs, tmp_path):
    # The EMA is checkpointed and dynamic sampling's extra draws advance the saved data cursor.
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = dict(num_steps=4, eval_every=0, save_every=2, train_critic="true", critic_lr=1e-3, critic_ema=0.9,
                  critic_rollouts="best", dynamic_sampling="true", dynamic_sampling_max_draws=1,
                  policy_loss="cispo", aggregation="prompt_mean", advantage_scale="batch", token_mask="0.5,2")
    assert cli.main(fixtures.train_argv(nla_run_inputs, whole, **common)) == 0
    assert cli.main(fixtures.train_argv(nla_run_inputs, split, **{**common, "num_steps": 2})) == 0
    assert cli.main(fixtures.train_argv(nla_run_inputs, split, **common)) == 0
    timing = {"time_rollout", "time_score", "time_update", "time_critic", "time_sync", "time_step", "tokens_per_s",
              "peak_mem_gb"}
    strip = lambda lines: [{k: v for k, v in line.items() if k not in timing} for line in lines]  # noqa: E731
    assert strip(fixtures.read_metrics(whole)) == strip(fixtures.read_metrics(split))


def test_two_ranks_match_one_process_with_the_new_keys(nla_run_inputs, tmp_path, monkeypatch):
    # The batch advantage scale's std and prompt_mean's group count span ranks; the EMA and the
    # best pairs are the global batch's. (Dynamic sampling fills each rank's share on its own: not compared.)
    import sys

    import test_distributed as dist_tests

    common = dict(num_steps=2, save_every=1, batch_prompts=4, eval_every=0, advantage_scale="batch",
                  aggregation="prompt_mean", policy_loss="gspo", token_mask="0.5,2", critic_rollouts="best",
                  critic_ema=0.5)
    one, two = tmp_path / "one", tmp_path / "two"
    monkeypatch.setattr(trainer_setup, "make_engine", dist_tests.seeded_make_engine)
    assert cli.main(["train", *dist_tests._settings(nla_run_inputs, one, **common)]) == 0
    dist_tests._run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                         dist_tests.__file__, "train", *dist_tests._settings(nla_run_inputs, two, **common)])
    dist_tests._assert_metrics_close(dist_tests._metrics(two), dist_tests._metrics(one))
    for step in ("step_000001", "step_000002"):
        a = load_file(str(two / step / trainer_setup.CRITIC_EMA_FILE))
        b = load_file(str(one / step / trainer_setup.CRITIC_EMA_FILE))
        for name in b:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_a_run_saved_before_the_new_keys_resumes_at_their_defaults(tmp_path):
    import yaml

    from nla_shell.io.config import config_defaults, config_to_dict
    from nla_shell.training.run_identity import claim_save_dir

    base = dict(av_ckpt="a", ar_ckpt="b", rl_parquet="c", save_dir=str(tmp_path))
    now = config_to_dict(load_dataclass(TrainConfig, base))
    older = {k: v for k, v in now.items() if k not in NEW_KEYS}  # what yesterday's nla wrote
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(older, sort_keys=False))
    claim_save_dir(tmp_path, now, overwrite=False, resume="auto", defaults=config_defaults(TrainConfig))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(older, sort_keys=False))
    changed = config_to_dict(load_dataclass(TrainConfig, base, ["policy_loss=gspo"]))
    with pytest.raises(ConfigError, match="policy_loss: '<unset>' there, 'gspo' now"):
        claim_save_dir(tmp_path, changed, overwrite=False, resume="auto", defaults=config_defaults(TrainConfig))
