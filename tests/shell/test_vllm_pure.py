"""The vLLM engine's pure parts, on CPU without vLLM: request specs, log-prob extraction,
outputs -> rollouts, mismatch stats, the steering plugin's bookkeeping and op, weight sync."""

from __future__ import annotations

import copy
import importlib.util
import math
from types import SimpleNamespace

import fixtures
import numpy as np
import pytest
import torch

import nla_core
from nla_shell.engines import vllm_steering as steer
from nla_shell.engines.base import RolloutRequest
from nla_shell.engines.vllm import INSTALL_HINT, VLLMRolloutEngine
from nla_shell.engines.vllm_requests import (
    build_request_specs,
    cache_salt,
    lens_steering_kwargs,
    logprob_mismatch,
    marker_position,
    nla_extra_args,
    rollouts_from_outputs,
    sampled_logprobs,
    sampling_kwargs,
)
from nla_shell.engines.weight_sync import merged_weight_buckets

MARKER, LEFT, RIGHT = 7, 5, 6
D = 8


def _prompt(length: int, position: int) -> tuple[int, ...]:
    ids = [20 + (i % 50) for i in range(length)]
    ids[position - 1 : position + 2] = [LEFT, MARKER, RIGHT]
    return tuple(ids)


def _specs(requests, **overrides):
    kwargs = dict(
        group_size=3,
        max_new_tokens=16,
        marker_id=MARKER,
        left_id=LEFT,
        right_id=RIGHT,
        d_model=D,
        injection_layer=1,
        stop_token_ids=[2],
    )
    kwargs.update(overrides)
    return build_request_specs(requests, **kwargs)


# --------------------------------------------------------------------------- import / install


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_without_vllm_says_how_to_install():
    with pytest.raises(ImportError) as err:
        VLLMRolloutEngine("unused", SimpleNamespace(eos_token_id=2), marker_id=MARKER, left_id=LEFT, right_id=RIGHT)
    assert "pip install 'nla[vllm]'" in str(err.value)
    assert "shared/" not in str(err.value), "a user's clone has no shared/ (issue #15)"
    assert str(err.value) == INSTALL_HINT


def test_unknown_backend_is_rejected_before_vllm_is_needed():
    with pytest.raises(ValueError, match="steering must be one of"):
        VLLMRolloutEngine("unused", SimpleNamespace(eos_token_id=2), marker_id=1, left_id=2, right_id=3, steering="x")


# --------------------------------------------------------------------------- request specs


def test_marker_position_and_malformed_prompts():
    assert marker_position(_prompt(12, 4), marker_id=MARKER, left_id=LEFT, right_id=RIGHT) == 4
    with pytest.raises(ValueError, match="exactly one marker"):
        marker_position((1, 2, 3, MARKER), marker_id=MARKER, left_id=LEFT, right_id=RIGHT)
    two = list(_prompt(20, 4))
    two[10:13] = [LEFT, MARKER, RIGHT]
    with pytest.raises(ValueError):
        marker_position(two, marker_id=MARKER, left_id=LEFT, right_id=RIGHT)


def test_specs_carry_prompt_marker_and_a_private_3d_vector():
    acts = [torch.randn(D), torch.randn(D, dtype=torch.float64)]
    requests = [RolloutRequest(_prompt(12, 4), acts[0]), RolloutRequest(_prompt(15, 9), acts[1])]
    specs = _specs(requests, seeds=[11, 12])
    assert [s.prompt_index for s in specs] == [0, 1]
    assert [s.marker_position for s in specs] == [4, 9]
    assert specs[1].prompt_ids == requests[1].prompt_ids
    for spec, act in zip(specs, acts):
        assert spec.vector.shape == (1, 1, D) and spec.vector.dtype == torch.float32
        assert spec.vector.device.type == "cpu"
        torch.testing.assert_close(spec.vector.reshape(-1), act.float())
        assert spec.n == 3 and spec.max_tokens == 16 and spec.stop_token_ids == (2,)
    assert [s.seed for s in specs] == [11, 12]
    acts[0].add_(1.0)  # the caller's tensor changing later must not change the spec
    assert not torch.allclose(specs[0].vector.reshape(-1), acts[0])


