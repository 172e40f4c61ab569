"""fp8= of `nla train`: FP8 copies of frozen Linear layers (nla_shell.models.fp8) and their wiring into the step.

The swap is checked on plain modules (which layers convert, that the eager forward comes back), on the
AR (a co-trained AR's FP8 scoring follows its weights after each critic step; an AR-LoRA converts its
frozen base only), on the actor's reference pass and its update (the LoRA gradient through FP8 base
layers); then the key end to end on the tiny trainer fixtures.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import fixtures
import nla_core
from nla_shell import cli, families
from nla_shell.io.config import ConfigError, load_dataclass
from nla_shell.training.config import TrainConfig
from nla_shell.io.sidecars import load_sidecar
from nla_shell.models import ARModel, FP8Linears, ar_predict, fp8_matmuls, inner_lm, reference_policy
from nla_shell.models.fp8 import OUT_DTYPE
from nla_shell.training import scoring

BASE = dict(av_ckpt="a", ar_ckpt="b", rl_parquet="c", save_dir="d")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------- the swap on a plain module


def test_only_layers_of_multiples_of_16_convert_and_the_eager_forward_comes_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 20), nn.Linear(20, 32, bias=False))
    model.requires_grad_(False)
    copies = FP8Linears(model, label="test")
    assert copies.layers == [model[0]] and copies.total == 3 and copies.refreshed == 0
    assert copies.summary().startswith("[fp8] test: 1 of 3 Linear layers in FP8 (2 not multiples of 16")
    x = torch.randn(5, 32)
    eager = model(x)
    with torch.no_grad(), fp8_matmuls(copies):
        converted = model(x)
    q, s = nla_core.quantize_rowwise(model[0].weight)
    first = nla_core.fp8_linear(x, q, s, bias=model[0].bias, out_dtype=OUT_DTYPE).float()
    assert torch.equal(converted, model[3](model[2](torch.relu(first))))  # the other two ran eagerly
    assert not torch.equal(converted, eager) and relative_error(converted, eager) < 0.1
    assert torch.equal(model(x), eager) and "forward" not in vars(model[0])  # the class's forward again


def test_a_frozen_layer_passes_gradients_to_its_input_a_trained_one_to_its_weight_too():
    torch.manual_seed(0)
    frozen, trained = nn.Linear(16, 16).requires_grad_(False), nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    trained(x).pow(2).sum().backward()
    eager = (x.grad.clone(), trained.weight.grad.clone(), trained.bias.grad.clone())
    x.grad = trained.weight.grad = trained.bias.grad = None
    for model in (frozen, trained):
        with FP8Linears(model, label="test"):
            model(x).pow(2).sum().backward()
    assert frozen.weight.grad is None and bool(x.grad.ne(0).any())
    for fp8, exact in zip((trained.weight.grad, trained.bias.grad), eager[1:]):  # y's FP8 rounding, not W's
        assert 0 < relative_error(fp8, exact) < 0.1


def test_fast_accumulation_is_asked_of_every_converted_layer_only_when_given(monkeypatch):
    """FP8Linears(fast_accum=...) hands each converted layer's product (nla_core.fp8_linear_ste, which asks the
    kernel: tests/core/test_fp8.py) fast accumulation for the forward with "forward" and "all", for the FP8 input
    gradient with "all" only; "off" by default; the summary says which; another word is refused."""
    requested, product = [], nla_core.fp8_linear_ste
    monkeypatch.setattr(nla_core, "fp8_linear_ste",
                        lambda *a, **k: requested.append((k["fast_accum"], k["grad_fast_accum"])) or product(*a, **k))
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 16)).requires_grad_(False)
    for mode, asked in (("off", (False, False)), ("forward", (True, False)), ("all", (True, True))):
        copies = FP8Linears(model, label="test", backward=True, **({} if mode == "off" else {"fast_accum": mode}))
        with torch.no_grad(), copies:
            model(torch.randn(4, 32))
            assert all((type(layer).fast_accum, type(layer).grad_fast_accum) == asked for layer in copies.layers)
        assert requested == [asked, asked], mode
        assert ("fast accumulation" in copies.summary()) == (mode != "off")
        assert ("forward products" in copies.summary()) == (mode == "forward")
        requested.clear()
    with pytest.raises(ValueError, match="fast_accum 'true'"):
        FP8Linears(model, label="test", fast_accum="true")


def test_gpus_before_hopper_are_refused(monkeypatch):
    from nla_shell.models import require_fp8

    require_fp8(torch.device("cpu"))  # torch._scaled_mm runs on the CPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with pytest.raises(ValueError, match=r"compute capability >= 9.0.*is 8.9"):
        require_fp8(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    require_fp8(torch.device("cuda", 0))


def test_the_copies_stay_out_of_the_state_dict_and_the_parameters_and_a_cast_one_is_refused():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)).requires_grad_(False)
    names = set(model.state_dict())
    copies = FP8Linears(model, label="test")
    assert set(model.state_dict()) == names and len(list(model.parameters())) == 4  # weight pushes, optimizers
    assert model[0].fp8_weight.dtype == nla_core.FP8_DTYPE and model[0].fp8_scale.shape == (32, 1)
    with copies:
        assert isinstance(model[0], nn.Linear) and type(model[0]) is not nn.Linear
    assert type(model[0]) is nn.Linear
    model.to(torch.float64)  # casts every floating buffer, e4m3 included
    with pytest.raises(RuntimeError, match="cast to torch.float64"):
        copies.__enter__()
    copies.remove()  # a benchmark path's end: the buffers go, the layers stay
    assert not list(model.buffers()) and set(model.state_dict()) == names


def test_a_compile_backend_runs_the_same_fp8_product_compiled():
    """compile_backend (compile_blocks): outside compiled code each layer's FP8 product is one compiled graph,
    the same arithmetic as the eager one, gradients included ("aot_eager" traces what inductor would compile)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32))
    model[0].requires_grad_(False)  # a frozen layer and a trained one
    x = torch.randn(2, 5, 32, requires_grad=True)
    results = []
    for backend in (None, "aot_eager"):
        with FP8Linears(model, label="test", compile_backend=backend):
            y = model(x)
            y.pow(2).sum().backward()
        results.append((y.detach(), x.grad.clone(), model[2].weight.grad.clone()))
        x.grad = model[2].weight.grad = model[2].bias.grad = None
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    assert type(model[0]) is nn.Linear  # the eager class again after the block


