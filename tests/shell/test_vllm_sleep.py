"""vLLM sleep mode in the rollout engine, against a fake `vllm` that behaves as vLLM 0.24's
sleep mode does (vllm/v1/worker/gpu_worker.py, vllm/device_allocator/cumem.py): level 1
keeps the weights (a CPU copy), level 2 discards them and every other tensor allocated
while the model loaded (our steering buffers included), both discard the KV cache, and
nothing may run or be written while the memory it needs is unmapped. The fake also takes
the pushes of an online-quantised (FP8) engine as vLLM's layerwise `reload_weights` does
(vllm/model_executor/model_loader/reload/layerwise.py): the stream's weights are buffered
per layer and finalised after its last one; its model is a single such layer."""

from __future__ import annotations

import enum
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import fixtures
import pytest
import torch

from nla_shell import cli
from nla_shell.engines import vllm_steering as steer
from nla_shell.engines.base import RolloutRequest, held_awake
from nla_shell.engines.vllm import VLLMRolloutEngine
from nla_shell.engines.weight_sync import merged_weight_buckets
from nla_shell.io.config import ConfigError
from nla_shell.models import Injector
from nla_shell.training.config import TrainConfig

MARKER, LEFT, RIGHT = 7, 5, 6


class FakeReloadInfo:
    """vLLM's LayerReloadingInfo while a layer waits for its weights: its checkpoint-format parameters
    (restore_metadata), the (name, arguments) of each weight that arrived (loaded_weights) and the
    (parameters, buffers) the model ran with, which finalisation writes into (kernel_tensors)."""

    def __init__(self, names: list[str], kernel: dict[str, torch.Tensor] | None = None) -> None:
        self.restore_metadata = ({name: None for name in names}, {})
        self.loaded_weights: list[tuple[str, None]] = []
        self.kernel_tensors = None if kernel is None else (kernel, {})

    def can_load(self) -> bool:
        return True


class FakeModel:
    """The worker's model: what `load_weights` wrote, and the steering state `_install` attaches.
    `names` are its parameters (None: whatever is pushed). While a reload runs, `reloading` is its
    one layer's reload info (vLLM's layerwise info of the model)."""

    def __init__(self, names: list[str] | None, d_model: int) -> None:
        self.names = names
        self.weights: dict[str, torch.Tensor] = {}
        self.reloading: FakeReloadInfo | None = None
        setattr(self, steer.STATE_ATTRIBUTE, steer.SteeringState(
            d_model=d_model, max_tokens=16, max_requests=4, device=torch.device("cpu")))

    def load_weights(self, weights):
        loaded = []
        for name, tensor in weights:
            self.weights[name] = tensor.clone()
            loaded.append(name)
            if self.reloading is not None:
                self.reloading.loaded_weights.append((name, None))
        return loaded

    def named_parameters(self):
        return ((name, None) for name in (self.weights if self.names is None else self.names))

    def named_modules(self):
        return iter([("", self)])


def fake_layerwise_info(layer: FakeModel):
    """vllm's get_layerwise_info: outside a reload (or once finalised) a layer loads nothing."""
    return getattr(layer, "reloading", None) or SimpleNamespace(can_load=lambda: False)