def test_specs_reject_bad_requests_by_index():
    good = RolloutRequest(_prompt(12, 4), torch.randn(D))
    with pytest.raises(ValueError, match="request 1: activation"):
        _specs([good, RolloutRequest(_prompt(12, 4), torch.randn(1, D))])
    with pytest.raises(ValueError, match="request 1: prompt"):
        _specs([good, RolloutRequest((1, 2, 3, 4), torch.randn(D))])
    with pytest.raises(ValueError, match="group_size"):
        _specs([good], group_size=0)


def test_cache_salt_separates_vectors_and_places_only():
    v = torch.randn(1, 1, D)
    assert cache_salt(v, 4, 1) == cache_salt(v.clone(), 4, 1)
    assert cache_salt(v, 4, 1) != cache_salt(v * 1.5, 4, 1)
    assert cache_salt(v, 4, 1) != cache_salt(v, 5, 1)
    assert cache_salt(v, 4, 1) != cache_salt(v, 4, 2)


def test_sampling_kwargs_and_extra_args_are_fresh_and_plain():
    (spec,) = _specs([RolloutRequest(_prompt(12, 4), torch.randn(D))])
    first, second = nla_extra_args(spec), nla_extra_args(spec)
    assert first == second and first is not second
    assert first[steer.EXTRA_ARGS_KEY] is not second[steer.EXTRA_ARGS_KEY]
    a = sampling_kwargs(spec, extra_args=first)
    b = sampling_kwargs(spec, extra_args=second)
    assert a is not b and a["extra_args"] is first and b["extra_args"] is second
    assert a["temperature"] == 1.0 and a["top_p"] == 1.0 and a["top_k"] == 0 and a["min_p"] == 0.0
    assert a["repetition_penalty"] == 1.0 and a["presence_penalty"] == 0.0 and a["frequency_penalty"] == 0.0
    assert a["n"] == 3 and a["max_tokens"] == 16 and a["logprobs"] == 0 and a["detokenize"] is False
    assert a["stop_token_ids"] == [2]
    greedy = sampling_kwargs(spec, extra_args=None, greedy=True)  # reading explanations: vLLM's argmax
    assert greedy["temperature"] == 0.0 and {k: v for k, v in greedy.items() if k not in ("temperature", "extra_args")} \
        == {k: v for k, v in a.items() if k not in ("temperature", "extra_args")}
    payload = first[steer.EXTRA_ARGS_KEY]
    assert payload["position"] == 4 and isinstance(payload["vector"], bytes)
    v = spec.vector.reshape(-1)
    torch.testing.assert_close(steer.unit_vector(payload["vector"], D), v / v.norm())


def test_lens_steering_vector_is_3d_at_the_marker():
    (spec,) = _specs([RolloutRequest(_prompt(12, 4), torch.randn(D))])
    kw = lens_steering_kwargs(spec, layer=1)
    assert kw["activations"].shape == (1, 1, D) and kw["activations"].dtype == torch.float32
    assert kw["activations"] is not spec.vector
    assert kw["layer_indices"] == [1] and kw["position_indices"] == [4]
    assert kw["norm_match"] is True and kw["scale"] == 1.0


# --------------------------------------------------------------------------- outputs


class _Flat:
    """The shape of vLLM's FlatLogprobs."""

    def __init__(self, steps: list[dict[int, float]]) -> None:
        self.start_indices, self.end_indices, self.token_ids, self.logprobs = [], [], [], []
        for step in steps:
            self.start_indices.append(len(self.token_ids))
            for token, lp in step.items():
                self.token_ids.append(token)
                self.logprobs.append(lp)
            self.end_indices.append(len(self.token_ids))

    def __len__(self) -> int:
        return len(self.start_indices)


def _dicts(steps: list[dict[int, float]]) -> list[dict[int, SimpleNamespace]]:
    return [{t: SimpleNamespace(logprob=lp) for t, lp in step.items()} for step in steps]


@pytest.mark.parametrize("form", [_Flat, _dicts])
def test_sampled_logprobs_picks_the_sampled_token(form):
    steps = [{10: -0.5}, {3: -2.0, 11: -1.25}, {12: -0.125, 4: -0.01}]
    got = sampled_logprobs([10, 11, 12], form(steps), where="x")
    assert got.dtype == torch.float32
    assert got.tolist() == [-0.5, -1.25, -0.125]


