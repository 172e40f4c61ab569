"""Continuous batching on the native engine: a fixed set of decode slots that rows join and leave between steps.

`NativeRolloutEngine.generate` decodes a batch to its end: its static cache shares one write
column across rows (every row writes decode step t at the same slot), so no row can join
mid-decode. `SlotDecoder` keeps `slots` rows, each with its own state:

- its own cache columns: a row's prompt KV (prefilled, with the injection at its marker, by the
  engine's `prefill_prompts`) sits left-padded in columns [0, W) of its slot, its t-th generated
  token's KV in column W + t; each row writes its own column (`write_col`, a scatter by per-row
  index, `SlotLayer.update`);
- its own attention mask: the columns [first_key, write_col] of its own slot, and nothing else,
  so a slot reused after an earlier row leaves reads none of that row's cache;
- its own position ids, output column, max_new_tokens and greedy flag.

`admit` prefills new prompts into free slots (one forward for all admitted prompts, each
prompt's KV copied into the slots of its samples); `step` decodes one token for every slot and
returns the rows that ended (EOS, or their own max_new_tokens), whose slots are free again.
The weights, LoRA policy (merged into scratch weights or not), decode attention, sampler and
EOS ids are the engine's (`running` enters them), so greedy rows decode what `generate`
decodes for the same prompt and vector, whenever they join: token for token on CPU in float32
(the tests); on a GPU in bf16 other batch shapes may round differently, as they may in `generate`.

CUDA graphs (optional, `cuda_graphs=True` on a CUDA actor): what is captured is one decode step
(`_step`) per attention window (the cache columns read, rounded up to the engine's kv_bucket),
captured while no row is active, when `running` is entered. The graph reads every per-row index
from device tensors (write column, position, output column, first key, active, finished), never
from Python ints, so admitting and retiring rows changes only tensor contents. Not captured:
the prefill of admitted rows (a plain forward per admission), the noise draw (the caller's
generator drives it), and the host's bookkeeping (which rows ended; EOS is read from the device
every `check_every` steps, one sync each). torch.compile is not used here. On CPU all of it runs
eagerly; the tests (tests/shell/test_native_stream.py) cover that path only.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import StaticLayer

from nla_shell import families
from nla_shell.engines.base import FinishedRow, Rollout, RolloutRequest, admission_settings
from nla_shell.engines.hf import eos_lengths, left_pad
from nla_shell.engines.decode_ops import (
    capture_graph, final_logits, is_eos, layer_masks, parameter_addresses, prefill_prompts, round_up, sample_with_noise,
    static_cache,
)
from nla_shell.engines.native import NativeRolloutEngine
from nla_shell.models import inner_lm


class SlotLayer(StaticLayer):
    """A static cache layer whose decode step writes each row at its own column.

    `write_col` [N] int64 (shared by all layers, set by the decoder) is the column row n's new
    key and value go to; a scatter, so graph-capturable. Returns the whole [N, Hkv, L, Dh] cache,
    as StaticLayer does; the mask says which columns each row reads.
    """

    write_col: torch.Tensor

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        index = self.write_col.view(-1, 1, 1, 1).expand(-1, key_states.shape[1], 1, key_states.shape[3])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index.expand(-1, -1, -1, value_states.shape[3]), value_states)
        return self.keys, self.values


@dataclass
class _Row:
    """The host's view of one occupied slot (no device reads needed to know it)."""

    key: Hashable
    sample: int
    request: RolloutRequest
    width: int  # the prompt's columns in the cache (its admission's padded width)
    budget: int  # max_new_tokens
    generated: int = 1  # tokens written so far (the first comes from the prefill)