class FakeLLM:
    """vllm.LLM with sleep mode: logs every call; refuses work on unmapped memory. Its top-k probes (the
    steering canary's) read the vector: a steered probe's log-prob differs unless `steers` is False."""

    steers = True

    def __init__(self, log: list, names: list[str], d_model: int, **kwargs) -> None:
        self.log, self.kwargs = log, kwargs
        self.model = FakeModel(names, d_model)
        self.reloads: list[dict] = []
        """Each reload_weights call: its is_checkpoint_format and the names streamed, in order."""
        self.mapped = {"weights", "kv_cache"}
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(get_hidden_size=lambda: d_model),
            vllm_config=SimpleNamespace(
                cache_config=SimpleNamespace(enable_prefix_caching=kwargs.get("enable_prefix_caching", False))
            ),
            engine_core=SimpleNamespace(shutdown=lambda: log.append("shutdown")),
        )

    def apply_model(self, fn):
        if fn is steer.steering_installed:
            return [True]
        name = getattr(getattr(fn, "func", fn), "__name__", repr(fn))
        if name == "_load_weights":
            assert "weights" in self.mapped, "load_weights wrote into unmapped weight memory"
            self.log.append("push")
        elif name == "reset_steering":
            assert "weights" in self.mapped, "steering buffers reset while unmapped"
            self.log.append("reset_steering")
        elif name == "_unset_while_reloading":
            assert self.model.reloading is not None, "reload checked after vLLM finalised it"
        return [fn(self.model)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Only the worker's reload_weights: initialise the layerwise reload, model.load_weights(the
        iterator), finalise (the one layer is then reset); returns None per worker, as vLLM's does."""
        assert method == "reload_weights" and not args, (method, args)
        assert "weights" in self.mapped, "reload_weights wrote into unmapped weight memory"
        self.log.append("reload")
        self.model.reloading = FakeReloadInfo(self.model.names or [])
        self.model.load_weights(kwargs["weights_iterator"])
        streamed = [n for n, _ in self.model.reloading.loaded_weights]
        self.reloads.append({"is_checkpoint_format": kwargs["is_checkpoint_format"], "names": streamed})
        self.model.reloading = None
        return [None]

    def reset_prefix_cache(self) -> bool:
        return True

    def sleep(self, level: int = 1) -> None:
        self.log.append(("sleep", level))
        if level == 2:  # discarded: the memory comes back with whatever is in it
            for tensor in self.model.weights.values():
                tensor.fill_(float("nan"))
            state = getattr(self.model, steer.STATE_ATTRIBUTE)
            state.slot.fill_(3)
            state.table.fill_(float("nan"))
        self.mapped.clear()

    def wake_up(self, tags=None) -> None:
        self.log.append(("wake_up", tuple(tags or ("weights", "kv_cache"))))
        self.mapped.update(tags or ("weights", "kv_cache"))

    def generate(self, prompts, params, use_tqdm=False):
        assert self.mapped == {"weights", "kv_cache"}, f"generate with only {self.mapped} mapped"
        state = getattr(self.model, steer.STATE_ATTRIBUTE)
        assert not state.slot.any() and not state.table.isnan().any(), "steering buffers hold garbage"
        assert all(torch.isfinite(t).all() for t in self.model.weights.values()), "weights hold garbage"
        self.log.append("generate")
        self.generated_with = {k: v.clone() for k, v in self.model.weights.items()}
        outputs = []
        for prompt, p in zip(prompts, params):
            first = -1.5 if self.steers and p.logprobs and p.extra_args else -1.0
            completions = [SimpleNamespace(index=i, token_ids=[11, 12], logprobs=[{11: SimpleNamespace(logprob=first)},
                                                                                  {12: SimpleNamespace(logprob=-2.0)}])
                           for i in range(p.n)]
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=completions))
        return outputs