@pytest.mark.parametrize("form", [_Flat, _dicts])
def test_sampled_logprobs_never_substitutes(form):
    with pytest.raises(RuntimeError, match="sampled token 12 at generated step 2"):
        sampled_logprobs([10, 11, 12], form([{10: -0.5}, {11: -1.0}, {4: -0.1}]), where="prompt 0, sample 1")
    with pytest.raises(RuntimeError, match="step 2 is unaccounted"):
        sampled_logprobs([10, 11, 12], form([{10: -0.5}, {11: -1.0}]), where="x")
    with pytest.raises(RuntimeError, match="step 1"):
        sampled_logprobs([10, 11], form([{10: -0.5}, {11: math.nan}]), where="x")
    with pytest.raises(RuntimeError, match="no log-probs"):
        sampled_logprobs([10], None, where="x")


def _completion(index: int, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        index=index, token_ids=tokens, logprobs=_Flat([{t: -0.1 * (k + 1)} for k, t in enumerate(tokens)])
    )


def test_rollouts_are_prompt_major_with_prompt_index():
    requests = [RolloutRequest(_prompt(12, 4), torch.randn(D)), RolloutRequest(_prompt(10, 3), torch.randn(D))]
    specs = _specs(requests, group_size=2)
    outputs = [
        # completions arrive out of index order; the EOS (2) stays in the rollout
        SimpleNamespace(prompt_token_ids=list(specs[0].prompt_ids), outputs=[_completion(1, [30, 2]), _completion(0, [31])]),
        SimpleNamespace(prompt_token_ids=list(specs[1].prompt_ids), outputs=[_completion(0, [32, 33, 34]), _completion(1, [])]),
    ]
    rollouts = rollouts_from_outputs(outputs, specs, decode=lambda ids: " ".join(map(str, ids)))
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1]
    assert [r.text for r in rollouts] == ["31", "30 2", "32 33 34", ""]
    first = rollouts[1]
    assert first.prompt_len == 12
    assert first.full_ids.tolist() == list(specs[0].prompt_ids) + [30, 2]
    assert first.behavior_logp.tolist() == pytest.approx([-0.1, -0.2])
    assert rollouts[3].behavior_logp.shape == (0,) and rollouts[3].full_ids.shape == (10,)


def test_rollouts_catch_a_changed_prompt_or_missing_samples():
    specs = _specs([RolloutRequest(_prompt(12, 4), torch.randn(D))], group_size=2)
    bos = SimpleNamespace(prompt_token_ids=[1] + list(specs[0].prompt_ids), outputs=[])
    with pytest.raises(RuntimeError, match="BOS"):
        rollouts_from_outputs([bos], specs, decode=str)
    short = SimpleNamespace(prompt_token_ids=list(specs[0].prompt_ids), outputs=[_completion(0, [3])])
    with pytest.raises(RuntimeError, match="1 samples instead of 2"):
        rollouts_from_outputs([short], specs, decode=str)
    with pytest.raises(RuntimeError, match="0 outputs for 1"):
        rollouts_from_outputs([], specs, decode=str)


