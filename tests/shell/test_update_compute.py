"""Cheaper arithmetic for the policy update (issue 12): the actor's blocks under bf16 autocast
compute the float32-LoRA update's numbers within bf16 tolerance, the native engine samples
with the trainer's arithmetic, and with the option off (or removed) nothing changes, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fixtures
from nla_shell import cli, families
from nla_shell.engines.base import RolloutRequest
from nla_shell.engines.native import NativeRolloutEngine
from nla_shell.io.data import build_prompt_ids, load_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.models import BackboneAutocast, CompiledBlockParts, inner_lm, trainable_parameters
from nla_shell.models import compile as model_compile
from nla_shell.training.update import LossOptions, policy_update

# bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3 per product); through the tiny
# actor's 2 blocks the summed gradient moves by ~3 % in norm (measured: 3.0e-2 relative, cosine 0.9996).
LOSS_REL_TOL = 1e-2
GRAD_COSINE_MIN = 0.999
GRAD_NORM_REL_TOL = 2e-2
KL_ABS_TOL = 1e-2


def _actor_and_requests(nla_cache_dir: Path, tiny_tokenizer, dtype: torch.dtype):
    """(actor, injector, tokenizer, 3 requests): the trainer's CPU actor with its base in `dtype`."""
    from transformers import AutoTokenizer

    av, _, parquet = fixtures.build_trainer_inputs(nla_cache_dir / "trainer_inputs", tiny_tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(av)
    cfg = load_sidecar(Path(str(parquet) + ".nla_meta.yaml"))
    actor, injector = fixtures.lora_actor(av, cfg, dtype=dtype)
    requests = [RolloutRequest(tuple(build_prompt_ids(row.prompt, cfg, tokenizer)), row.activation)
                for row in load_rows(parquet, cfg, max_rows=3)]
    return actor, injector, tokenizer, requests


@pytest.fixture(scope="module")
def bf16_actor(nla_cache_dir: Path, tiny_tokenizer):
    """The GPU's situation on the CPU: a bf16 base with float32 LoRA factors (PEFT's default);
    the actor, injector, tokenizer, native engine and 3 requests."""
    actor, injector, tokenizer, requests = _actor_and_requests(nla_cache_dir, tiny_tokenizer, torch.bfloat16)
    assert {p.dtype for p in trainable_parameters(actor)} == {torch.float32}
    return actor, injector, tokenizer, NativeRolloutEngine(actor, injector, tokenizer), requests


def _rollouts(engine, requests):
    return engine.generate(requests, group_size=3, max_new_tokens=8, generator=torch.Generator().manual_seed(1))


def _update(actor, injector, tokenizer, rollouts, requests, *, micro_batch: int = 4):
    """policy_update's statistics and summed gradient (no optimizer step) on these rollouts."""
    activations = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    advantages = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.SGD(trainable_parameters(actor), lr=0.0)
    stats = policy_update(actor, injector, optimizer, rollouts, advantages, activations, loss=LossOptions(),
                          micro_batch=micro_batch, max_grad_norm=1e9, pad_id=tokenizer.pad_token_id, step_optimizer=False)
    grad = torch.cat([p.grad.flatten() for p in trainable_parameters(actor)])
    actor.zero_grad(set_to_none=True)
    return stats, grad


def test_bf16_autocast_update_matches_the_float32_lora_update_on_the_same_rollouts(bf16_actor):
    actor, injector, tokenizer, engine, requests = bf16_actor
    rollouts = _rollouts(engine, requests)
    fp32, fp32_grad = _update(actor, injector, tokenizer, rollouts, requests)
    autocast = BackboneAutocast(actor, torch.bfloat16)
    try:
        bf16, bf16_grad = _update(actor, injector, tokenizer, rollouts, requests)
    finally:
        autocast.remove()
    assert abs(bf16.loss - fp32.loss) <= LOSS_REL_TOL * abs(fp32.loss)
    assert abs(bf16.grad_norm - fp32.grad_norm) <= GRAD_NORM_REL_TOL * fp32.grad_norm
    assert abs(bf16.kl_mean - fp32.kl_mean) <= KL_ABS_TOL
    assert torch.nn.functional.cosine_similarity(bf16_grad, fp32_grad, dim=0) >= GRAD_COSINE_MIN
    # ... and it is a different arithmetic, not the float32 one under another name.
    assert not torch.equal(bf16_grad, fp32_grad)
    assert bf16_grad.dtype == torch.float32  # float32 master gradients


def test_native_engine_samples_with_the_trainers_bf16_arithmetic(bf16_actor):
    """Under autocast the engine's behaviour log-probs are closer to the trainer's than those of
    an engine left with float32 LoRA products (the control), and they take back most of the gap
    that the control's mismatched arithmetic opens over the float32 run (on a bf16 base, a decode
    step and a full forward round differently in any case).

    The LoRA is made 4x larger for this test (B std 0.2): at the fixture's std 0.05 its products'
    bf16 rounding sat below the decode-vs-forward rounding, and the control and autocast gaps came
    out in either order by CPU (an AMD EPYC with avx512_bf16, 2026-12-02: 0.003455 against 0.003555).
    At 4x there (mean |delta log p|): float32 0.00197, control 0.00363, autocast 0.00223."""
    actor, injector, tokenizer, engine, requests = bf16_actor
    lora_b = [p for name, p in actor.named_parameters() if "lora_B" in name]
    saved = [p.detach().clone() for p in lora_b]
    with torch.no_grad():
        for p in lora_b:
            p.mul_(4.0)
    try:
        fp32_rollouts = _rollouts(engine, requests)
        fp32 = _update(actor, injector, tokenizer, fp32_rollouts, requests)[0]
        autocast = BackboneAutocast(actor, torch.bfloat16)
        try:
            control = _update(actor, injector, tokenizer, fp32_rollouts, requests)[0]
            bf16 = _update(actor, injector, tokenizer, _rollouts(engine, requests), requests)[0]
        finally:
            autocast.remove()
    finally:
        with torch.no_grad():
            for p, value in zip(lora_b, saved):
                p.copy_(value)
    assert bf16.logp_diff_mean < control.logp_diff_mean
    excess = control.logp_diff_mean - fp32.logp_diff_mean
    assert excess > 0 and control.logp_diff_mean - bf16.logp_diff_mean >= 0.5 * excess


def test_removed_autocast_leaves_rollouts_and_update_bit_equal(bf16_actor):
    actor, injector, tokenizer, engine, requests = bf16_actor
    before = _rollouts(engine, requests)
    stats, grad = _update(actor, injector, tokenizer, before, requests)
    BackboneAutocast(actor, torch.bfloat16).remove()
    after = _rollouts(engine, requests)
    assert all(torch.equal(a.full_ids, b.full_ids) and torch.equal(a.behavior_logp, b.behavior_logp)
               for a, b in zip(before, after))
    stats_after, grad_after = _update(actor, injector, tokenizer, after, requests)
    assert torch.equal(grad, grad_after)
    assert (stats.loss, stats.grad_norm, stats.kl_mean) == (stats_after.loss, stats_after.grad_norm, stats_after.kl_mean)



@pytest.fixture(scope="module")
def fp32_actor(nla_cache_dir: Path, tiny_tokenizer):
    """The float32 CPU actor, injector, tokenizer, 3 groups x 3 rollouts and their requests."""
    actor, injector, tokenizer, requests = _actor_and_requests(nla_cache_dir, tiny_tokenizer, torch.float32)
    return actor, injector, tokenizer, _rollouts(NativeRolloutEngine(actor, injector, tokenizer), requests), requests


def test_compiled_block_parts_are_the_norms_mlps_and_lora_layers_and_keep_the_update(fp32_actor):
    """Compiled norms, MLPs, LoRA layers and log-prob head give the eager update's numbers (the reference pass
    runs the LoRA layers with the adapter off); micro-batches of another size
    reuse the graphs (dynamic shapes); removal restores the eager forwards. The "aot_eager"
    backend traces what inductor would compile, without a C++ build per graph (minutes here)."""
    from torch._dynamo.utils import counters

    actor, injector, tokenizer, rollouts, requests = fp32_actor
    eager, eager_grad = _update(actor, injector, tokenizer, rollouts, requests)
    home = sys.modules["transformers.models.qwen3.modeling_qwen3"]
    eager_rotary = home.apply_rotary_pos_emb
    compiled = CompiledBlockParts(actor, backend="aot_eager")
    try:
        assert compiled.rotary_homes == [home] and home.apply_rotary_pos_emb is not eager_rotary
        assert model_compile._compiled_heads[inner_lm(actor)] == model_compile._compiled_chunk_kernels("aot_eager")
        assert {type(m).__qualname__ for m in compiled.modules} == {"Qwen3RMSNorm", "Qwen3MLP", "Linear"}
        lora = [m for m in compiled.modules if hasattr(m, "cast_input_dtype_enabled")]
        # Per block: the input, post-attention, q and k norms, the MLP, and the LoRA on q, k, v, o.
        assert len(compiled.modules) == 9 * len(families.decoder_blocks(actor)) and len(lora) == 4 * len(families.decoder_blocks(actor))
        stats, grad = _update(actor, injector, tokenizer, rollouts, requests)
        graphs = counters["stats"]["unique_graphs"]
        larger, larger_grad = _update(actor, injector, tokenizer, rollouts, requests, micro_batch=9)
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        compiled.remove()
    assert all("forward" not in vars(m) for m in compiled.modules)
    assert home.apply_rotary_pos_emb is eager_rotary
    assert inner_lm(actor) not in model_compile._compiled_heads
    for numbers, g in ((stats, grad), (larger, larger_grad)):
        assert numbers.loss == pytest.approx(eager.loss, rel=1e-5, abs=1e-7)
        assert numbers.kl_mean == pytest.approx(eager.kl_mean, rel=1e-5, abs=1e-9)
        torch.testing.assert_close(g, eager_grad, rtol=1e-4, atol=1e-6)


def test_the_rotary_embedding_stays_compiled_until_the_last_instance_compiling_it_is_removed(fp32_actor):
    """The actor and the AR of one family share their modeling module's rotary function: removing
    one CompiledBlockParts leaves the other's compiled; the eager function is back after both."""
    actor = fp32_actor[0]
    lm = inner_lm(actor)
    other = type(lm)(lm.config)  # another model of the family (an AR, say)
    home = sys.modules["transformers.models.qwen3.modeling_qwen3"]
    eager_rotary = home.apply_rotary_pos_emb
    first = CompiledBlockParts(actor, backend="aot_eager")
    with pytest.raises(ValueError, match="remove"):  # wrapping compiled forwards again would break remove()
        CompiledBlockParts(actor, backend="aot_eager")
    second = CompiledBlockParts(other, backend="aot_eager")
    compiled_rotary = home.apply_rotary_pos_emb
    first.remove()
    assert home.apply_rotary_pos_emb is compiled_rotary is not eager_rotary
    second.remove()
    assert home.apply_rotary_pos_emb is eager_rotary
    without = CompiledBlockParts(actor, backend="aot_eager", rotary=False)
    assert without.rotary_homes == [] and home.apply_rotary_pos_emb is eager_rotary
    without.remove()


# --------------------------------------------------------------------------- nla train


def test_bf16_autocast_run_trains_and_its_engine_follows_the_trainer(nla_run_inputs, tmp_path):
    """Two steps of a bf16 run with and without the option: the same step-0 loss (the fresh LoRA's
    B is 0, so no LoRA product reaches the forward yet), another gradient (bf16 products in its
    backward), and at step 1 an engine/trainer log-prob gap no larger than the float32-LoRA run's.
    One prompt forward per micro-batch: a block of several pads prompts of other lengths, and the
    masked attention's bf16 rounding (which the engine's unpadded prompts do not see) would add
    its own gap to the one compared here (with blocks of 4: 9.4e-4 against the float32 run's 4.3e-4)."""
    runs = {}
    for flag in ("false", "true"):
        save_dir = tmp_path / f"autocast_{flag}"
        argv = fixtures.train_argv(nla_run_inputs, save_dir, num_steps=2, eval_every=0, lr=3e-3, dtype="bfloat16",
                                   bf16_autocast=flag, engine="native", logp_prompt_block=1)
        assert cli.main(argv) == 0
        runs[flag] = fixtures.read_metrics(save_dir)
    fp32, bf16 = runs["false"], runs["true"]
    assert bf16[0]["loss"] == fp32[0]["loss"]
    assert bf16[0]["grad_norm"] != fp32[0]["grad_norm"]
    assert bf16[0]["grad_norm"] == pytest.approx(fp32[0]["grad_norm"], rel=GRAD_NORM_REL_TOL)
    assert 0 < bf16[1]["logp_diff_mean"] <= fp32[1]["logp_diff_mean"]


def test_bf16_autocast_on_a_float32_run_is_refused_before_writing(nla_run_inputs, tmp_path, capsys):
    save_dir = tmp_path / "run"
    assert cli.main(fixtures.train_argv(nla_run_inputs, save_dir, bf16_autocast="true")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bf16_autocast" in err and "dtype=bfloat16" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not save_dir.exists()