def install_fake_vllm(monkeypatch, log: list, names: list[str] | None, d_model: int) -> None:
    """`import vllm` gives FakeLLMs logging to `log`, for this test only."""
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kwargs: FakeLLM(log, names, d_model, **kwargs)
    fake.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    fake.TokensPrompt = dict
    fake.envs = SimpleNamespace(disable_envs_cache=lambda: None)
    monitor = types.ModuleType("vllm.compilation.monitor")
    monitor.set_cudagraph_capturing_enabled = lambda enabled: None
    attention = types.ModuleType("vllm.model_executor.layers.attention")
    attention.Attention = type("Attention", (), {})
    attention.MLAAttention = type("MLAAttention", (), {})
    layerwise = types.ModuleType("vllm.model_executor.model_loader.reload.layerwise")
    layerwise.get_layerwise_info = fake_layerwise_info
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = enum.Enum("RequestOutputKind", {"CUMULATIVE": 0, "DELTA": 1, "FINAL_ONLY": 2})
    modules = {"vllm": fake, "vllm.compilation.monitor": monitor, "vllm.model_executor.layers.attention": attention,
               "vllm.model_executor.model_loader.reload.layerwise": layerwise, "vllm.sampling_params": sampling}
    for name in list(modules):  # the packages above each module
        for depth in range(1, name.count(".") + 1):
            parent = name.rsplit(".", depth)[0]
            modules.setdefault(parent, types.ModuleType(parent))
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(steer, "register", lambda: None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # restored after the test
    monkeypatch.setenv("VLLM_LENS_DISABLE", "1")


@pytest.fixture
def make_engine(monkeypatch):
    """Builds VLLMRolloutEngines over FakeLLM; the actor they serve; the shared call log."""
    actor = fixtures.tiny_lora_qwen3()
    log: list = []
    install_fake_vllm(monkeypatch, log, [n for _, b in merged_weight_buckets(actor) for n, _ in b],
                      actor.config.hidden_size)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def build(sleep_level: int, quantization: str | None = None) -> VLLMRolloutEngine:
        return VLLMRolloutEngine("unused", SimpleNamespace(decode=lambda ids, **_: "text"), marker_id=MARKER,
                                 left_id=LEFT, right_id=RIGHT, eos_ids=[2], sleep_level=sleep_level,
                                 quantization=quantization)

    return build, actor, log


def _requests(d_model: int, n: int = 2) -> list[RolloutRequest]:
    prompt = (20, LEFT, MARKER, RIGHT, 21)
    return [RolloutRequest(prompt, torch.randn(d_model)) for _ in range(n)]


def _merged(actor) -> dict[str, torch.Tensor]:
    return {n: t for _, bucket in merged_weight_buckets(actor) for n, t in bucket}


def _bump_lora(actor) -> None:
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.add_(0.25)


def test_sleep_off_never_sleeps_wakes_or_empties_the_cache(make_engine):
    build, actor, log = make_engine
    engine = build(0)
    assert "enable_sleep_mode" not in engine.llm.kwargs
    engine.sync_weights(actor)
    engine.generate(_requests(actor.config.hidden_size), group_size=2, max_new_tokens=2)
    _bump_lora(actor)
    engine.sync_weights(actor)  # pushed at once
    engine.generate(_requests(actor.config.hidden_size), group_size=2, max_new_tokens=2)
    assert [e for e in log if e != "push"] == ["generate", "generate"]
    for name, tensor in _merged(actor).items():
        torch.testing.assert_close(engine.llm.generated_with[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("level", [1, 2])
def test_each_generation_wakes_pushes_after_the_weights_and_sleeps(make_engine, level):
    build, actor, log = make_engine
    d = actor.config.hidden_size
    engine = build(level)
    assert engine.llm.kwargs["enable_sleep_mode"] is True
    assert engine.sync_weights(actor) > 0  # awake after construction: pushed now
    pushes_at_start = log.count("push")
    rollouts = engine.generate(_requests(d), group_size=3, max_new_tokens=2)
    assert len(rollouts) == 6 and log[-1] == ("sleep", level)
    del log[:]

    # The trainer's update moves the actor, then syncs while vLLM sleeps: nothing is pushed yet.
    _bump_lora(actor)
    assert engine.sync_weights(actor) == 0.0 and "push" not in log
    engine.generate(_requests(d), group_size=2, max_new_tokens=2)
    batch = log[log.index("empty_cache") : log.index("generate") + 2]
    assert batch[0] == "empty_cache" and batch[1] == ("wake_up", ("weights",))
    expected_wake = ["reset_steering"] if level == 2 else []
    assert batch[2 : 2 + len(expected_wake)] == expected_wake
    pushes = batch.count("push")
    assert pushes == pushes_at_start  # the whole actor, once, between the two wake-ups
    # The push's freed buckets go back to the device before vLLM maps its KV cache.
    assert batch[2 + len(expected_wake) + pushes :] == ["empty_cache", ("wake_up", ("kv_cache",)), "generate",
                                                        ("sleep", level)]
    for name, tensor in _merged(actor).items():
        torch.testing.assert_close(engine.llm.generated_with[name], tensor, rtol=0, atol=0)
    assert set(engine.last_stats) == {"wake_s", "push_s", "generate_s", "sleep_s"}
    assert engine.last_stats["push_s"] > 0


def test_level_1_wakes_without_a_push_when_none_is_due_level_2_always_pushes(make_engine):
    build, actor, log = make_engine
    d = actor.config.hidden_size
    for level, pushes in ((1, 0), (2, 1)):
        engine = build(level)
        engine.sync_weights(actor)
        engine.generate(_requests(d), group_size=2, max_new_tokens=2)
        del log[:]
        engine.generate(_requests(d), group_size=2, max_new_tokens=2)  # no sync in between
        assert min(log.count("push"), 1) == pushes, (level, log)
        for name, tensor in _merged(actor).items():  # level 1 restored them, level 2 re-pushed them
            torch.testing.assert_close(engine.llm.generated_with[name], tensor, rtol=0, atol=0)


def test_one_wake_up_serves_a_block_of_calls(make_engine):
    build, actor, log = make_engine
    d = actor.config.hidden_size
    engine = build(2)
    engine.sync_weights(actor)
    engine.generate(_requests(d), group_size=2, max_new_tokens=2)
    del log[:]
    with held_awake(engine):
        engine.generate(_requests(d), group_size=2, max_new_tokens=2)
        engine.first_token_logprobs(_requests(d, 1)[0], steered=True)
    assert log.count(("wake_up", ("weights",))) == 1 and log.count(("sleep", 2)) == 1
    assert log.count("generate") == 2 and log[-1] == ("sleep", 2)


def test_level_2_without_any_synced_actor_refuses_to_generate_from_garbage(make_engine):
    build, actor, log = make_engine
    engine = build(2)
    engine.generate(_requests(actor.config.hidden_size), group_size=2, max_new_tokens=2)  # loaded weights, then sleep
    with pytest.raises(RuntimeError, match="call sync_weights"):
        engine.generate(_requests(actor.config.hidden_size), group_size=2, max_new_tokens=2)


def test_a_direct_push_into_a_sleeping_engine_is_refused(make_engine):
    build, actor, log = make_engine
    engine = build(1)
    engine.generate(_requests(actor.config.hidden_size), group_size=2, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.push_buckets(iter(merged_weight_buckets(actor)))


def test_steering_reset_zeroes_both_buffers():
    state = steer.SteeringState(d_model=4, max_tokens=8, max_requests=2, device=torch.device("cpu"))
    state.slot.fill_(5)
    state.table.fill_(float("nan"))
    model = torch.nn.Linear(2, 2)
    assert steer.reset_steering(model) is False  # no steering state: nothing to do
    setattr(model, steer.STATE_ATTRIBUTE, state)
    assert steer.reset_steering(model) is True
    assert not state.slot.any() and not state.table.any() and not state.busy


def test_engine_rejects_an_unknown_sleep_level():
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMRolloutEngine("unused", SimpleNamespace(), marker_id=1, left_id=2, right_id=3, sleep_level=3)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"vllm_sleep": 3}, "vllm_sleep"),
    ({"vllm_sleep": 2, "vllm_sync_every": 4}, "vllm_sync_every=1"),
])
def test_config_checks_the_sleep_level(overrides, message):
    base = dict(av_ckpt="a", ar_ckpt="b", rl_parquet="c.parquet", save_dir="d", engine="vllm")
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**base, **overrides)
    assert TrainConfig(**base, vllm_sleep=1, vllm_sync_every=4).vllm_sleep == 1