@dataclass
class _SlotState:
    """The decoder's device buffers, [S] per slot unless said; CUDA graphs read and write them in place."""

    tokens: torch.Tensor  # [S] int64: each row's next input token
    positions: torch.Tensor  # [S] int64: its position id
    write_col: torch.Tensor  # [S] int64: the cache column its KV goes to (SlotLayer reads it)
    first_key: torch.Tensor  # [S] int64: the column of its prompt's first real token
    out_col: torch.Tensor  # [S] int64: the output column of its next token
    active: torch.Tensor  # [S] int64: 1 while a row holds the slot (counters advance by it)
    finished: torch.Tensor  # [S] bool: EOS sampled (or the slot is free)
    greedy: torch.Tensor  # [S] bool: argmax for this row (its noise is 1)
    eos: torch.Tensor  # [E] int64: the ids that end a row (on the device: graphs read no host data)
    noise: torch.Tensor  # [S, V] float32: Exp(1) draws for the next step
    out_tokens: torch.Tensor  # [S, T] int64
    out_logp: torch.Tensor  # [S, T] float32


class SlotDecoder:
    """Continuous batching on a NativeRolloutEngine's actor (a StreamDecoder, nla_shell.engines.base): see the module
    docstring.

    Args:
      engine: the native engine whose actor, injector, tokenizer, LoRA policy and buckets are used.
      slots: rows decoded at once (free slots are decoded too, as padding: one shape for all steps).
      max_prompt_len: longest prompt admitted, in tokens.
      max_new_tokens: longest row admitted (a row's own max_new_tokens is given at admission).
      cuda_graphs: capture the decode step (needs the actor on CUDA); None: the engine's setting.
      check_every: steps between reads of the EOS flags on CUDA (each a host sync); 1 on CPU.
    """

    def __init__(self, engine: NativeRolloutEngine, *, slots: int, max_prompt_len: int, max_new_tokens: int,
                 cuda_graphs: bool | None = None, check_every: int = 4) -> None:
        if slots < 1 or max_prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"need slots, max_prompt_len, max_new_tokens >= 1, got {slots}, {max_prompt_len}, "
                             f"{max_new_tokens}")
        self.engine, self.n_slots, self.max_new_tokens = engine, slots, max_new_tokens
        self.cuda_graphs = engine.cuda_graphs if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and engine.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the actor on a CUDA device")
        self.check_every = check_every if engine.device.type == "cuda" else 1
        self.length = round_up(max_prompt_len, engine.prompt_bucket) + max_new_tokens
        lm = inner_lm(engine.actor)
        self.cache = static_cache(lm, slots, self.length, layer=SlotLayer)
        self.state = self._new_state(lm)
        for layer in self.cache.layers:
            layer.write_col = self.state.write_col
        self.rows: dict[int, _Row] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._weights_key: tuple[int, ...] | None = None
        self._steps = 0

    @property
    def free(self) -> int:
        return self.n_slots - len(self.rows)

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The engine's policy, decode attention, eval mode and no_grad, for a run of admit/step calls (graphs are
        captured on entry, while no row is active)."""
        lm = inner_lm(self.engine.actor)
        with self.engine.decoding(lm):
            key = parameter_addresses(lm)
            if key != self._weights_key:
                self.graphs.clear()
                self._weights_key = key
            if self.cuda_graphs and not self.rows:
                self._capture_all()
            yield

    # ------------------------------------------------------------------ rows joining

    def admit(self, requests: Sequence[RolloutRequest], *, keys: Sequence[Hashable], rows: int = 1,
              max_new_tokens: int | Sequence[int] | None = None, greedy: bool | Sequence[bool] = False,
              generator: torch.Generator | None = None) -> list[FinishedRow]:
        """Prefill `requests` into free slots, `rows` samples each, and sample each row's first token.

        Call inside `running`. Needs len(requests) * rows free slots. Returns the rows that already
        ended (max_new_tokens 1); the others end in later `step`s.
        """
        budgets, greedies = admission_settings(len(requests), keys=keys, rows=rows, free=self.free,
                                               max_new_tokens=max_new_tokens or self.max_new_tokens, greedy=greedy,
                                               longest=self.max_new_tokens)
        engine, lm, state = self.engine, inner_lm(self.engine.actor), self.state
        ids, attn = left_pad([r.prompt_ids for r in requests], engine.pad_id, engine.device)
        width = round_up(ids.shape[1], engine.prompt_bucket)
        if width + max(budgets) > self.length:
            raise ValueError(f"admit: prompt width {width} + max_new_tokens {max(budgets)} exceeds the cache's "
                             f"{self.length} columns")
        ids = F.pad(ids, (width - ids.shape[1], 0), value=engine.pad_id)
        attn = F.pad(attn, (width - attn.shape[1], 0), value=0)
        vectors = torch.stack([r.activation for r in requests]).to(engine.device, torch.float32)
        prompt_cache, logits, first_key = prefill_prompts(lm, engine.injector, ids, attn, vectors)

        free = [s for s in range(self.n_slots) if s not in self.rows][: len(requests) * rows]
        slots = torch.tensor(free, dtype=torch.long, device=engine.device)
        for src, dst in zip(prompt_cache.layers, self.cache.layers):
            for src_t, dst_t in ((src.keys, dst.keys), (src.values, dst.values)):
                dst_t[:, :, :width].index_copy_(0, slots, src_t.repeat_interleave(rows, dim=0))
                dst_t[:, :, width:].index_fill_(0, slots, 0)  # finite, and nothing of an earlier row's cache
        state.first_key.index_copy_(0, slots, first_key.repeat_interleave(rows))
        state.positions.index_copy_(0, slots, (width - first_key).repeat_interleave(rows))
        state.write_col.index_fill_(0, slots, width)
        state.out_col.index_fill_(0, slots, 1)
        state.active.index_fill_(0, slots, 1)
        state.greedy.index_copy_(0, slots, torch.tensor(greedies, device=engine.device).repeat_interleave(rows))
        state.out_tokens.index_fill_(0, slots, engine.pad_id)
        state.out_logp.index_fill_(0, slots, 0.0)
        noise = torch.empty((len(free), state.noise.shape[1]), dtype=torch.float32, device=engine.device)
        noise = self._noise(noise, state.greedy[slots], generator)
        first = sample_with_noise(logits.repeat_interleave(rows, dim=0), noise)
        state.out_tokens[:, 0].index_copy_(0, slots, first.tokens)
        state.out_logp[:, 0].index_copy_(0, slots, first.logp)
        state.tokens.index_copy_(0, slots, first.tokens)
        state.finished.index_copy_(0, slots, is_eos(first.tokens, state.eos))
        for i, slot in enumerate(free):
            request = i // rows
            self.rows[slot] = _Row(keys[request], i % rows, requests[request], width, budgets[request])
        return self._retire([s for s in free if self.rows[s].budget == 1])

    # ------------------------------------------------------------------ one step

    def step(self, generator: torch.Generator | None = None) -> list[FinishedRow]:
        """One decode step for every slot (call inside `running`, with rows active); returns the rows that ended."""
        if not self.rows:
            raise RuntimeError("step: no row is active; admit some first")
        needed = max(row.width + row.generated for row in self.rows.values())  # columns read, the newest included
        window = self.engine.decode_window(needed, self.length)
        self._noise(self.state.noise, self.state.greedy, generator)
        graph = self.graphs.get(window) if self.cuda_graphs else None
        if graph is not None:
            graph.replay()
        else:
            self._step(window)
        self._steps += 1
        for row in self.rows.values():
            row.generated += 1
        done = [s for s, row in self.rows.items() if row.generated >= row.budget]
        if self._steps % self.check_every == 0:
            ended = self.state.finished.nonzero().flatten().tolist()  # the host sync
            done += [s for s in ended if s in self.rows and s not in done]
        return self._retire(done)

    def _step(self, window: int) -> None:
        """Decode one token for all slots, in place on the state and cache (the function CUDA graphs capture)."""
        lm, state = inner_lm(self.engine.actor), self.state
        columns = torch.arange(window, device=state.tokens.device)
        keep = (columns[None, :] >= state.first_key[:, None]) & (columns[None, :] <= state.write_col[:, None])
        hidden = families.backbone(lm)(
            input_ids=state.tokens[:, None],
            position_ids=state.positions[:, None],
            attention_mask=layer_masks(lm, keep[:, None, :], state.write_col[:, None], columns),
            past_key_values=self.cache,
            use_cache=True,
        ).last_hidden_state
        sampled = sample_with_noise(final_logits(lm, hidden[:, -1]), state.noise)
        tokens = sampled.tokens.masked_fill(state.finished, self.engine.pad_id)
        logp = sampled.logp.masked_fill(state.finished, 0.0)
        state.out_tokens.scatter_(1, state.out_col[:, None], tokens[:, None])
        state.out_logp.scatter_(1, state.out_col[:, None], logp[:, None])
        state.finished.logical_or_(is_eos(tokens, state.eos))
        state.tokens.copy_(tokens)
        for counter in (state.positions, state.write_col, state.out_col):
            counter.add_(state.active)  # a free slot stays at column 0 (its writes land where admission overwrites)

    # ------------------------------------------------------------------ rows leaving

    def _retire(self, slots: list[int]) -> list[FinishedRow]:
        """The rows of `slots` as FinishedRows (cut after their first EOS); their slots freed."""
        if not slots:
            return []
        index = torch.tensor(slots, dtype=torch.long, device=self.engine.device)
        tokens, logp = self.state.out_tokens[index].cpu(), self.state.out_logp[index].cpu()
        for name in ("active", "out_col", "positions", "write_col", "first_key"):
            getattr(self.state, name).index_fill_(0, index, 0)
        self.state.finished.index_fill_(0, index, True)
        self.state.tokens.index_fill_(0, index, self.engine.pad_id)
        finished = []
        for i, slot in enumerate(slots):
            row = self.rows.pop(slot)
            n = min(eos_lengths(tokens[i : i + 1, : row.generated], self.engine.eos_ids)[0], row.budget)
            rollout = Rollout.from_ids(row.request.prompt_ids, tokens[i, :n], logp[i, :n].clone(),
                                       tokenizer=self.engine.tokenizer, prompt_index=0)
            finished.append(FinishedRow(row.key, row.sample, rollout))
        return finished

    def drop_all(self) -> None:
        """Free every slot, discarding its row (after a failure: the next admissions start clean)."""
        self._retire(list(self.rows))

    # ------------------------------------------------------------------ buffers and graphs

    def _new_state(self, lm: torch.nn.Module) -> _SlotState:
        n, device, pad = self.n_slots, self.engine.device, self.engine.pad_id
        long = dict(dtype=torch.long, device=device)
        return _SlotState(
            tokens=torch.full((n,), pad, **long), positions=torch.zeros(n, **long), write_col=torch.zeros(n, **long),
            first_key=torch.zeros(n, **long), out_col=torch.zeros(n, **long), active=torch.zeros(n, **long),
            finished=torch.ones(n, dtype=torch.bool, device=device),
            greedy=torch.ones(n, dtype=torch.bool, device=device),
            eos=torch.tensor(self.engine.eos_ids, **long),
            noise=torch.ones((n, lm.get_output_embeddings().out_features), dtype=torch.float32, device=device),
            out_tokens=torch.full((n, self.max_new_tokens), pad, **long),
            out_logp=torch.zeros((n, self.max_new_tokens), dtype=torch.float32, device=device),
        )

    def _noise(self, noise: torch.Tensor, greedy: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Exp(1) draws in place, 1 on greedy rows (the exponential race then picks the argmax)."""
        noise.exponential_(generator=generator)
        return noise.masked_fill_(greedy[:, None], 1.0)

    def _capture_all(self) -> None:
        """One graph per attention window, captured with every slot free (their writes go to column 0)."""
        windows = sorted({self.engine.decode_window(needed, self.length) for needed in range(1, self.length + 1)})
        missing = [w for w in windows if w not in self.graphs]
        if not missing:
            return
        pool = torch.cuda.graph_pool_handle()
        try:
            for window in missing:
                self.graphs[window] = capture_graph(lambda: self._step(window), pool=pool)
        except Exception as err:  # noqa: BLE001 - any capture failure: decode eagerly, say why
            warnings.warn(f"slot decoder: CUDA graph capture failed ({type(err).__name__}: {err}); decoding eagerly",
                          stacklevel=2)
            self.cuda_graphs = False
            self.graphs.clear()
        self.state.tokens.fill_(self.engine.pad_id)