def test_logprob_mismatch_by_hand():
    behavior = torch.tensor([[0.0, -1.0, math.nan], [-2.0, 0.0, 0.0]])
    trainer = torch.tensor([[0.1, -1.3, 5.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = logprob_mismatch(behavior, trainer, mask, threshold=0.15)
    assert out.mean_abs == pytest.approx((0.1 + 0.3 + 0.0) / 3)
    assert out.max_abs == pytest.approx(0.3)
    assert out.over.tolist() == [True, False] and out.frac_over == 0.5
    with pytest.raises(ValueError, match="bool"):
        logprob_mismatch(behavior, trainer, mask.float(), threshold=0.1)


# --------------------------------------------------------------------------- steering plugin


def test_marker_rows_follow_chunks_and_skip_decodes():
    markers = {"a": 5, "b": 40, "c": 3}
    req_ids = ["d", "a", "b", "c"]
    # d decodes 1 token; a prefills 0..15 (marker 5); b is in its chunk 32..47 (marker 40);
    # c already computed its marker (3) and decodes
    query_start = np.array([0, 1, 17, 33, 34])
    num_computed = np.array([20, 0, 32, 9])
    rows, hits = steer.marker_rows(req_ids, query_start, num_computed, range(4), markers)
    assert hits == ["a", "b"] and rows == [1 + 5, 17 + 8]
    assert steer.marker_rows(req_ids, query_start, num_computed, [0, 3], markers) == ([], [])


def test_unit_vector_checks_width():
    data = steer.encode_vector(torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(steer.unit_vector(data, 2), torch.tensor([0.6, 0.8]))
    assert steer.unit_vector(steer.encode_vector(torch.zeros(2)), 2).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="hidden size is 3"):
        steer.unit_vector(data, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steer_residual_is_the_hf_injection_on_the_stream(dtype):
    torch.manual_seed(0)
    T = 6
    hidden, residual = torch.randn(T, D).to(dtype), torch.randn(T, D).to(dtype)
    vectors = torch.randn(2, D)
    slot = torch.tensor([0, 2, 0, 0, 1, 0, 0, 0])  # longer than T, as the persistent buffer is
    table = torch.zeros(3, D)
    table[1:] = vectors[[1, 0]] / vectors[[1, 0]].norm(dim=-1, keepdim=True)
    new_hidden, new_residual = steer.steer_residual(hidden, residual, slot, table)
    stream = hidden + residual
    expected = nla_core.inject_norm_matched(stream[None], torch.tensor([[0, 1], [0, 4]]), vectors)[0]
    sites = torch.tensor([1, 4])
    torch.testing.assert_close((new_hidden + new_residual)[sites], expected[sites], rtol=0, atol=0)
    assert torch.equal(new_hidden[sites], torch.zeros(2, D, dtype=dtype))
    others = torch.tensor([0, 2, 3, 5])
    assert torch.equal(new_hidden[others], hidden[others]) and torch.equal(new_residual[others], residual[others])


def _new_request(req_id: str, position: int | None, vector: torch.Tensor | None = None):
    extra = None if position is None else {steer.EXTRA_ARGS_KEY: {"position": position, "vector": steer.encode_vector(vector)}}
    return SimpleNamespace(req_id=req_id, sampling_params=SimpleNamespace(extra_args=extra))


def test_steering_state_sets_this_steps_rows_and_clears_them_next_step(monkeypatch):
    state = steer.SteeringState(d_model=D, max_tokens=32, max_requests=4, device=torch.device("cpu"))
    va, vb = torch.randn(D), torch.randn(D)
    state.update_requests([_new_request("a", 2, va), _new_request("b", 1, vb), _new_request("u", None)], [])
    assert set(state.markers) == {"a", "b"} and state.busy
    # step 1: a and b prefill together (a: tokens 0..5, b: tokens 6..9)
    state.prepare_step(["a", "b"], np.array([0, 6, 10]), np.array([0, 0]), [0, 1])
    assert state.slot.nonzero().flatten().tolist() == [2, 7]
    torch.testing.assert_close(state.table[state.slot[2]], va / va.norm())
    torch.testing.assert_close(state.table[state.slot[7]], vb / vb.norm())
    # the op, as the compiled layer calls it, with this state active
    monkeypatch.setattr(steer, "_ACTIVE", state)
    hidden, residual = torch.randn(10, D), torch.randn(10, D)
    got = torch.ops.nla.steer_residual(hidden, residual)
    want = steer.steer_residual(hidden, residual, state.slot, state.table)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # step 2: both decode -> no marker, the old rows are cleared
    state.prepare_step(["a", "b"], np.array([0, 1, 2]), np.array([6, 4]), [])
    assert not state.slot.any()
    state.update_requests([], ["a", "b"])
    assert not state.busy


def test_steered_class_routes_the_layer_output_through_the_op(monkeypatch):
    class Layer(torch.nn.Module):
        def forward(self, positions, hidden_states, residual):
            return hidden_states * 2, hidden_states if residual is None else residual

    state = steer.SteeringState(d_model=D, max_tokens=8, max_requests=2, device=torch.device("cpu"))
    state.update_requests([_new_request("a", 1, torch.ones(D))], [])
    state.prepare_step(["a"], np.array([0, 3]), np.array([0]), [0])
    monkeypatch.setattr(steer, "_ACTIVE", state)
    layer = Layer()
    layer.__class__ = steer.steered_class(Layer)
    assert isinstance(layer, Layer) and steer.steered_class(Layer) is type(layer)
    assert steer.steering_installed(torch.nn.Sequential(layer)) and not steer.steering_installed(Layer())
    h = torch.randn(3, D)
    new_h, new_r = layer(None, h, None)
    stream = h * 2 + h
    assert torch.equal(new_h[[0, 2]], (h * 2)[[0, 2]])
    torch.testing.assert_close(new_r[1], stream[1] + stream[1].norm() * torch.ones(D) / math.sqrt(D))


# --------------------------------------------------------------------------- weight sync


def test_merged_buckets_equal_peft_merge_and_leave_the_actor_untouched():
    model = fixtures.tiny_lora_qwen3()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buckets = merged_weight_buckets(model)
    assert [name for name, _ in buckets] == ["other", "layers.0", "layers.1"]
    pushed = {n: t for _, bucket in buckets for n, t in bucket}
    assert sum(len(b) for _, b in buckets) == len(pushed)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(pushed) == set(reference)
    for name, tensor in pushed.items():
        assert tensor.device.type == "cpu" and tensor.dtype == reference[name].dtype
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6, msg=name)
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"], before[
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    ])
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    # copies, not views: writing into a pushed tensor cannot reach the actor
    pushed["model.norm.weight"].add_(1.0)
    assert torch.equal(model.get_parameter("base_model.model.model.norm.weight"), before["base_model.model.model.norm.weight"])


def test_merge_ignores_inactive_adapters_and_refuses_a_merged_one():
    from peft import LoraConfig

    model = fixtures.tiny_lora_qwen3()
    expected = {n: t for _, b in merged_weight_buckets(model) for n, t in b}
    model.add_adapter("reference", LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.reference" in name:
                p.normal_()
    got = {n: t for _, b in merged_weight_buckets(model) for n, t in b}
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    model.merge_adapter()
    with pytest.raises(ValueError, match="unmerge"):
        merged_weight_buckets(model)


def test_bf16_merge_rounds_once_from_float32():
    model = fixtures.tiny_lora_qwen3(torch.bfloat16)
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    got = {n: t for _, b in merged_weight_buckets(model) for n, t in b}["model.layers.1.self_attn.v_proj.weight"]
    exact = layer.base_layer.weight.double() + layer.scaling["default"] * (
        layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
    )
    assert got.dtype == torch.bfloat16
    # within half a bf16 ulp of the exact value: one rounding, not two
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


# --------------------------------------------------------------------------- embedding_replace in the plugin


def test_injection_row_of_each_style_matches_the_core():
    v = torch.randn(D) * 3
    data = steer.encode_vector(v)
    torch.testing.assert_close(steer.injection_row(data, D, style="residual_add", norm=None), v / v.norm())
    sites = torch.tensor([[0, 1]])
    for norm in (None, 150.0):
        want = nla_core.replace_at_sites(torch.zeros(1, 3, D), sites, v[None], norm=norm)[0, 1]
        assert torch.equal(steer.injection_row(data, D, style="embedding_replace", norm=norm), want)


def test_replace_rows_equals_replace_at_sites_and_keeps_other_rows():
    hidden = torch.randn(6, D, dtype=torch.bfloat16)
    table = torch.zeros(3, D)
    table[1], table[2] = torch.randn(D) * 5, torch.randn(D)
    slot = torch.tensor([0, 2, 0, 0, 1, 0, 0, 0])  # longer than T, as the persistent buffer is
    got = steer.replace_rows(hidden, slot, table)
    want = nla_core.replace_at_sites(hidden[None], torch.tensor([[0, 1], [0, 4]]), table[[2, 1]], norm=None)[0]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_embedding_style_layer_replaces_its_input_only_at_layer_0(monkeypatch):
    seen = []

    class Layer(torch.nn.Module):
        def forward(self, positions, hidden_states, residual):
            seen.append(hidden_states.clone())
            return hidden_states, hidden_states if residual is None else residual

    v = torch.randn(D)
    state = steer.SteeringState(d_model=D, max_tokens=8, max_requests=2, device=torch.device("cpu"),
                                style="embedding_replace", norm=7.0)
    state.update_requests([_new_request("a", 1, v)], [])
    state.prepare_step(["a"], np.array([0, 3]), np.array([0]), [0])
    monkeypatch.setattr(steer, "_ACTIVE", state)
    layer = Layer()
    layer.__class__ = steer.steered_class(Layer, "embedding_replace")
    assert steer.steered_class(Layer, "embedding_replace") is not steer.steered_class(Layer, "residual_add")
    h = torch.randn(3, D)
    layer(None, h, None)  # layer 0: residual is None, the embeddings are replaced at the marker
    torch.testing.assert_close(seen[-1][1], v / v.norm() * 7.0)
    assert torch.equal(seen[-1][[0, 2]], h[[0, 2]])
    layer(None, h, torch.zeros(3, D))  # a later call with a residual passes through
    assert torch.equal(seen[-1], h)