@pytest.mark.parametrize("level", [0, 2])
def test_train_wakes_once_per_rollout_and_eval_and_pushes_only_while_awake(nla_run_inputs, tmp_path, monkeypatch,
                                                                           level):
    """`nla train engine=vllm` over the fake: with vllm_sleep=2 each step's rollouts and canary
    share one wake-up (push included) and sleep after; the end-of-step sync waits for the next
    wake-up; the held-out eval wakes on its own. With 0: no sleep, no wake, a push per step."""
    log: list = []
    install_fake_vllm(monkeypatch, log, None, fixtures.D_MODEL)
    argv = fixtures.train_argv(nla_run_inputs, tmp_path / "run", engine="vllm", vllm_sleep=level, num_steps=2,
                               save_every=10)
    assert cli.main(argv) == 0  # the FakeLLM refused any push or generation on unmapped memory
    pushes = [i for i, e in enumerate(log) if e == "push"]
    initial = log.index("generate")  # the first push, made at start-up, counts its buckets
    buckets = len([i for i in pushes if i < initial])
    if level == 0:
        assert not [e for e in log if isinstance(e, tuple)]
        assert len(pushes) == buckets * 3  # start-up + after each of the 2 steps
        return
    blocks, current = [], []
    for entry in log:
        current.append(entry)
        if entry == ("sleep", 2):
            blocks.append(current)
            current = []
    # step 0 rollouts, its eval (eval_every=2), step 1 rollouts, the final eval; then shut down.
    assert len(blocks) == 4 and current == ["shutdown"]
    assert [b.count("generate") for b in blocks] == [3, 1, 3, 1]  # rollouts + the canary's 2 probes; eval
    for block in blocks[1:]:
        assert block[:2] == [("wake_up", ("weights",)), "reset_steering"]
        assert block[2 : 2 + buckets] == ["push"] * buckets
        assert block[2 + buckets] == ("wake_up", ("kv_cache",))
    assert blocks[0].count(("wake_up", ("weights",))) == 0  # awake since start-up
    # The push made at each wake-up is the sync phase's (it was counted in the rollout's, time_sync read 0).
    metrics = fixtures.read_metrics(tmp_path / "run")
    assert all(line["time_sync"] > 0 for line in metrics[1:]), metrics
    assert all(line["steering_canary"] == 0.5 for line in metrics)