def test_fp8_matmuls_refuse_nesting():
    model = nn.Linear(16, 16).requires_grad_(False)
    copies = FP8Linears(model, label="test")
    with copies:
        with pytest.raises(RuntimeError, match="already active"):
            copies.__enter__()
    with fp8_matmuls(None):  # no copies: the model's own dtype
        assert "forward" not in vars(model)


# ---------------------------------------------------------------- the AR (score)


def ar_inputs(tokenizer, n: int = 6) -> list[list[int]]:
    words = ["cat", "dog river", "numbers on a board", "weather", "the old bridge", "a story"]
    return [tokenizer.encode(f"<explanation>{w}</explanation>", add_special_tokens=False) for w in words[:n]]


def predict(ar, inputs, tokenizer):
    return ar_predict(ar, inputs, pad_id=tokenizer.pad_token_id, micro_batch=4, device=torch.device("cpu"))


def test_a_co_trained_ar_scores_with_its_weights_after_each_critic_step(nla_run_inputs, tiny_tokenizer):
    _, ar_dir, _ = nla_run_inputs
    torch.manual_seed(0)
    ar = ARModel.from_pretrained(ar_dir, mse_scale=None)
    ar.requires_grad_(True)  # train_critic=true, full weights
    copies = FP8Linears(families.backbone(ar.lm), label="score")
    assert copies.layers and copies.refreshed == len(copies.layers)
    inputs = ar_inputs(tiny_tokenizer)
    eager = predict(ar, inputs, tiny_tokenizer)
    with fp8_matmuls(copies):
        before = predict(ar, inputs, tiny_tokenizer)
    assert 0 < relative_error(before, eager) < 0.1
    weight = copies.layers[0].weight.detach().clone()
    optimizer = torch.optim.SGD(scoring.trainable_parameters(ar), lr=0.5)
    loss, _ = scoring.critic_step(ar, optimizer, inputs, torch.randn(len(inputs), fixtures.D_MODEL),
                                  pad_id=tiny_tokenizer.pad_token_id, micro_batch=4, max_grad_norm=1e9)
    assert math.isfinite(loss) and not torch.equal(copies.layers[0].weight, weight)
    with fp8_matmuls(copies):
        after = predict(ar, inputs, tiny_tokenizer)
    with fp8_matmuls(FP8Linears(families.backbone(ar.lm), label="score")):
        fresh = predict(ar, inputs, tiny_tokenizer)  # copies made from the new weights
    assert torch.equal(after, fresh)


