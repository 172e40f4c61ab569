"""The native rollout engine: the actor's own weights, one prefill per prompt, graph-replayed decode.

Why it is fast where HF `generate` is not:

- Each prompt is prefilled once (with the injection, which only touches prompt positions)
  and its KV is copied into the rows of its G samples; the marker lives in the prompt, so
  decoding is a plain decoder and the injection hook stays out of it.
- Decoding uses a static KV cache (transformers' `StaticLayer`s) and fixed-shape buffers,
  so on CUDA each decode step is one CUDA-graph replay instead of thousands of kernel
  launches issued from Python.
- Decode attention is grouped: the G query heads that share a KV head read it as one
  batched matmul. SDPA with a padding mask would repeat the KV heads first (a full copy of
  the cache every layer and step).
- Every family quirk comes from `nla_shell.families`: the backbone, per-layer sliding
  windows (one mask per window, handed over as the {layer type: mask} mapping the Qwen and
  Gemma classes read, or as the single 4-D mask the Llama and Mistral classes pass through),
  attention-logit soft-capping (Gemma 2) and final-logit soft-capping (Gemma 2/3). The
  KV caches keep every position of every layer; the masks, not the caches, apply windows.
- Sampling stays on the device: the Exp(1) noise of the next step is drawn outside the graph
  (so the caller's generator drives it) and the graph samples with it, exactly as
  `torch.multinomial` does on one draw (`argmax(p / q)`, q ~ Exp(1)), so a CPU run draws
  the same tokens as `nla_core.sample_tokens` with the same generator.

The decode steps' building blocks (attention, masks, prefill, cache, sampling) are in
`nla_shell.engines.decode_ops`, shared with the slot decoder of `nla serve`'s continuous batching
(`nla_shell.engines.native_stream`). The behaviour policy is the trainer's: same module, adapter on (unmerged, or merged into
scratch copies of the base weights for the rollout with the originals swapped back after),
so no weight sync is ever needed. On CPU the same code runs eagerly, which the tests cover.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from nla_shell import families
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.engines.decode_ops import (
    DECODE_ATTENTION, capture_graph, final_logits, is_eos, layer_masks, parameter_addresses, prefill_prompts, round_up,
    sample_with_noise, static_cache,
)
from nla_shell.engines.hf import eos_lengths, left_pad
from nla_shell.models import Injector, eos_token_ids, inner_lm

@dataclass
class _DecodeState:
    """The static buffers of one decode shape (N rows, W prompt width, T new tokens).

    CUDA graphs read and write these in place, so they live as long as the graphs.
    """

    cache: Cache  # of StaticLayers, per layer [N, Hkv, W + T, Dh]; cumulative_length = next slot
    tokens: torch.Tensor  # [N, 1] int64: input token of the next step
    positions: torch.Tensor  # [N, 1] int64: its position id
    first_key: torch.Tensor  # [N] int64: cache slot of each row's first real (unpadded) token
    finished: torch.Tensor  # [N] bool: EOS already sampled
    eos: torch.Tensor  # [E] int64: the ids that end a row (on the device: graphs read no host data)
    column: torch.Tensor  # [1] int64: the out_* column the next step writes
    noise: torch.Tensor  # [N, V] float32: Exp(1) draws for the next step's sample
    out_tokens: torch.Tensor  # [N, T] int64
    out_logp: torch.Tensor  # [N, T] float32
    graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = field(default_factory=dict)  # (window, merged)


class NativeRolloutEngine:
    """Rollouts with the actor's own module: shared prefill, static KV cache, CUDA-graph decode.

    Args:
      actor, injector, tokenizer: the trainer's (PEFT) actor, its injection hook, tokenizer.
      max_batch: most sequences decoded at once (prompts are chunked by max_batch // G).
      merge_lora: decode with the adapter merged into scratch copies of the base weights
        (fewer kernels per step; the originals are swapped back, bit-exact, after), rather
        than running the LoRA branch unmerged.
      cuda_graphs: capture decode steps in CUDA graphs; None = on when the actor is on CUDA.
        A failed capture falls back to eager decoding with a warning (see `graph_error`).
      compile: torch.compile the decode step before capture (fuses the elementwise ops;
        costs a compile per decode shape; uses one full-length attention window, since a
        window change would recompile).
      kv_bucket: decode attention reads the cache up to the next multiple of this many
        slots past the newest token (one graph per window), not the whole static length.
      prompt_bucket: prompt widths are rounded up to this, so similar prompt lengths share
        one decode shape (and its graphs).
      check_every: steps between "all rows finished?" checks on CUDA (each is a host sync).
      max_shapes: decode shapes (static caches + graphs) kept alive at once.
      greedy: argmax decoding (every noise draw is 1, so the exponential race picks the likeliest
        token), for reading explanations; settable between calls; never for training.
    """

    shares_actor_weights = True

    def __init__(
        self,
        actor: torch.nn.Module,
        injector: Injector,
        tokenizer,
        *,
        max_batch: int = 256,
        merge_lora: bool = False,
        cuda_graphs: bool | None = None,
        compile: bool = False,
        kv_bucket: int | None = 64,
        prompt_bucket: int = 16,
        check_every: int = 16,
        max_shapes: int = 2,
        greedy: bool = False,
    ) -> None:
        self.actor, self.injector, self.tokenizer = actor, injector, tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_token_ids(inner_lm(actor).generation_config, tokenizer)
        """A row ends at any of these (the generation_config's eos list plus the tokenizer's eos)."""
        self.max_batch, self.merge_lora, self.compile = max_batch, merge_lora, compile
        self.kv_bucket = None if compile else kv_bucket
        self.prompt_bucket, self.check_every, self.max_shapes = prompt_bucket, check_every, max_shapes
        self.greedy = greedy
        families.require_engine(actor, "native")
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the actor on a CUDA device")
        self.graph_error: str | None = None
        self.last_stats: dict[str, float] = {}
        self._states: dict[tuple[int, int, int], _DecodeState] = {}
        self._weights_key: tuple[int, ...] | None = None
        self._merge_buffers: dict[torch.nn.Module, torch.Tensor] = {}
        self._pool = None
        self._step_fn = torch.compile(self._step, dynamic=False) if compile else self._step

    @property
    def device(self) -> torch.device:
        return next(self.actor.parameters()).device

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        *,
        group_size: int,
        max_new_tokens: int,
        generator: torch.Generator | None = None,
    ) -> list[Rollout]:
        if group_size < 1 or max_new_tokens < 1:
            raise ValueError(f"need group_size >= 1 and max_new_tokens >= 1, got {group_size}, {max_new_tokens}")
        self.last_stats = dict(prefill_s=0.0, capture_s=0.0, decode_s=0.0, decode_steps=0.0, sequences=0.0)
        generator = self._device_generator(generator)
        per_chunk = max(1, self.max_batch // group_size)
        lm = inner_lm(self.actor)
        rollouts: list[Rollout] = []
        with self.decoding(lm):
            self._drop_stale_graphs(lm)
            for start in range(0, len(requests), per_chunk):
                rollouts += self._generate_chunk(
                    lm, requests[start : start + per_chunk], start, group_size, max_new_tokens, generator
                )
        return rollouts

    def sync_weights(self, actor: torch.nn.Module) -> float:
        return 0.0

    def close(self) -> None:
        self._states.clear()
        self._merge_buffers.clear()

    # ------------------------------------------------------------------ one chunk of prompts

    def _generate_chunk(
        self,
        lm: torch.nn.Module,
        requests: Sequence[RolloutRequest],
        first_index: int,
        group_size: int,
        max_new_tokens: int,
        generator: torch.Generator | None,
    ) -> list[Rollout]:
        device = self.device
        n_rows = len(requests) * group_size
        ids, attn = left_pad([r.prompt_ids for r in requests], self.pad_id, device)
        width = round_up(ids.shape[1], self.prompt_bucket)
        ids = F.pad(ids, (width - ids.shape[1], 0), value=self.pad_id)
        attn = F.pad(attn, (width - attn.shape[1], 0), value=0)
        vectors = torch.stack([r.activation for r in requests]).to(device, torch.float32)

        state = self._state(lm, n_rows, width, max_new_tokens)
        t0 = self._clock()
        if self.cuda_graphs and max_new_tokens > 1:
            self._capture_all(lm, state, width, max_new_tokens)
        t1 = self._clock()
        first_logits = self._prefill(lm, state, ids, attn, vectors, group_size)
        self._draw_noise(state.noise, generator)
        first = sample_with_noise(first_logits, state.noise)
        state.out_tokens[:, 0] = first.tokens
        state.out_logp[:, 0] = first.logp
        state.finished.copy_(is_eos(first.tokens, state.eos))
        state.tokens[:, 0] = first.tokens
        t2 = self._clock()
        columns = self._decode(state, width, max_new_tokens, generator)
        t3 = self._clock()

        tokens, logp = state.out_tokens[:, :columns].cpu(), state.out_logp[:, :columns].cpu()
        stats = self.last_stats
        stats["capture_s"] += t1 - t0
        stats["prefill_s"] += t2 - t1
        stats["decode_s"] += t3 - t2
        stats["decode_steps"] += columns - 1
        stats["sequences"] += n_rows
        rollouts = []
        for row, n in enumerate(eos_lengths(tokens, self.eos_ids)):
            req_index = row // group_size
            req = requests[req_index]
            gen_ids = tokens[row, :n]
            # The log-probs cloned: not a view pinning the whole [N, T] buffer.
            rollouts.append(Rollout.from_ids(req.prompt_ids, gen_ids, logp[row, :n].clone(), tokenizer=self.tokenizer,
                                             prompt_index=first_index + req_index))
        return rollouts

    def _prefill(
        self,
        lm: torch.nn.Module,
        state: _DecodeState,
        ids: torch.Tensor,
        attn: torch.Tensor,
        vectors: torch.Tensor,
        group_size: int,
    ) -> torch.Tensor:
        """One injected forward over the B prompts; fills the decode state for B * G rows.

        Args: ids, attn: [B, W] left-padded; vectors: [B, D].
        Returns: [B * G, V] logits of each row's first generated token.
        """
        n_prompts, width = ids.shape
        prompt_cache, logits, first_key = prefill_prompts(lm, self.injector, ids, attn, vectors)

        # Each prompt's KV is copied into the rows of its G samples (prompt-major rows). Slots
        # past the prompt are zeroed: a masked slot still enters probs @ V (as 0 * value), so
        # it must hold finite values, whatever an earlier call or graph warm-up left there.
        for src, dst in zip(prompt_cache.layers, state.cache.layers):
            for src_t, dst_t in ((src.keys, dst.keys), (src.values, dst.values)):
                dst_t[:, :, :width].unflatten(0, (n_prompts, group_size)).copy_(src_t[:, None])
                dst_t[:, :, width:].zero_()
            dst.cumulative_length.fill_(width)
        state.first_key.copy_(first_key.repeat_interleave(group_size))
        state.positions[:, 0] = (width - first_key).repeat_interleave(group_size)
        state.column.fill_(1)
        return logits.repeat_interleave(group_size, dim=0)

    def _decode(self, state: _DecodeState, width: int, max_new_tokens: int, generator: torch.Generator | None) -> int:
        """Decode steps 1 .. T-1 (step 0 came from the prefill). Returns the columns written."""
        length = width + max_new_tokens
        check_every = self.check_every if self.device.type == "cuda" else 1
        for step in range(1, max_new_tokens):
            if step % check_every == 0 and bool(state.finished.all()):
                return step
            window = self.decode_window(width + step, length)
            self._draw_noise(state.noise, generator)
            graph = state.graphs.get((window, self.merge_lora)) if self.cuda_graphs else None
            if graph is not None:
                graph.replay()
            else:
                self._step_fn(state, window)
        return max_new_tokens

    def _step(self, state: _DecodeState, window: int) -> None:
        """One decode step for all rows, in place on `state` (the function CUDA graphs capture).

        Feeds state.tokens at state.positions, writes its KV at the cache's next slot, samples
        the next token, and records it (pad and log-prob 0 for rows already finished).
        """
        lm = inner_lm(self.actor)
        newest = state.cache.layers[0].cumulative_length  # slot this step's KV is written to
        slots = torch.arange(window, device=state.tokens.device)
        keep = (slots[None, :] >= state.first_key[:, None]) & (slots[None, :] <= newest)  # [N, window]
        hidden = families.backbone(lm)(
            input_ids=state.tokens,
            position_ids=state.positions,
            attention_mask=layer_masks(lm, keep[:, None, :], newest.reshape(1), slots),
            past_key_values=state.cache,
            use_cache=True,
        ).last_hidden_state
        sampled = sample_with_noise(final_logits(lm, hidden[:, -1]), state.noise)
        tokens = sampled.tokens.masked_fill(state.finished, self.pad_id)
        logp = sampled.logp.masked_fill(state.finished, 0.0)
        state.out_tokens.index_copy_(1, state.column, tokens[:, None])
        state.out_logp.index_copy_(1, state.column, logp[:, None])
        state.finished.logical_or_(is_eos(tokens, state.eos))
        state.tokens.copy_(tokens[:, None])
        state.positions.add_(1)
        state.column.add_(1)

    def decode_window(self, needed: int, length: int) -> int:
        """Cache slots a step reads: `needed` rounded up to the bucket, at most the static length."""
        return length if self.kv_bucket is None else min(length, round_up(needed, self.kv_bucket))

    # ------------------------------------------------------------------ state, graphs

    def _state(self, lm: torch.nn.Module, n_rows: int, width: int, max_new_tokens: int) -> _DecodeState:
        key = (n_rows, width, max_new_tokens)
        if key in self._states:
            self._states[key] = self._states.pop(key)  # most recently used last
            return self._states[key]
        while len(self._states) >= self.max_shapes:
            self._states.pop(next(iter(self._states)))
        device = self.device
        long = dict(dtype=torch.long, device=device)
        state = _DecodeState(
            cache=static_cache(lm, n_rows, width + max_new_tokens),
            tokens=torch.full((n_rows, 1), self.pad_id, **long),
            positions=torch.zeros((n_rows, 1), **long),
            first_key=torch.zeros(n_rows, **long),
            finished=torch.zeros(n_rows, dtype=torch.bool, device=device),
            eos=torch.tensor(self.eos_ids, **long),
            column=torch.zeros(1, **long),
            noise=torch.ones((n_rows, lm.get_output_embeddings().out_features), dtype=torch.float32, device=device),
            out_tokens=torch.full((n_rows, max_new_tokens), self.pad_id, **long),
            out_logp=torch.zeros((n_rows, max_new_tokens), dtype=torch.float32, device=device),
        )
        self._states[key] = state
        return state

    def _capture_all(self, lm: torch.nn.Module, state: _DecodeState, width: int, max_new_tokens: int) -> None:
        """Capture one graph per attention window this shape will use (once per shape and policy).

        Warm-up and capture run before the prefill resets the state, so the garbage they
        write (tokens, cache slots past the prompt, counters) is overwritten before use.
        """
        length = width + max_new_tokens
        windows = sorted({self.decode_window(width + step, length) for step in range(1, max_new_tokens)})
        missing = [w for w in windows if (w, self.merge_lora) not in state.graphs]
        if not missing:
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            for window in missing:
                self._reset_for_capture(state, width)
                state.graphs[(window, self.merge_lora)] = capture_graph(
                    lambda: self._step_fn(state, window), pool=self._pool,
                    before_capture=lambda: self._reset_for_capture(state, width))
        except Exception as err:  # noqa: BLE001 - any capture failure: decode eagerly, say why
            self.graph_error = f"{type(err).__name__}: {err}"
            warnings.warn(f"native engine: CUDA graph capture failed ({self.graph_error}); decoding eagerly", stacklevel=2)
            print(f"[native] CUDA graph capture failed ({self.graph_error}); decoding eagerly", flush=True)
            self.cuda_graphs = False
            for s in self._states.values():
                s.graphs.clear()

    def _reset_for_capture(self, state: _DecodeState, width: int) -> None:
        """Counters back in range: capture-time steps must write inside the buffers."""
        for layer in state.cache.layers:
            layer.cumulative_length.fill_(width)
        state.column.zero_()
        state.tokens.fill_(self.pad_id)
        state.noise.fill_(1.0)

    def _drop_stale_graphs(self, lm: torch.nn.Module) -> None:
        """Graphs read parameters by address: rebuild them if any parameter storage moved."""
        key = parameter_addresses(lm)
        if key != self._weights_key:
            for state in self._states.values():
                state.graphs.clear()
            self._weights_key = key

    # ------------------------------------------------------------------ policy and attention

    @contextlib.contextmanager
    def decoding(self, lm: torch.nn.Module) -> Iterator[None]:
        """What every decode runs under: eval mode, no grad, the grouped decode attention and the current policy
        (`lm`'s training mode restored after). The slot decoder of continuous batching enters it too."""
        was_training = lm.training
        lm.eval()
        try:
            with torch.no_grad(), self.decode_attention(lm), self.policy():
                yield
        finally:
            lm.train(was_training)

    @contextlib.contextmanager
    def decode_attention(self, lm: torch.nn.Module) -> Iterator[None]:
        """The decode steps' grouped attention on `lm` (restored after)."""
        previous = lm.config._attn_implementation
        lm.set_attn_implementation(DECODE_ATTENTION)
        try:
            yield
        finally:
            lm.set_attn_implementation(previous)

    @contextlib.contextmanager
    def policy(self) -> Iterator[None]:
        """The actor's current policy: LoRA branch as is, or merged into scratch weights.

        Merging writes W + delta into a scratch tensor per LoRA layer (kept across calls, so
        captured graphs see the same addresses) and points the layer's weight at it; the
        original tensors are swapped back afterwards, so no subtraction ever touches them.
        """
        if not self.merge_lora or not hasattr(self.actor, "disable_adapter"):
            yield
            return
        from peft.tuners.lora import LoraLayer

        swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        try:
            for module in inner_lm(self.actor).modules():
                if not isinstance(module, LoraLayer):
                    continue
                weight = module.get_base_layer().weight
                scratch = self._merge_buffers.get(module)
                if scratch is None:
                    scratch = self._merge_buffers[module] = torch.empty_like(weight)
                scratch.copy_(weight)
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        scratch.add_(module.get_delta_weight(adapter))
                swapped.append((weight, weight.data))
                weight.data = scratch
            with self.actor.disable_adapter():
                yield
        finally:
            for weight, original in swapped:
                weight.data = original

    # ------------------------------------------------------------------ small helpers

    def _device_generator(self, generator: torch.Generator | None) -> torch.Generator | None:
        """The caller's generator, or one on the actor's device seeded from it."""
        if generator is None or generator.device.type == self.device.type:
            return generator
        seed = int(torch.randint(2**62, (1,), generator=generator))
        return torch.Generator(self.device).manual_seed(seed)

    def _draw_noise(self, noise: torch.Tensor, generator: torch.Generator | None) -> None:
        """The next step's Exp(1) draws, in place (all ones when greedy: the sample is then the argmax)."""
        if self.greedy:
            noise.fill_(1.0)
        else:
            noise.exponential_(generator=generator)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