def test_a_steering_canary_failing_three_steps_in_a_row_stops_the_run(nla_run_inputs, tmp_path, monkeypatch, capsys):
    """An engine whose vector reaches nothing (the canary reads 0): two warnings, then at the third step one
    error line and exit 2, before that step's update (and no checkpoint); vllm_canary=warn trains on."""
    install_fake_vllm(monkeypatch, [], None, fixtures.D_MODEL)
    monkeypatch.setattr(FakeLLM, "steers", False)
    save_dir = tmp_path / "run"
    argv = fixtures.train_argv(nla_run_inputs, save_dir, engine="vllm", num_steps=5, eval_every=0, save_every=10)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0] for line in err[:2]] == ["[warn] step 0", "[warn] step 1"] and len(err) == 3, err
    assert err[-1].startswith("nla train: error: steering canary failed at steps 0, 1, 2 (read 0.0)"), err
    assert "vllm_canary=warn" in err[-1]
    assert [line["step"] for line in fixtures.read_metrics(save_dir)] == [0, 1]  # step 2 never trained
    assert not list(save_dir.glob("step_*"))
    assert cli.main([*argv, "vllm_canary=warn", "num_steps=3"]) == 0  # the stopped run's save_dir takes it
    assert [line["steering_canary"] for line in fixtures.read_metrics(save_dir)] == [0.0, 0.0, 0.0]


def test_the_canary_watch_stops_only_on_failures_in_a_row():
    from nla_shell.training.stopped import RunSpoiledError
    from nla_shell.training.canary import CanaryWatch

    watch = CanaryWatch(stop=True)
    assert watch.check(0, 0.0) is not None and watch.check(1, float("nan")) is not None
    assert watch.check(2, 0.3) is None  # a steered step resets the count
    assert watch.check(3, 0.0) and watch.check(4, 0.0)
    with pytest.raises(RunSpoiledError, match="steps 3, 4, 5"):
        watch.check(5, 0.0)
    warn = CanaryWatch(stop=False)
    assert all("keeps going" in warn.check(step, 0.0) for step in range(10))


def test_the_canary_reading_is_finite_and_zero_only_when_nothing_moved():
    from nla_shell.engines.vllm import canary_reading

    plain = {1: -0.5, 2: -1.5, 3: -3.0}
    assert canary_reading(plain, dict(plain)) == 0.0
    assert canary_reading({1: -0.7, 2: -1.5, 3: -3.0}, plain) == pytest.approx(0.2)
    # No shared token (the old canary read inf): the steered top token lies 2.5 above the plain list's floor.
    assert canary_reading({7: -0.5, 8: -2.0}, plain) == pytest.approx(2.5)
    assert math.isnan(canary_reading({1: float("nan"), 2: -1.0}, plain))
    assert math.isnan(canary_reading({}, plain))


@pytest.mark.parametrize("flag", ["true", "false"])
def test_train_builds_vllm_with_salted_prefix_caching_as_configured(nla_run_inputs, tmp_path, monkeypatch, flag):
    """vllm_prefix_caching (default on), vllm_max_seqs and vllm_kv_cache_gib (vLLM's kv_cache_memory_bytes, unset
    by default) reach vllm.LLM; every rollout prompt carries its injection's salt, so a group's samples share
    their prompt's blocks and no two injections share one."""
    log: list = []
    install_fake_vllm(monkeypatch, log, None, fixtures.D_MODEL)
    built, prompts = [], []
    make_llm = sys.modules["vllm"].LLM

    def recording_llm(**kwargs):
        llm = make_llm(**kwargs)
        built.append(kwargs)
        generate = llm.generate
        llm.generate = lambda batch, params, use_tqdm=False: (prompts.extend(batch), generate(batch, params))[1]
        return llm

    monkeypatch.setattr(sys.modules["vllm"], "LLM", recording_llm)
    overrides = {} if flag == "true" else {"vllm_prefix_caching": flag, "vllm_max_seqs": 96, "vllm_kv_cache_gib": 1.5}
    argv = fixtures.train_argv(nla_run_inputs, tmp_path / "run", engine="vllm", num_steps=1, eval_every=0, **overrides)
    assert cli.main(argv) == 0
    assert [(kwargs["enable_prefix_caching"], kwargs["max_num_seqs"], kwargs.get("kv_cache_memory_bytes"))
            for kwargs in built] == [(True, 1024, None) if flag == "true" else (False, 96, 3 * 2**29)]
    steered = [p for p in prompts if "cache_salt" in p]
    assert steered and all(p["cache_salt"].startswith("nla-steer-") for p in steered)