def test_an_ar_lora_converts_its_frozen_base_only(nla_run_inputs, tiny_tokenizer):
    _, ar_dir, _ = nla_run_inputs
    torch.manual_seed(0)
    ar = ARModel.from_pretrained(ar_dir, mse_scale=None)
    ar.add_lora(r=4, alpha=8, use_rslora=True, base_model=ar_dir)
    for name, p in ar.lm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    backbone = families.backbone(ar.lm)
    copies = FP8Linears(backbone, label="score")
    names = {id(m): name for name, m in backbone.named_modules()}
    assert copies.layers and copies.refreshed == 0  # the base is frozen: quantised once
    assert all("lora_" not in names[id(m)] for m in copies.layers)
    assert sum(names[id(m)].endswith("base_layer") for m in copies.layers) == len(ar.lora.targets) * ar.num_layers
    inputs = ar_inputs(tiny_tokenizer)
    with fp8_matmuls(copies):
        lora_on = predict(ar, inputs, tiny_tokenizer)
        for name, p in ar.lm.named_parameters():  # the LoRA still acts, in its own dtype
            if "lora_B" in name:
                p.data.zero_()
        lora_off = predict(ar, inputs, tiny_tokenizer)
    assert relative_error(lora_on, lora_off) > 0.1


# ---------------------------------------------------------------- the actor (reference)


def test_the_reference_pass_runs_the_frozen_base_in_fp8(nla_run_inputs):
    av_dir, _, parquet = nla_run_inputs
    sidecar = load_sidecar(str(parquet) + ".nla_meta.yaml")
    actor, injector = fixtures.lora_actor(av_dir, sidecar)
    copies = FP8Linears(families.backbone(inner_lm(actor)), label="reference")
    assert copies.layers and copies.refreshed == 0 and copies.total == len(copies.layers)
    ids = torch.randint(5, 400, (3, 12))
    mask = torch.ones_like(ids)

    def reference_logits():
        with torch.no_grad(), reference_policy(actor):
            return actor(input_ids=ids, attention_mask=mask).logits

    eager = reference_logits()
    with fp8_matmuls(copies):
        converted = reference_logits()
    with torch.no_grad():
        adapted = actor(input_ids=ids, attention_mask=mask).logits
    assert 0 < relative_error(converted, eager) < 0.1
    assert torch.equal(reference_logits(), eager)  # back to the eager forwards on exit
    assert relative_error(adapted, eager) > 0  # the LoRA is on outside the reference


# The FP8 update's LoRA gradient against the same update with the base in float32 (exact beside FP8's
# 2^-4 per element), on the same rollouts: measured on the tiny actor (2 blocks) on 2026-12-01, cosine
# 0.9958 and relative error 9.2 % (a bf16 base: 0.9967, 8.2 %; bf16 autocast alone moves it 3 %,
# tests/shell/test_update_compute.py). The bounds below leave a margin over those.
UPDATE_GRAD_COSINE_MIN = 0.99
UPDATE_GRAD_REL_MAX = 0.15
UPDATE_NORM_REL_MAX = 0.05


