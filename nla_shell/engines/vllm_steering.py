"""A vLLM plugin: the activation injection, in either style, inside the compiled graph.

Why not vllm-lens: it forces `enforce_eager` (CUDA graphs off) and runs a Python forward
hook on every decoder layer at every step, looping over every request in the batch (see
vllm_lens/_worker_ext.py `_hook_inner`); that is what makes steered decode 10-45x slower
than vLLM's own best case. The marker lives in the prompt, so the injection is needed
only in the forward that computes the marker's position (a prefill chunk).

Design:
  * The chosen layer's class is swapped for a subclass whose forward ends in one opaque
    custom op, `nla::steer_residual(hidden, residual)`. It is always in the graph, so
    torch.compile and every CUDA-graph mode (piecewise and full) keep working.
  * The op reads two persistent buffers: `slot[T]` (int64, per flattened token: 0 = none,
    k = row k of `table`) and `table[R, D]` (float32 unit vectors, row 0 = zeros). A
    captured graph reads them by address, so whatever they hold at replay is applied.
  * Once per step, before the forward, the runner hook writes the rows of this step's
    marker tokens (at most one per steered request, only in the chunk that contains its
    marker) and clears last step's rows. Pure-decode steps write nothing: the op then
    adds exactly zero and no Python runs inside the step.
  * Vectors reach the worker in `SamplingParams.extra_args[EXTRA_ARGS_KEY]` as
    {"position": int, "vector": float32 bytes}: plain msgpack types, so they survive the
    multiprocess engine's serialisation and the shallow copy that `n > 1` makes per child.

At a marker row, with stream h = hidden + residual (vLLM's fused-residual layers hand the
stream over in two halves), the op returns hidden' = 0 and residual' = round(h + ||h|| u),
u = v / ||v||, norms in float32: the next layer's fused add then sees exactly the HF-side
`nla_core.inject_norm_matched(h)`. Every other row is returned bit-identical.

Style "embedding_replace" (kitft) instead swaps decoder layer 0 for a subclass whose
forward first passes its input through `nla::replace_embedding(hidden)`: at marker rows
the input embedding (vLLM applies embedding scales such as Gemma's sqrt(D) before layer 0)
becomes table[slot] = v / (||v|| / norm), kitft's normalize_activation, or v when norm is
None; `nla_core.replace_at_sites` on the HF side.

Enabling: pass `additional_config={CONFIG_KEY: {"layer": L, "style": S, "norm": N}}` to vLLM
("style" and "norm" default to residual_add and None), and have
`register()` run in every process that hosts a worker: call it directly for the in-process
engine, or install it as the `vllm.general_plugins` entry point
`nla_steering = "nla_shell.engines.vllm_steering:register"` for spawned workers. Engines
without the config key are untouched. The config key also separates vLLM's torch.compile
cache from unsteered engines'.

Importable without vLLM (torch and numpy only), so the pure parts run in CPU tests.
"""

from typing import Mapping, Sequence

import numpy as np
import torch

EXTRA_ARGS_KEY = "nla_steer"
"""SamplingParams.extra_args key carrying {"position": int, "vector": bytes}."""
CONFIG_KEY = "nla_steering"
"""vLLM additional_config key carrying {"layer": int, "style": str, "norm": float | None}; its presence turns the plugin on."""
STEERED_CLASS_PREFIX = "NLASteered"
STATE_ATTRIBUTE = "_nla_steering"
"""Attribute of the runner and of its model holding the SteeringState (the model's copy is
what `LLM.apply_model` functions such as `reset_steering` reach)."""


def encode_vector(vector: torch.Tensor) -> bytes:
    """Any-shape activation with D elements -> D little-endian float32 values as bytes."""
    return vector.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy().astype("<f4").tobytes()


def unit_vector(data: bytes, d_model: int) -> torch.Tensor:
    """Bytes from `encode_vector` -> [D] float32 v / max(||v||, 1e-12), as nla_core normalises."""
    v = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
    if v.numel() != d_model:
        raise ValueError(f"steering vector has {v.numel()} values but the model's hidden size is {d_model}")
    return v / v.norm().clamp_min(1e-12)