def test_train_under_torchrun_runs_one_vllm_engine_per_rank(nla_run_inputs, tmp_path):
    """engine=vllm under torchrun (2 gloo ranks, the fake vLLM in each): every rank builds an engine
    of its own through vLLM's external_launcher executor, with a seed of its own and decode graphs
    captured up to its max_num_seqs; the run trains to the end; and no rank calls vLLM's shutdown
    (it would destroy the job's process group, which the trainer still uses)."""
    save_dir = tmp_path / "run"
    argv = fixtures.train_argv(nla_run_inputs, save_dir, engine="vllm", num_steps=2, eval_every=0, save_every=2,
                               vllm_max_seqs=600)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               str(tmp_path), *argv]
    tests = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    built = [json.loads((tmp_path / f"vllm_rank{r}.json").read_text()) for r in range(2)]
    assert [b["kwargs"]["distributed_executor_backend"] for b in built] == ["external_launcher"] * 2
    assert built[0]["kwargs"]["seed"] != built[1]["kwargs"]["seed"]
    # 600 sequences decode together: vLLM is told to capture graphs that large (its default stops at 512).
    assert all(b["kwargs"]["compilation_config"] == {"max_cudagraph_capture_size": 600} for b in built)
    assert all("generate" in b["log"] and "shutdown" not in b["log"] for b in built)
    assert [line["step"] for line in fixtures.read_metrics(save_dir)] == [0, 1]


def test_an_engine_in_a_torchrun_process_without_a_job_group_sets_up_its_own_store(make_engine, monkeypatch):
    """A 1-rank torchrun process (no job group: vLLM forms its own): vLLM is built with torchrun's
    agent-store switch hidden, else torch would wait on a store server nobody starts; the switch is
    back afterwards."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    seen = []
    make_llm = sys.modules["vllm"].LLM
    monkeypatch.setattr(sys.modules["vllm"], "LLM",
                        lambda **kwargs: (seen.append(os.environ.get("TORCHELASTIC_USE_AGENT_STORE")), make_llm(**kwargs))[1])
    build, _, _ = make_engine
    build(0)
    assert seen == [None] and os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


# --------------------------------------------------------------------------- FP8 rollouts (vllm_quantization)


def _merged_names(actor) -> list[str]:
    return [name for _, bucket in merged_weight_buckets(actor) for name, _ in bucket]


def test_a_quantised_engine_takes_each_push_as_one_reload_of_every_bucket_in_order(make_engine):
    """quantization="fp8" reaches vllm.LLM; a push is one reload_weights of checkpoint-format weights that
    streams every bucket's pairs in bucket order (no per-bucket load); the values generated with are the
    actor's; the bf16 engine beside it never reloads and passes quantization=None."""
    build, actor, log = make_engine
    plain = build(0)
    plain.sync_weights(actor)
    assert plain.llm.kwargs["quantization"] is None
    assert plain.llm.reloads == [] and "reload" not in log and log.count("push") == len(merged_weight_buckets(actor))
    del log[:]

    engine = build(0, quantization="fp8")
    assert engine.llm.kwargs["quantization"] == "fp8"
    for push in range(2):
        assert engine.sync_weights(actor) > 0
        assert log == ["reload"] * (push + 1)  # once per push, and nothing loaded bucket by bucket
        assert engine.llm.reloads[push] == {"is_checkpoint_format": True, "names": _merged_names(actor)}
        engine.generate(_requests(actor.config.hidden_size), group_size=2, max_new_tokens=2)
        for name, tensor in _merged(actor).items():
            torch.testing.assert_close(engine.llm.generated_with[name], tensor, rtol=0, atol=0)
        log.remove("generate")
        _bump_lora(actor)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_push_that_leaves_a_vllm_parameter_unset_raises(make_engine, quantization):
    build, actor, _ = make_engine
    engine = build(0, quantization=quantization)
    engine.llm.model.names = [*engine.llm.model.names, "model.layers.0.mlp.extra.weight"]
    with pytest.raises(RuntimeError, match=r"left 1 vLLM parameters unset.*model\.layers\.0\.mlp\.extra\.weight"):
        engine.sync_weights(actor)