def fp8_update_inputs(nla_run_inputs, tokenizer):
    """The tiny LoRA actor, its injector, 3 groups x 3 native rollouts, their activations and random advantages."""
    from nla_shell.engines.base import RolloutRequest
    from nla_shell.engines.native import NativeRolloutEngine
    from nla_shell.io.data import build_prompt_ids, load_rows

    av_dir, _, parquet = nla_run_inputs
    sidecar = load_sidecar(str(parquet) + ".nla_meta.yaml")
    actor, injector = fixtures.lora_actor(av_dir, sidecar)
    requests = [RolloutRequest(tuple(build_prompt_ids(row.prompt, sidecar, tokenizer)), row.activation)
                for row in load_rows(parquet, sidecar, max_rows=3)]
    rollouts = NativeRolloutEngine(actor, injector, tokenizer).generate(
        requests, group_size=3, max_new_tokens=8, generator=torch.Generator().manual_seed(1))
    activations = torch.stack([requests[r.prompt_index].activation for r in rollouts])
    advantages = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(3))
    return actor, injector, rollouts, activations, advantages


def lora_update(actor, injector, rollouts, activations, advantages, tokenizer, fp8):
    """The policy update's numbers and LoRA gradient (lr 0: the weights stay), the base in FP8 when `fp8`."""
    from nla_shell.models import trainable_parameters
    from nla_shell.training.update import LossOptions, policy_update

    optimizer = torch.optim.SGD(trainable_parameters(actor), lr=0.0)
    stats = policy_update(actor, injector, optimizer, rollouts, advantages, activations, loss=LossOptions(),
                          micro_batch=4, max_grad_norm=1e9, pad_id=tokenizer.pad_token_id,
                          step_optimizer=False, fp8_update=fp8)
    grad = torch.cat([p.grad.flatten() for p in trainable_parameters(actor)])
    assert all(p.grad is None for p in actor.parameters() if not p.requires_grad)
    actor.zero_grad(set_to_none=True)
    return stats, grad


def test_the_fp8_update_gradient_is_close_to_the_exact_one(nla_run_inputs, tiny_tokenizer):
    actor, injector, rollouts, activations, advantages = fp8_update_inputs(nla_run_inputs, tiny_tokenizer)
    copies = FP8Linears(families.backbone(inner_lm(actor)), label="update")
    exact, exact_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, None)
    fp8, fp8_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, copies)
    assert torch.nn.functional.cosine_similarity(exact_grad, fp8_grad, dim=0) >= UPDATE_GRAD_COSINE_MIN
    assert 0 < relative_error(fp8_grad, exact_grad) <= UPDATE_GRAD_REL_MAX
    assert abs(fp8.grad_norm - exact.grad_norm) <= UPDATE_NORM_REL_MAX * exact.grad_norm
    assert all("forward" not in vars(m) for m in copies.layers)  # the eager forwards are back


# ---------------------------------------------------------------- the key


def test_the_key_parses_and_refuses_what_cannot_run():
    assert load_dataclass(TrainConfig, BASE).fp8 == ()
    assert load_dataclass(TrainConfig, BASE, ["fp8=score,reference,update"]).fp8 == ("score", "reference", "update")
    assert load_dataclass(TrainConfig, BASE, ["fp8=score", "train_critic=true", "critic_rollouts=best"]).fp8 == (
        "score",)
    for overrides in (["fp8=updates"], ["fp8=score,bogus"], ["fp8=score,score"],
                      ["fp8=reference", "quant=4bit"], ["fp8=backward"], ["fp8=reference,backward"]):
        with pytest.raises(ConfigError) as err:
            load_dataclass(TrainConfig, BASE, overrides)
        assert "'fp8'" in str(err.value) and "\n" not in str(err.value), overrides
    with pytest.raises(ConfigError) as err:  # fast accumulation of no FP8 product
        load_dataclass(TrainConfig, BASE, ["fp8_fast_accum=forward"])
    assert "'fp8_fast_accum'" in str(err.value) and "name fp8's phases" in str(err.value)
    for mode in ("forward", "all"):
        assert load_dataclass(TrainConfig, BASE, ["fp8=update", f"fp8_fast_accum={mode}"]).fp8_fast_accum == mode
    with pytest.raises(ConfigError) as err:  # the boolean of 2026-12-03 is not one of the three
        load_dataclass(TrainConfig, BASE, ["fp8=update", "fp8_fast_accum=true"])
    assert "'fp8_fast_accum'" in str(err.value) and "\n" not in str(err.value)
    for overrides in (["fp8=reference", "train_critic=true"], ["fp8=score", "train_critic=true"],
                      ["fp8=score,reference,update", "compile_blocks=true", "bf16_autocast=true", "dtype=bfloat16"],
                      ["fp8=update,backward", "train_critic=true"], ["fp8=score,reference,update,backward"]):
        assert load_dataclass(TrainConfig, BASE, overrides).fp8 == tuple(overrides[0][4:].split(","))