def injection_row(data: bytes, d_model: int, *, style: str, norm: float | None) -> torch.Tensor:
    """Bytes from `encode_vector` -> the [D] float32 table row of a style: the unit vector
    (residual_add), or the vector at L2 norm `norm` as nla_core.replace_at_sites computes it
    (embedding_replace; the vector itself when norm is None)."""
    if style == "residual_add":
        return unit_vector(data, d_model)
    v = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
    if v.numel() != d_model:
        raise ValueError(f"steering vector has {v.numel()} values but the model's hidden size is {d_model}")
    return v if norm is None else v / (v.norm().clamp_min(1e-12) / norm)


def marker_rows(
    req_ids: Sequence[str],
    query_start: np.ndarray,
    num_computed: np.ndarray,
    candidates: Sequence[int],
    markers: Mapping[str, int],
) -> tuple[list[int], list[str]]:
    """Rows of this step's flattened tokens that are a steered request's marker.

    Batch entry i covers tokens [query_start[i], query_start[i+1]) at positions
    num_computed[i] + 0, 1, ...; its marker is in this step iff that range holds it.

    Args:
      req_ids: [N] request id of each batch entry.
      query_start: [>= N+1] token offsets of the entries.
      num_computed: [N] tokens each entry had computed before this step.
      candidates: batch indices worth checking (those still prefilling).
      markers: request id -> marker position, for steered requests only.
    Returns:
      (rows, request ids), one pair per marker found, in candidate order.
    """
    rows: list[int] = []
    hits: list[str] = []
    for i in candidates:
        req_id = req_ids[i]
        position = markers.get(req_id)
        if position is None:
            continue
        offset = position - int(num_computed[i])
        if 0 <= offset < int(query_start[i + 1]) - int(query_start[i]):
            rows.append(int(query_start[i]) + offset)
            hits.append(req_id)
    return rows, hits


