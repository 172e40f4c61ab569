"""The GRPO trainer end to end on a tiny hub-free Qwen3, through its public entry points."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fixtures
from nla_shell import cli
from nla_shell.toy import builders as toy
from nla_shell.training.checkpoint import latest_checkpoint
from nla_shell.io.data import build_prompt_ids, load_rows
from nla_shell.io.sidecars import load_sidecar
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.io.logging import METRIC_KEYS
from nla_shell.models import VALUE_HEAD_FILE, ARModel, response_logprobs
from nla_shell.training.update import LossOptions, policy_update, response_batch

TIMING_KEYS = {"time_rollout", "time_score", "time_update", "time_critic", "time_sync", "time_step",
               "tokens_per_s", "peak_mem_gb"}


def test_three_step_run_writes_metrics_checkpoint_and_summary(nla_run_inputs, tmp_path):
    save_dir = tmp_path / "run"
    assert cli.main(fixtures.train_argv(nla_run_inputs, save_dir)) == 0
    lines = fixtures.read_metrics(save_dir)
    assert [line["step"] for line in lines] == [0, 1, 2]
    for line in lines:
        assert set(METRIC_KEYS) <= set(line)
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