def test_help_lists_the_key(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--fp8" in text and "2026-12-01" in text and "+1 byte per converted weight" in text


@pytest.fixture
def fp8_calls(monkeypatch):
    """The labels of the FP8 blocks entered and the number of FP8 matmuls run."""
    calls = {"blocks": [], "matmuls": 0}
    enter, linear = FP8Linears.__enter__, nla_core.fp8_linear_ste

    def entering(self):
        calls["blocks"].append(self.label)
        return enter(self)

    def counting(function):
        def counted(*args, **kwargs):
            calls["matmuls"] += 1
            return function(*args, **kwargs)
        return counted

    monkeypatch.setattr(FP8Linears, "__enter__", entering)
    monkeypatch.setattr(nla_core, "fp8_linear_ste", counting(linear))
    return calls


def run(nla_run_inputs, tmp_path, name, **overrides):
    settings = {"num_steps": 1, "eval_every": 0, **overrides}
    assert cli.main(fixtures.train_argv(nla_run_inputs, tmp_path / name, **settings)) == 0
    return fixtures.read_metrics(tmp_path / name)


LEARNED = ("loss", "reward_mean", "mse_mean", "kl_mean", "grad_norm", "advantage_std", "entropy_mean")


def test_off_by_default_and_on_in_the_phases_it_names(nla_run_inputs, tmp_path, fp8_calls, capsys):
    (default,) = run(nla_run_inputs, tmp_path, "default")
    (empty,) = run(nla_run_inputs, tmp_path, "empty", fp8="")
    assert fp8_calls == {"blocks": [], "matmuls": 0} and "[fp8]" not in capsys.readouterr().out
    assert {k: default[k] for k in LEARNED} == {k: empty[k] for k in LEARNED}
    assert default["kl_mean"] == 0.0  # a fresh LoRA (B = 0): the policy is its reference

    lines = run(nla_run_inputs, tmp_path, "fp8", num_steps=2, fp8="score,reference,update")
    out = capsys.readouterr().out
    for phase in ("score", "reference+update"):  # the tiny models' widths are multiples of 16: every layer converts
        found = re.search(rf"\[fp8\] {re.escape(phase)}: (\d+) of (\d+) Linear layers in FP8; (\d+) frozen, "
                          "quantised once", out)
        assert found and int(found[1]) > 0 and found[1] == found[2] == found[3], out
    # per step: one scoring block, the reference pass's block and the policy update's (one set of copies)
    assert fp8_calls["blocks"] == ["score", "reference+update", "reference+update"] * 2
    assert fp8_calls["matmuls"] > 0
    assert all(math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"]) for line in lines)
    assert lines[0]["logp_diff_mean"] > default["logp_diff_mean"]  # the trainer's FP8 log-probs vs the engine's
    assert lines[0]["reward_mean"] != default["reward_mean"] or lines[0]["mse_mean"] != default["mse_mean"]

    (reference_only,) = run(nla_run_inputs, tmp_path, "reference", fp8="reference")
    assert reference_only["kl_mean"] > 0  # the policy (B = 0) in its own dtype, its reference in FP8

    (backward,) = run(nla_run_inputs, tmp_path, "backward", fp8="update,backward", train_critic="true")
    out = capsys.readouterr().out
    assert "[fp8] update: " in out and "input gradients in FP8 too" in out and "[fp8] score" not in out
    assert math.isfinite(backward["loss"]) and backward["grad_norm"] > 0


@pytest.mark.parametrize("critic_rollouts", ["all", "best"])
def test_a_co_trained_critic_scoring_in_fp8_is_re_quantised_each_step(nla_run_inputs, tmp_path, fp8_calls, capsys,
                                                                      critic_rollouts):
    """all (the default): the critic scores and steps on one FP8 forward; best: a no-grad FP8 scoring, then
    the step on the best pairs' own FP8 forward. Either way its copies are re-made from the weights at each
    block, and it learns."""
    lines = run(nla_run_inputs, tmp_path, "critic", num_steps=2, fp8="score", train_critic="true",
                critic_rollouts=critic_rollouts)
    out = capsys.readouterr().out
    found = re.search(r"\[fp8\] score: (\d+) of \d+ Linear layers in FP8; (\d+) trained, re-quantised", out)
    assert found and found[1] == found[2] and int(found[1]) > 0, out
    assert fp8_calls["blocks"] == ["score"] * (2 if critic_rollouts == "all" else 4)
    assert "[fp8] reference" not in out and "[fp8] update" not in out
    assert fp8_calls["matmuls"] > 0
    assert all(math.isfinite(line["critic_loss"]) and math.isfinite(line["loss"]) for line in lines)
    assert all(line["critic_grad_norm"] > 0 for line in lines)


@pytest.mark.parametrize("backward", [False, True])
def test_a_co_trained_critics_fp8_gradient_is_close_to_its_own(nla_run_inputs, tiny_tokenizer, backward):
    """The critic's step on an FP8 forward (straight-through backward in its dtype; with backward, its input
    gradients from the transposed FP8 copy) against the same step in its dtype: on the tiny AR the
    gradient's cosine and relative error are within the policy update's bounds above. A trained weight's
    transposed copy is re-made from the weight at every block, as the forward's is."""
    _, ar_dir, _ = nla_run_inputs
    torch.manual_seed(0)
    ar = ARModel.from_pretrained(ar_dir, mse_scale=None)
    ar.requires_grad_(True)
    copies = FP8Linears(families.backbone(ar.lm), label="score", backward=backward)
    inputs, golds = ar_inputs(tiny_tokenizer), torch.randn(6, fixtures.D_MODEL, generator=torch.Generator().manual_seed(2))

    class Recording(torch.optim.SGD):  # lr 0: the weights stay; the gradient it was given is kept
        def step(self, closure=None):
            self.grad = torch.cat([p.grad.flatten() for group in self.param_groups for p in group["params"]])
            return super().step(closure)

    def gradient(fp8):
        optimizer = Recording(scoring.trainable_parameters(ar), lr=0.0)
        with fp8_matmuls(fp8):
            loss, norm = scoring.critic_step(ar, optimizer, inputs, golds, pad_id=tiny_tokenizer.pad_token_id,
                                             micro_batch=4, max_grad_norm=1e9)
        return loss, norm, optimizer.grad

    exact_loss, exact_norm, exact = gradient(None)
    fp8_loss, fp8_norm, fp8 = gradient(copies)
    assert torch.nn.functional.cosine_similarity(exact, fp8, dim=0) >= UPDATE_GRAD_COSINE_MIN
    assert 0 < relative_error(fp8, exact) <= UPDATE_GRAD_REL_MAX
    assert abs(fp8_norm - exact_norm) <= UPDATE_NORM_REL_MAX * exact_norm and fp8_loss != exact_loss
    if backward:
        layer = copies.layers[0]
        with torch.no_grad():
            layer.weight.mul_(2.0)
        with fp8_matmuls(copies):
            q, scale = nla_core.quantize_rowwise(layer.weight.t())
            assert torch.equal(layer.fp8_weight_t.float(), q.float()) and torch.equal(layer.fp8_scale_t, scale)


def test_compiled_blocks_run_the_fp8_layers_and_compile_no_graph_per_layer(nla_run_inputs, tiny_tokenizer):
    """compile_blocks with fp8 ("aot_eager" traces what inductor would compile, without a C++ build):

    - the converted layers under a compiled LoRA layer or MLP share its graphs: once the first two blocks'
      layers have run in FP8 (the first block's inputs need no gradient, the others' do: variants of their
      own), converting the last block's too compiles nothing new, and neither does entering the block
      again, so a deep model stays under dynamo's recompile limit. (A forward per layer, guarded on by
      identity, compiled one more variant per layer: at the Qwen3-8B shape on 2026-12-01, 252 LoRA layers,
      past the limit of 64, and the rest of the run eager and slower than bf16.)
    - the compiled FP8 update's numbers are the eager FP8 update's.
    """
    from torch._dynamo.utils import counters

    from nla_shell.models import CompiledBlockParts

    actor, injector, rollouts, activations, advantages = fp8_update_inputs(nla_run_inputs, tiny_tokenizer)
    blocks = families.decoder_blocks(actor)
    copies = FP8Linears(families.backbone(inner_lm(actor)), label="reference+update")
    _, exact_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, None)
    eager, eager_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, copies)
    first_blocks = FP8Linears(nn.ModuleList(blocks[:2]), label="update")
    assert len(blocks) == 3 and 2 * len(copies.layers) == 3 * len(first_blocks.layers)
    torch._dynamo.reset()
    compiled = CompiledBlockParts(actor, backend="aot_eager")
    try:
        lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, None)
        own_dtype = counters["stats"]["unique_graphs"]
        lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, first_blocks)
        graphs = counters["stats"]["unique_graphs"]
        every_block = FP8Linears(families.backbone(inner_lm(actor)), label="reference+update")  # the same copies
        first, first_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, every_block)
        again, again_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, every_block)
        assert graphs > own_dtype and counters["stats"]["unique_graphs"] == graphs
    finally:
        compiled.remove()
        torch._dynamo.reset()
    fp8_error = relative_error(eager_grad, exact_grad)
    for numbers, grad in ((first, first_grad), (again, again_grad)):
        # The compiled graphs round a few activations differently, and an element near an e4m3 midpoint then
        # quantises the other way: the same FP8 update, to well under FP8's own error.
        assert numbers.loss == pytest.approx(eager.loss, rel=1e-3, abs=1e-6)
        assert relative_error(grad, eager_grad) < 0.1 * fp8_error
    assert all("forward" not in vars(m) for m in every_block.layers)