def steer_residual(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    slot: torch.Tensor,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inject table[slot[t]] at every token t with slot[t] > 0; others pass through unchanged.

    Args:
      hidden, residual: [T, D] the two halves of the stream h = hidden + residual.
      slot: [>= T] int64 row of `table` per token (0 = no injection).
      table: [R, D] float32 unit vectors, row 0 zeros.
    Returns:
      (hidden', residual'), [T, D] each: at injected tokens (0, round(h + ||h|| u)).
    """
    index = slot[: hidden.shape[0]]
    stream = (hidden + residual).float()
    injected = (stream + stream.norm(dim=-1, keepdim=True) * table.index_select(0, index)).to(residual.dtype)
    at_marker = (index > 0).unsqueeze(-1)
    return torch.where(at_marker, torch.zeros_like(hidden), hidden), torch.where(at_marker, injected, residual)


def replace_rows(hidden: torch.Tensor, slot: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[slot[t]] (rounded to hidden's dtype) at every token t with slot[t] > 0; others unchanged.

    Args:
      hidden: [T, D] the input embeddings of layer 0.
      slot: [>= T] int64 row of `table` per token (0 = no injection).
      table: [R, D] float32 vectors at their target norm, row 0 zeros.
    Returns:
      [T, D] in hidden's dtype.
    """
    index = slot[: hidden.shape[0]]
    return torch.where((index > 0).unsqueeze(-1), table.index_select(0, index).to(hidden.dtype), hidden)


class SteeringState:
    """One engine's steering bookkeeping in a worker: vectors by request, and the two buffers."""

    def __init__(
        self,
        *,
        d_model: int,
        max_tokens: int,
        max_requests: int,
        device: torch.device,
        style: str = "residual_add",
        norm: float | None = None,
    ) -> None:
        self.d_model = d_model
        self.style, self.norm = style, norm
        self.device = torch.device(device)
        self.slot = torch.zeros(max_tokens, dtype=torch.int64, device=self.device)
        self.table = torch.zeros(max_requests + 1, d_model, dtype=torch.float32, device=self.device)
        self.markers: dict[str, int] = {}
        self.units: dict[str, torch.Tensor] = {}
        self._stale: torch.Tensor | None = None

    def reset(self) -> None:
        """Zero both buffers and forget rows to clear. They are allocated while vLLM loads the
        model, so sleep mode tags them as weights: level 2 unmaps them and wake-up maps
        fresh memory of undefined content (a garbage slot would steer, or index, at random)."""
        self.slot.zero_()
        self.table.zero_()
        self._stale = None

    @property
    def busy(self) -> bool:
        """True when a step could need work: live steered requests, or rows left to clear."""
        return bool(self.markers) or self._stale is not None

    def update_requests(self, new_requests: Sequence, finished_ids: Sequence[str]) -> None:
        """Register the steered ones among new requests (vLLM NewRequestData); forget finished ids."""
        for request in new_requests:
            params = request.sampling_params
            spec = (params.extra_args or {}).get(EXTRA_ARGS_KEY) if params is not None else None
            if spec is not None:
                self.markers[request.req_id] = int(spec["position"])
                self.units[request.req_id] = injection_row(spec["vector"], self.d_model, style=self.style, norm=self.norm)
        for req_id in finished_ids:
            self.markers.pop(req_id, None)
            self.units.pop(req_id, None)

    def prepare_step(
        self,
        req_ids: Sequence[str],
        query_start: np.ndarray,
        num_computed: np.ndarray,
        candidates: Sequence[int],
    ) -> None:
        """Point this step's marker tokens at their unit vectors; clear the previous step's.

        The writes are queued on the current stream, so a step still running on the GPU
        reads the values it was launched with.
        """
        rows, hits = marker_rows(req_ids, query_start, num_computed, candidates, self.markers)
        if self._stale is not None:
            self.slot.index_fill_(0, self._stale, 0)
            self._stale = None
        if not rows:
            return
        k = len(rows)
        if k >= self.table.shape[0]:
            raise RuntimeError(f"{k} markers in one step but the steering table holds {self.table.shape[0] - 1}")
        index = self._upload(torch.tensor(rows + list(range(1, k + 1)), dtype=torch.int64))
        self.table[1 : k + 1].copy_(self._upload(torch.stack([self.units[r] for r in hits])), non_blocking=True)
        self.slot.index_copy_(0, index[:k], index[k:])
        self._stale = index[:k]

    def _upload(self, cpu: torch.Tensor) -> torch.Tensor:
        # Pinned + non_blocking keeps async scheduling's overlap: no host sync on the step.
        if self.device.type != "cuda":
            return cpu.to(self.device)
        return cpu.pin_memory().to(self.device, non_blocking=True)


_ACTIVE: SteeringState | None = None
"""The state of the engine whose step is being built in this process (set per step)."""


@torch.library.custom_op("nla::steer_residual", mutates_args=())
def _steer_residual_op(hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Opaque to torch.compile; under a CUDA graph it runs at capture and its kernels,
    # which read the state's buffers by address, are replayed.
    if _ACTIVE is None:
        raise RuntimeError("nla::steer_residual ran with no active steering state (was register() called?)")
    return steer_residual(hidden, residual, _ACTIVE.slot, _ACTIVE.table)


@_steer_residual_op.register_fake
def _(hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(hidden), torch.empty_like(residual)


@torch.library.custom_op("nla::replace_embedding", mutates_args=())
def _replace_embedding_op(hidden: torch.Tensor) -> torch.Tensor:
    if _ACTIVE is None:
        raise RuntimeError("nla::replace_embedding ran with no active steering state (was register() called?)")
    return replace_rows(hidden, _ACTIVE.slot, _ACTIVE.table)


@_replace_embedding_op.register_fake
def _(hidden: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(hidden)


_STEERED_CLASSES: dict[tuple[type, str], type] = {}


def steered_class(base: type, style: str = "residual_add") -> type:
    """A subclass of a decoder-layer class: its (hidden, residual) output goes through
    nla::steer_residual (residual_add), or its input embeddings through
    nla::replace_embedding (embedding_replace; layer 0 only, where residual is None)."""
    cls = _STEERED_CLASSES.get((base, style))
    if cls is None:
        base_forward = base.forward

        if style == "residual_add":

            def forward(self, positions, hidden_states, residual, **kwargs):
                hidden_states, residual = base_forward(self, positions, hidden_states, residual, **kwargs)
                return torch.ops.nla.steer_residual(hidden_states, residual)

        else:

            def forward(self, positions, hidden_states, residual, **kwargs):
                if residual is None:  # layer 0: hidden_states are the input embeddings
                    hidden_states = torch.ops.nla.replace_embedding(hidden_states)
                return base_forward(self, positions, hidden_states, residual, **kwargs)

        cls = type(f"{STEERED_CLASS_PREFIX}{base.__name__}", (base,), {"forward": forward})
        _STEERED_CLASSES[(base, style)] = cls
    return cls


def steering_installed(model: torch.nn.Module) -> bool:
    """True iff a decoder layer of `model` was swapped for its steered class (for apply_model)."""
    return any(type(m).__name__.startswith(STEERED_CLASS_PREFIX) for m in model.modules())


def reset_steering(model: torch.nn.Module) -> bool:
    """For `LLM.apply_model` after a level-2 wake-up: zero the model's steering buffers.
    True when the model carries steering state."""
    state = getattr(model, STATE_ATTRIBUTE, None)
    if state is None:
        return False
    state.reset()
    return True


def _install(runner) -> None:
    """After load_model: swap the configured layer's class and give the runner its state."""
    global _ACTIVE
    extra = runner.vllm_config.additional_config
    config = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if config is None:
        return
    from vllm.model_executor.models.utils import PPMissingLayer

    style, norm = config.get("style", "residual_add"), config.get("norm")
    layer = runner.get_model().model.layers[0 if style == "embedding_replace" else int(config["layer"])]
    if isinstance(layer, PPMissingLayer):
        return  # another pipeline stage holds the layer
    max_tokens = max(
        runner.max_num_tokens,
        runner.vllm_config.compilation_config.max_cudagraph_capture_size or 0,
    )
    state = SteeringState(
        d_model=runner.vllm_config.model_config.get_hidden_size(),
        max_tokens=max_tokens,
        max_requests=runner.max_num_reqs,
        device=runner.device,
        style=style,
        norm=norm,
    )
    layer.__class__ = steered_class(type(layer), style)
    setattr(runner, STATE_ATTRIBUTE, state)
    setattr(runner.get_model(), STATE_ATTRIBUTE, state)
    # Profiling and CUDA-graph capture follow load_model before any execute_model.
    _ACTIVE = state


def _activate(runner, scheduler_output) -> SteeringState | None:
    global _ACTIVE
    state = getattr(runner, STATE_ATTRIBUTE, None)
    if state is not None:
        _ACTIVE = state
        state.update_requests(scheduler_output.scheduled_new_reqs, scheduler_output.finished_req_ids)
    return state


def _wrap_load_model(cls) -> None:
    original = cls.load_model

    def load_model(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _install(self)

    cls.load_model = load_model


def _wrap_execute_model(cls) -> None:
    original = cls.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        _activate(self, scheduler_output)
        return original(self, scheduler_output, *args, **kwargs)

    cls.execute_model = execute_model


def _patch_v1(cls) -> None:
    """V1 runner: `_model_forward` is its documented per-step hook; the layout is final there."""
    _wrap_load_model(cls)
    _wrap_execute_model(cls)
    original = cls._model_forward

    def _model_forward(self, *args, **kwargs):
        state = getattr(self, STATE_ATTRIBUTE, None)
        if state is not None and state.busy:
            batch = self.input_batch
            n = batch.num_reqs
            num_computed = batch.num_computed_tokens_cpu[:n]
            prefilling = np.flatnonzero(num_computed < batch.num_prompt_tokens[:n])
            state.prepare_step(batch.req_ids, self.query_start_loc.np, num_computed, prefilling)
        return original(self, *args, **kwargs)

    cls._model_forward = _model_forward


def _patch_v2(cls) -> None:
    """V2 runner: `prepare_inputs` returns the step's layout just before the forward."""
    _wrap_load_model(cls)
    _wrap_execute_model(cls)
    original = cls.prepare_inputs

    def prepare_inputs(self, scheduler_output, *args, **kwargs):
        batch = original(self, scheduler_output, *args, **kwargs)
        state = getattr(self, STATE_ATTRIBUTE, None)
        if state is not None and state.busy:
            state.prepare_step(
                batch.req_ids,
                batch.query_start_loc_np,
                batch.num_computed_tokens_np,
                np.flatnonzero(batch.is_prefilling_np),
            )
        return batch

    cls.prepare_inputs = prepare_inputs


_REGISTERED = False


def register() -> None:
    """vLLM general-plugin entry point: patch both GPU model runners (idempotent, inert
    for engines whose additional_config lacks CONFIG_KEY)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as RunnerV1

    _patch_v1(RunnerV1)
    _patch_v2(RunnerV2)
    _REGISTERED = True