def test_the_reload_check_names_the_parameters_that_a_waiting_layer_never_got(monkeypatch):
    """Inside the reload, after the last weight: a processed layer (its info reset) is complete; a waiting
    layer names each checkpoint parameter that did not arrive, unless its kernel tensor is one the push
    writes through another layer (an lm_head sharing the embeddings' parameter); attention (finalised later,
    its KV scales are never pushed) and buffer-only layers (rotary tables) are not asked for any."""
    install_fake_vllm(monkeypatch, [], None, 4)
    from nla_shell.engines.vllm_process import _unset_while_reloading

    def waiting(module, names, arrived, kernel=None):
        module.reloading = FakeReloadInfo(names, kernel)
        module.reloading.loaded_weights = [(name, None) for name in arrived]
        return module

    attention = type("FakeAttention", (torch.nn.Module, sys.modules["vllm.model_executor.layers.attention"].Attention), {})
    model = torch.nn.Module()
    model.processed = torch.nn.Linear(2, 2)
    model.padded = waiting(torch.nn.Linear(2, 2, bias=False), ["weight"], ["weight"])  # part of its rows loaded
    model.partial = waiting(torch.nn.Linear(2, 2), ["weight", "bias"], ["weight"])
    model.attn = waiting(attention(), ["k_scale", "v_scale"], [])
    model.rotary = waiting(torch.nn.Module(), [], [])
    model.embed = torch.nn.Embedding(4, 2)  # processed: its weight is the kernel tensor again
    model.lm_head = waiting(torch.nn.Module(), ["weight"], [], kernel={"weight": model.embed.weight})
    model.untied = waiting(torch.nn.Module(), ["weight"], [], kernel={"weight": torch.nn.Parameter(torch.ones(2))})
    assert _unset_while_reloading(model) == ["partial.bias", "untied.weight"]
    model.partial.reloading.loaded_weights.append(("bias", None))
    model.untied.reloading.loaded_weights.append(("weight", None))
    assert _unset_while_reloading(model) == []


def test_a_reload_that_stops_reading_the_push_early_raises(make_engine, monkeypatch):
    """reload_weights returns nothing: a model that read only part of the stream must not pass for a push."""
    build, actor, _ = make_engine
    engine = build(0, quantization="fp8")
    monkeypatch.setattr(FakeModel, "load_weights", lambda self, weights: [next(iter(weights))[0]])
    with pytest.raises(RuntimeError, match="before reading the whole weight push"):
        engine.sync_weights(actor)


def test_a_quantised_engine_refuses_tensor_parallelism(make_engine):
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        VLLMRolloutEngine("unused", SimpleNamespace(), marker_id=1, left_id=2, right_id=3, tensor_parallel_size=2,
                          quantization="fp8")


@pytest.mark.parametrize("level", [1, 2])
def test_a_quantised_engine_pushes_at_the_wake_up_by_one_reload(make_engine, level):
    build, actor, log = make_engine
    d = actor.config.hidden_size
    engine = build(level, quantization="fp8")
    engine.sync_weights(actor)
    engine.generate(_requests(d), group_size=2, max_new_tokens=2)
    del log[:]
    _bump_lora(actor)
    assert engine.sync_weights(actor) == 0.0 and log == []  # asleep: marked due
    engine.generate(_requests(d), group_size=2, max_new_tokens=2)
    woken = ["reset_steering"] if level == 2 else []
    assert log == ["empty_cache", ("wake_up", ("weights",)), *woken, "reload", "empty_cache", ("wake_up", ("kv_cache",)),
                   "generate", ("sleep", level)]
    for name, tensor in _merged(actor).items():
        torch.testing.assert_close(engine.llm.generated_with[name], tensor, rtol=0, atol=0)


