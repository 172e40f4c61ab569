"""The GRPO trainer end to end on a tiny hub-free Qwen3, through its public entry points."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import fixtures
import nla_core
from nla_shell import cli
from nla_shell.toy import builders as toy
from nla_shell.training.checkpoint import latest_checkpoint
from nla_shell.io.data import build_prompt_ids, load_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.io.logging import METRIC_KEYS
from nla_shell.models import VALUE_HEAD_FILE, ARModel, response_logprobs
from nla_shell.training import update as update_module
from nla_shell.training.update import LossOptions, policy_update, response_batch

TIMING_KEYS = {"time_rollout", "time_score", "time_update", "time_critic", "time_sync", "time_step",
               "tokens_per_s", "peak_mem_gb"}


def test_three_step_run_writes_metrics_checkpoint_and_summary(nla_run_inputs, tmp_path):
    save_dir = tmp_path / "run"
    assert cli.main(fixtures.train_argv(nla_run_inputs, save_dir)) == 0
    lines = fixtures.read_metrics(save_dir)
    assert [line["step"] for line in lines] == [0, 1, 2]
    vocab = json.loads((nla_run_inputs[0] / "config.json").read_text())["vocab_size"]
    for line in lines:
        assert set(METRIC_KEYS) <= set(line)
        assert 0 < line["entropy_mean"] < math.log(vocab)
    assert any(line["extraction_rate"] > 0 for line in lines), "the warm AV should extract sometimes"
    assert "eval/fve" in lines[0] and "eval/fve" in lines[2] and "eval/fve" not in lines[1]
    assert "eval/explanation_tokens_mean" in lines[0] and "eval/explanation_tokens_mean" not in lines[1]
    final = latest_checkpoint(save_dir)
    assert final is not None and final.name == "step_000003"
    assert (final / "adapter" / "adapter_config.json").exists()
    assert (final / "training_state.pt").exists()
    summary = json.loads((save_dir / "summary.json").read_text())
    assert summary["final"]["step"] == 2 and summary["baselines"]["rawvar"] > 0


def test_interrupted_then_resumed_run_logs_the_same_metrics(nla_run_inputs, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = dict(num_steps=4, train_critic="true", critic_lr=1e-3)
    assert cli.main(fixtures.train_argv(nla_run_inputs, whole, **common)) == 0
    assert cli.main(fixtures.train_argv(nla_run_inputs, split, **{**common, "num_steps": 2})) == 0
    assert cli.main(fixtures.train_argv(nla_run_inputs, split, **common)) == 0
    strip = lambda lines: [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]  # noqa: E731
    a, b = strip(fixtures.read_metrics(whole)), strip(fixtures.read_metrics(split))
    assert [line["step"] for line in b] == [0, 1, 2, 3]
    # The first half's final-step eval (step 1 is no eval step) ran on its own RNG: still exact.
    assert a == b
    final = json.loads((whole / "summary.json").read_text())["final_eval"]
    assert final["step"] == 3 and {"eval/fve", "eval/extraction_rate"} <= set(final)
    assert any(not math.isnan(line["critic_loss"] or math.nan) for line in a)
    # Every phase under its own key, measured: the critic's backward and step are not the score phase's.
    rawvar = json.loads((whole / "summary.json").read_text())["baselines"]["rawvar"]
    # The co-trained AR carries the baseline its fve_nrm divides by (nla eval reads it from the sidecar).
    for role in ("critic", "adapter"):
        meta = yaml.safe_load((latest_checkpoint(whole) / role / "nla_meta.yaml").read_text())
        assert meta["baselines"]["rawvar"] == pytest.approx(rawvar)
    for line in fixtures.read_metrics(whole):
        assert line["time_critic"] > 0 and line["time_score"] > 0
        phases = sum(line[k] for k in ("time_rollout", "time_score", "time_critic", "time_update", "time_sync"))
        assert phases <= line["time_step"] * 1.001
        # The reference's keys (its dashboards): spread of the scored samples' mse, FVE in percent, its baseline.
        if line["mse_mean"] is not None:
            assert line["mse_min"] <= line["mse_mean"] <= line["mse_max"] and line["mse_std"] >= 0
            assert line["fve_pct"] == pytest.approx(100 * line["fve"]) and line["fve_baseline"] == rawvar
        if "eval/fve" in line and line["eval/fve"] is not None:
            assert line["eval/fve_pct"] == pytest.approx(100 * line["eval/fve"])
            assert line["eval/mse_mean_valid"] == line["eval/mse_mean"]
            assert line["eval/reward_mean_valid"] >= line["eval/reward_mean"]  # failures score -2, the floor


def test_auto_micro_batches_are_printed_saved_and_kept_on_resume(nla_run_inputs, tmp_path, capsys, monkeypatch):
    """logp_micro_batch / ref_micro_batch unset (auto): on a CPU the reference's 2 and 4 x 2, printed and written
    to config.yaml; a run resumed with them unset keeps the numbers its checkpoint recorded, so it logs exactly
    what the uninterrupted run logged."""
    import yaml

    from nla_shell.training import step as step_module

    used = []
    update = step_module.policy_update
    monkeypatch.setattr(step_module, "policy_update", lambda *a, **k: (
        used.append((k["micro_batch"], k["reference_micro_batch"])), update(*a, **k))[1])
    fresh = tmp_path / "fresh"
    assert cli.main(fixtures.train_argv(nla_run_inputs, fresh, num_steps=1, logp_micro_batch="auto", eval_every=0)) == 0
    out = capsys.readouterr().out
    assert "[memory] logp_micro_batch=auto -> 2, ref_micro_batch=auto -> 8 (the reference's, on a CPU)" in out
    assert "done: 1 step;" in out
    saved = yaml.safe_load((fresh / "config.yaml").read_text())
    assert (saved["logp_micro_batch"], saved["ref_micro_batch"], used) == (2, 8, [(2, 8)])

    whole, split = tmp_path / "whole", tmp_path / "split"
    explicit = dict(num_steps=3, logp_micro_batch=4, ref_micro_batch=3, eval_every=0, save_every=1)
    assert cli.main(fixtures.train_argv(nla_run_inputs, whole, **explicit)) == 0
    assert cli.main(fixtures.train_argv(nla_run_inputs, split, **{**explicit, "num_steps": 2})) == 0
    capsys.readouterr()
    assert cli.main(fixtures.train_argv(nla_run_inputs, split, num_steps=3, logp_micro_batch="auto", eval_every=0,
                                        save_every=1)) == 0
    assert "logp_micro_batch=auto -> 4, ref_micro_batch=auto -> 3 (recorded by the run resumed)" in capsys.readouterr().out
    assert used[1:] == [(4, 3)] * 6
    strip = lambda lines: [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]  # noqa: E731
    assert strip(fixtures.read_metrics(whole)) == strip(fixtures.read_metrics(split))
    saved = yaml.safe_load((split / "config.yaml").read_text())
    assert (saved["logp_micro_batch"], saved["ref_micro_batch"]) == (4, 3)


def test_auto_fits_the_largest_power_of_two_in_half_the_free_memory():
    from types import SimpleNamespace

    from nla_shell.training.config import TrainConfig
    from nla_shell.training.memory import resolve_micro_batches, sequence_bytes

    cfg = TrainConfig(av_ckpt="a", ar_ckpt="b", rl_parquet="r.parquet", save_dir="s")
    qwen3_8b = SimpleNamespace(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    smol_135m = SimpleNamespace(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                                num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    gib = 2**30

    def chosen(model, free, **keys):
        resolved, _ = resolve_micro_batches(
            TrainConfig(**{**vars(cfg), **keys}) if keys else cfg, model, free_bytes=free, tokens=256, dtype_bytes=2)
        return resolved.logp_micro_batch, resolved.ref_micro_batch

    assert chosen(smol_135m, 100 * gib) == (64, 64)  # the 135M model on an H200: the cap
    train, ref = chosen(qwen3_8b, 60 * gib)
    per_sequence = sequence_bytes(qwen3_8b, 256, grad=True, dtype_bytes=2, lora_bytes=4)
    assert train * per_sequence <= 30 * gib < 2 * train * per_sequence and train & (train - 1) == 0
    assert ref > train  # no autograd state to keep
    assert chosen(qwen3_8b, gib)[0] == 1 and chosen(qwen3_8b, 2**20) == (1, 1)  # never 0
    assert chosen(qwen3_8b, 60 * gib, gradient_checkpointing=True)[0] > train
    assert chosen(qwen3_8b, 60 * gib, logp_micro_batch=5) == (5, ref)  # a number is kept


def _tiny_batch(nla_run_inputs, *, n_prompts: int, group_size: int, seed: int = 0):
    av, _, parquet = nla_run_inputs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(av)
    cfg = load_sidecar(Path(str(parquet) + ".nla_meta.yaml"))
    actor, injector = fixtures.lora_actor(av, cfg, seed=seed)
    rows = load_rows(parquet, cfg, max_rows=n_prompts)
    requests = [RolloutRequest(tuple(build_prompt_ids(r.prompt, cfg, tokenizer)), r.activation) for r in rows]
    engine = HFRolloutEngine(actor, injector, tokenizer)
    rollouts = engine.generate(requests, group_size=group_size, max_new_tokens=8)
    acts = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    return actor, injector, tokenizer, rollouts, acts


def test_hf_engine_behaviour_logprobs_equal_the_training_forward(nla_run_inputs):
    actor, injector, tokenizer, rollouts, acts = _tiny_batch(nla_run_inputs, n_prompts=3, group_size=2)
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2]
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad(), injector.inject(batch.input_ids, acts):
        logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    diff = (logp - batch.behavior_logp)[batch.mask].abs()
    assert diff.numel() > 0 and float(diff.max()) <= 1e-4
    # The injected vector reaches the generated tokens: another vector, other log-probs.
    with torch.no_grad(), injector.inject(batch.input_ids, acts.flip(0)):
        other = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    assert float((other - logp)[batch.mask].abs().max()) > 1e-3


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_micro_batched_gradient_equals_full_batch_gradient(nla_run_inputs, aggregation):
    actor, injector, tokenizer, rollouts, acts = _tiny_batch(nla_run_inputs, n_prompts=3, group_size=2)
    advantages = torch.linspace(-1.5, 1.5, len(rollouts))
    options = LossOptions(aggregation=aggregation, kl_beta=0.1)
    optimizer = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=0.0)
    grads = []
    for micro_batch in (len(rollouts), 1, 4):
        policy_update(actor, injector, optimizer, rollouts, advantages, acts, loss=options,
                      micro_batch=micro_batch, max_grad_norm=1e9, pad_id=tokenizer.pad_token_id,
                      step_optimizer=False)
        grads.append(torch.cat([p.grad.flatten() for p in actor.parameters() if p.requires_grad]))
    assert grads[0].abs().sum() > 0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("share_prefix", [True, False])
def test_update_logs_the_entropy_of_the_full_vocab_softmax(nla_run_inputs, share_prefix):
    actor, injector, tokenizer, rollouts, acts = _tiny_batch(nla_run_inputs, n_prompts=3, group_size=2)
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad(), injector.inject(batch.input_ids, acts):
        logits = actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = logits.gather(1, batch.positions[..., None].expand(-1, -1, logits.shape[-1])).log_softmax(-1)
    expected = float(-(logp.exp() * logp).sum(-1)[batch.mask].mean())
    optimizer = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=0.0)
    stats = policy_update(actor, injector, optimizer, rollouts, torch.linspace(-1, 1, len(rollouts)), acts,
                          loss=LossOptions(), micro_batch=2, max_grad_norm=1e9, pad_id=tokenizer.pad_token_id,
                          share_prefix=share_prefix, step_optimizer=False)
    assert 0 < stats.entropy_mean < math.log(logits.shape[-1])
    assert stats.entropy_mean == pytest.approx(expected, rel=1e-5)
    off = policy_update(actor, injector, optimizer, rollouts, torch.linspace(-1, 1, len(rollouts)), acts,
                        loss=LossOptions(entropy_metric=False), micro_batch=2, max_grad_norm=1e9,
                        pad_id=tokenizer.pad_token_id, share_prefix=share_prefix, step_optimizer=False)
    assert math.isnan(off.entropy_mean) and off.loss == stats.loss


def test_kl_beta_zero_without_kl_metric_skips_the_reference_pass_and_keeps_the_update(nla_run_inputs, monkeypatch):
    actor, injector, tokenizer, rollouts, acts = _tiny_batch(nla_run_inputs, n_prompts=3, group_size=2)
    entered = []
    counted = lambda model: (entered.append(model), real_reference(model))[1]  # noqa: E731
    real_reference = update_module.reference_policy
    monkeypatch.setattr(update_module, "reference_policy", counted)
    params = [p for p in actor.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.0)
    results = {}
    for kl_metric in (True, False):
        entered.clear()
        stats = policy_update(actor, injector, optimizer, rollouts, torch.linspace(-1.5, 1.5, len(rollouts)), acts,
                              loss=LossOptions(kl_beta=0.0, kl_metric=kl_metric), micro_batch=2, max_grad_norm=1e9,
                              pad_id=tokenizer.pad_token_id, step_optimizer=False)
        results[kl_metric] = (stats, torch.cat([p.grad.flatten() for p in params]), len(entered))
    (measured, grad, passes), (skipped, grad_skipped, passes_skipped) = results[True], results[False]
    assert (passes, passes_skipped) == (1, 0)  # the reference forward ran for the metric only, then not at all
    assert math.isfinite(measured.kl_mean) and math.isnan(skipped.kl_mean)  # not measured: NaN, not a fake 0
    assert skipped.loss == measured.loss and grad.abs().sum() > 0
    torch.testing.assert_close(grad_skipped, grad, rtol=0, atol=0)


def test_top_entropy_quantile_masks_the_surrogate_at_low_entropy_tokens(nla_run_inputs, monkeypatch):
    actor, injector, tokenizer, rollouts, acts = _tiny_batch(nla_run_inputs, n_prompts=3, group_size=2)
    params = [p for p in actor.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.0)
    advantages = torch.linspace(-1.5, 1.5, len(rollouts))
    n = len(rollouts)  # one micro-batch: the threshold is then the whole batch's

    def update(**options):
        stats = policy_update(actor, injector, optimizer, rollouts, advantages, acts, loss=LossOptions(**options),
                              micro_batch=n, max_grad_norm=1e9, pad_id=tokenizer.pad_token_id, step_optimizer=False)
        return stats, torch.cat([p.grad.flatten() for p in params])

    default, grad = update()
    off, grad_off = update(top_entropy_quantile=1.0)
    assert off.loss == default.loss and off.entropy_mask_frac == 0.0 and grad.abs().sum() > 0
    torch.testing.assert_close(grad_off, grad, rtol=0, atol=0)

    calls = []
    real = update_module.nla_core.policy_loss
    monkeypatch.setattr(update_module.nla_core, "policy_loss",
                        lambda *a, **kw: (calls.append((a, kw)), real(*a, **kw))[1])
    half, grad_half = update(top_entropy_quantile=0.5, entropy_metric=False)
    ((args, kwargs),) = calls
    logp, old, adv, mask = args
    n_tokens = sum(r.response_len for r in rollouts)
    assert int(mask.sum()) == n_tokens and math.isnan(half.entropy_mean)
    assert half.entropy_mask_frac == pytest.approx(0.5, abs=1.5 / n_tokens)
    # The same loss by hand: nla_core's mask over the batch's entropies, from the full-vocab softmax.
    batch = response_batch(rollouts, pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad(), injector.inject(batch.input_ids, acts):
        logits = actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = logits.gather(1, batch.positions[..., None].expand(-1, -1, logits.shape[-1])).log_softmax(-1)
    entropy = -(lp.exp() * lp).sum(-1)
    keep = nla_core.top_entropy_mask(entropy, batch.mask, quantile=0.5)
    assert torch.equal(kwargs["keep"], keep)  # the rows of one micro-batch keep the rollouts' order here
    by_hand = real(*[a.detach() for a in args], **{**kwargs, "keep": keep})
    assert half.loss == pytest.approx(float(by_hand.loss), rel=1e-6)
    assert float((mask & ~keep).sum()) / n_tokens == pytest.approx(half.entropy_mask_frac)
    assert half.loss != default.loss and not torch.equal(grad_half, grad)


def test_ar_save_load_round_trip(nla_run_inputs, tmp_path):
    _, ar_dir, _ = nla_run_inputs
    ar = ARModel.from_pretrained(ar_dir, mse_scale=8.0)
    torch.nn.init.normal_(ar.value_head.weight, std=0.1)
    ar.save_pretrained(tmp_path / "ar")
    head = load_file(str(tmp_path / "ar" / VALUE_HEAD_FILE))
    assert list(head) == ["weight"] and head["weight"].shape == (fixtures.D_MODEL, fixtures.D_MODEL)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ar")
    assert plain.config.num_hidden_layers == fixtures.LAYER_INDEX + 1
    back = ARModel.from_pretrained(tmp_path / "ar", mse_scale=8.0)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids, mask), ar(ids, mask), rtol=0, atol=0)


def test_injector_injects_the_prompt_marker_only_and_counts_echoes(nla_run_inputs):
    actor, injector, tokenizer, rollouts, acts = _tiny_batch(nla_run_inputs, n_prompts=1, group_size=1)
    prompt = rollouts[0].full_ids[: rollouts[0].prompt_len].tolist()
    marker = injector.marker_id
    p = prompt.index(marker)
    echo = prompt + prompt[p - 1 : p + 2]  # the response repeats "left marker right"
    ids = torch.tensor([echo])
    sites, echoes = injector.prompt_sites(ids)
    assert sites.tolist() == [[0, p]] and echoes == 1
    with pytest.raises(ValueError, match="no well-formed marker"):
        injector.prompt_sites(torch.tensor([prompt[:p] + prompt[p + 1 :]]))
    # The echoing rollout trains without error; the echo stays uninjected. The full-sequence
    # forwards see (and count) the echo, once in the policy pass and once in the reference
    # pass; the shared-prefix forward never shows the response to the injector.
    echo_rollout = Rollout(full_ids=torch.tensor(echo), prompt_len=len(prompt),
                           behavior_logp=torch.full((3,), -1.0), text="", prompt_index=0)
    optimizer = torch.optim.SGD([q for q in actor.parameters() if q.requires_grad], lr=0.0)
    losses = []
    for share_prefix, echoes_counted in ((False, 2), (True, 0)):
        before = injector.echo_rows
        stats = policy_update(actor, injector, optimizer, [echo_rollout], torch.ones(1), acts[:1],
                              loss=LossOptions(), micro_batch=1, max_grad_norm=1.0, pad_id=tokenizer.pad_token_id,
                              share_prefix=share_prefix)
        assert math.isfinite(stats.loss) and injector.echo_rows == before + echoes_counted
        losses.append(stats.loss)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


# --------------------------------------------------------------------------- bad input


def _fails_cleanly(capsys, argv, *needles) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_unknown_config_key_is_named_with_the_closest_valid_key(nla_run_inputs, tmp_path, capsys):
    save_dir = tmp_path / "run"
    _fails_cleanly(capsys, fixtures.train_argv(nla_run_inputs, save_dir, num_step=3), "num_step", "num_steps")
    assert not save_dir.exists()


def test_temperature_other_than_one_is_refused(nla_run_inputs, tmp_path, capsys):
    save_dir = tmp_path / "run"
    _fails_cleanly(capsys, fixtures.train_argv(nla_run_inputs, save_dir, temperature=0.7), "temperature")
    assert not save_dir.exists()


def test_ar_dir_without_value_head_is_refused_before_writing(nla_run_inputs, tmp_path, capsys):
    av, _, parquet = nla_run_inputs
    save_dir = tmp_path / "run"
    _fails_cleanly(capsys, fixtures.train_argv((av, av, parquet), save_dir), VALUE_HEAD_FILE, "nla sft --mode ar")
    assert not save_dir.exists()


def test_eval_rows_overlapping_training_rows_are_refused(nla_run_inputs, tmp_path, capsys):
    save_dir = tmp_path / "run"
    _fails_cleanly(capsys, fixtures.train_argv(nla_run_inputs, save_dir, max_rows=40, eval_skip_rows=32), "max_rows")
    assert not save_dir.exists()


def test_save_dir_of_another_run_is_refused_and_left_alone(nla_run_inputs, tmp_path, capsys):
    save_dir = tmp_path / "run"
    assert cli.main(fixtures.train_argv(nla_run_inputs, save_dir, num_steps=1)) == 0
    before = {p: p.stat().st_mtime_ns for p in save_dir.rglob("*")}
    _fails_cleanly(capsys, fixtures.train_argv(nla_run_inputs, save_dir, num_steps=1, lr=5e-4), "lr", "overwrite")
    assert {p: p.stat().st_mtime_ns for p in save_dir.rglob("*")} == before


def test_rollout_requests_from_bad_prompts_fail_with_the_row(nla_run_inputs, tmp_path, capsys):
    av, ar, good = nla_run_inputs
    rows = fixtures.read_rows(good)
    rows[3]["prompt"] = [{"role": "user", "content": "no marker here"}]
    (tmp_path / "bad").mkdir()
    parquet = toy.write_rl_parquet(tmp_path / "bad" / "rl.parquet", rows)
    shutil.copy(str(good) + ".nla_meta.yaml", str(parquet) + ".nla_meta.yaml")
    save_dir = tmp_path / "run"
    _fails_cleanly(capsys, fixtures.train_argv((av, ar, parquet), save_dir), "row 3", "<INJECT>")
    assert not save_dir.exists()


def test_vllm_engine_without_vllm_says_how_to_install_it(nla_run_inputs, tmp_path, capsys):
    pytest.importorskip("nla_shell.engines.vllm")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    save_dir = tmp_path / "run"
    _fails_cleanly(capsys, fixtures.train_argv(nla_run_inputs, save_dir, engine="vllm"), "pip install 'nla[vllm]'")
    assert not save_dir.exists()


def test_a_fresh_lora_on_a_module_the_model_lacks_is_refused_before_the_run_dir(nla_run_inputs, tmp_path, capsys):
    """lora_targets of a fresh LoRA (sft_adapter=merge) are checked against the model before anything is written."""
    save_dir = tmp_path / "run"
    argv = fixtures.train_argv(nla_run_inputs, save_dir, sft_adapter="merge", lora_targets="q_proj,mlp")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config key 'lora_targets' names mlp, not a linear layer" in err, err
    assert not save_dir.exists()