def test_the_fp8_backward_update_gradient_is_close_to_the_exact_one_and_farther_than_fp8_forwards(
        nla_run_inputs, tiny_tokenizer):
    """fp8=update,backward: the base layers' input gradients are FP8 products too (a transposed copy), so the
    LoRA gradient carries the backward's quantisation beside the forward's. On the tiny actor (2026-12-01):
    cosine 0.995 and 9.9 % relative against the exact gradient, where the forward-only FP8 update is at
    9.2 %; it must stay within the forward-only test's bounds."""
    actor, injector, rollouts, activations, advantages = fp8_update_inputs(nla_run_inputs, tiny_tokenizer)
    base = families.backbone(inner_lm(actor))
    exact, exact_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, None)
    forwards = FP8Linears(base, label="update")
    _, forward_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, forwards)
    both = FP8Linears(base, label="update", backward=True)
    assert "input gradients in FP8 too" in both.summary()
    assert all(m.fp8_weight_t.shape == m.weight.shape[::-1] for m in both.layers)
    fp8, fp8_grad = lora_update(actor, injector, rollouts, activations, advantages, tiny_tokenizer, both)
    assert torch.nn.functional.cosine_similarity(exact_grad, fp8_grad, dim=0) >= UPDATE_GRAD_COSINE_MIN
    assert 0 < relative_error(fp8_grad, exact_grad) <= UPDATE_GRAD_REL_MAX
    assert abs(fp8.grad_norm - exact.grad_norm) <= UPDATE_NORM_REL_MAX * exact.grad_norm
    assert relative_error(fp8_grad, forward_grad) > 0  # the backward's products did change
    both.remove()
    assert not any(hasattr(m, "fp8_weight_t") for m in both.layers)