def test_help_lists_vllm_quantization_and_what_to_watch(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--vllm-quantization" in text
    for phrase in ("fp8_per_channel", "fp8_per_block", "logp_diff_mean", "tis_frac", "not in the reference"):
        assert phrase in text, phrase
    assert TrainConfig(av_ckpt="a", ar_ckpt="b", rl_parquet="c", save_dir="d").vllm_quantization == "none"


@pytest.mark.parametrize(("overrides", "fix"), [
    ({"engine": "hf"}, "set engine=vllm"),
    ({"engine": "native"}, "set engine=vllm"),
    ({"engine": "vllm", "vllm_tp": 2}, "use vllm_tp=1"),
])
def test_train_refuses_fp8_where_it_cannot_run_in_one_line_writing_nothing(tmp_path, capsys, overrides, fix):
    save_dir = tmp_path / "run"
    inputs = (tmp_path / "av", tmp_path / "ar", tmp_path / "rl.parquet")
    assert cli.main(fixtures.train_argv(inputs, save_dir, vllm_quantization="fp8", **overrides)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'vllm_quantization' = 'fp8'" in err and fix in err, err
    assert not save_dir.exists()


def test_train_rolls_out_with_fp8_pushing_by_reload(nla_run_inputs, tmp_path, monkeypatch):
    """`nla train engine=vllm vllm_quantization=fp8` over the fake: vLLM is built with quantization="fp8",
    and the start-up push and each step's are one reload each (no bucket loads)."""
    log: list = []
    install_fake_vllm(monkeypatch, log, None, fixtures.D_MODEL)
    built = []
    make_llm = sys.modules["vllm"].LLM
    monkeypatch.setattr(sys.modules["vllm"], "LLM", lambda **kwargs: (built.append(kwargs), make_llm(**kwargs))[1])
    argv = fixtures.train_argv(nla_run_inputs, tmp_path / "run", engine="vllm", vllm_quantization="fp8", num_steps=2,
                               eval_every=0, save_every=10)
    assert cli.main(argv) == 0
    assert [kwargs["quantization"] for kwargs in built] == ["fp8"]
    assert log.count("reload") == 3 and "push" not in log  # start-up + after each of the 2 steps
    assert [line["step"] for line in fixtures.read_metrics(tmp_path / "run")] == [0, 1]


@pytest.mark.parametrize(("setting", "reloads"), [("none", 0), ("fp8", 1)])
def test_the_reader_builds_its_vllm_engine_with_the_quantization_asked(make_engine, tmp_path, capsys, setting, reloads):
    """`nla explain`/`nla serve` take vllm_quantization too (in --help): the reader's engine is built with it and
    its one push is a reload exactly when quantised."""
    from nla_shell.serving import reader

    _, actor, log = make_engine
    actor.config.save_pretrained(tmp_path)  # the AV base dir vLLM would load (its generation config read here)
    injector = Injector(actor, marker_id=MARKER, left_id=LEFT, right_id=RIGHT)
    tokenizer = SimpleNamespace(decode=lambda ids, **_: "text", eos_token_id=2)
    engine = reader.make_engine("vllm", actor, injector, tokenizer, av=str(tmp_path), max_batch=8,
                                vllm_gpu_mem=0.5, vllm_max_len=64, vllm_quantization=setting)
    assert engine.llm.kwargs["quantization"] == (None if setting == "none" else setting)
    assert (engine.marker_id, engine.injection_layer) == (MARKER, injector.layer_index)  # the injector's steering
    assert log.count("reload") == reloads and (log.count("push") > 0) == (reloads == 0)
    with pytest.raises(SystemExit):
        cli.main(["explain", "--help"])
    assert "--vllm-quantization" in capsys.readouterr().out


if __name__ == "__main__":
    # A torchrun rank of the test above: `nla train` over the fake vLLM; writes what it built.
    torch.set_num_threads(1)
    out_dir, calls, built = Path(sys.argv[1]), [], []
    with pytest.MonkeyPatch.context() as patch:
        install_fake_vllm(patch, calls, None, fixtures.D_MODEL)
        make_llm = sys.modules["vllm"].LLM
        patch.setattr(sys.modules["vllm"], "LLM", lambda **kwargs: (built.append(kwargs), make_llm(**kwargs))[1])
        code = cli.main(sys.argv[2:])
    (out_dir / f"vllm_rank{os.environ['RANK']}.json").write_text(json.dumps(
        {"kwargs": {k: v for k, v in built[0].items() if k != "additional_config"},
         "log": sorted({c if isinstance(c, str) else c[0] for c in calls})}, default=str))
    sys.exit(code)
