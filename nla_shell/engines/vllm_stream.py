"""Continuous batching on the vLLM engine: requests handed to vLLM's own scheduler as slots free up.

`VLLMStream` is the StreamDecoder (nla_shell.engines.base) of a VLLMRolloutEngine, written
against vLLM 0.24's LLMEngine (`engine.llm.llm_engine`; vllm/v1/engine/llm_engine.py of the
0.24.0 wheel, commit ee0da84ab): `admit` adds one vLLM request per site, with n = its rows, by
`LLMEngine.add_request(request_id, prompt, params)`, the prompt and SamplingParams being exactly
those `run_specs` hands to `LLM.generate` (`VLLMRolloutEngine.request_inputs`: the same token
ids, cache salt, steering extra_args and sampling settings, output_kind FINAL_ONLY);
`step` runs `LLMEngine.step()` once and turns each finished RequestOutput into one row per
sample (`rollouts_from_outputs`, as `generate` does); `drop_all` aborts what is in flight
(`LLMEngine.abort_request`). vLLM schedules the requests it holds, prefills and decodes
included; `free` (slots minus the rows handed to vLLM and not yet back) is what keeps the
requests not yet started in the server's own queue, where they can be cancelled and count
against its max_queue.

Two differences from `LLM.generate` on the same specs: the raw TokensPrompt goes through
LLMEngine's own input processing (which vLLM 0.24 marks deprecated, while LLM.generate renders it
first; both carry the token ids and cache salt through: vllm/inputs/preprocess.py,
vllm/renderers/base.py), and the request ids are this stream's own ("nla-stream-N").
Not run on vLLM: the tests (tests/shell/test_serve_continuous_vllm.py) drive a stand-in
that follows the LLMEngine API read above.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Hashable, NamedTuple, Sequence

from nla_shell.engines.base import FinishedRow, RolloutRequest, admission_settings
from nla_shell.engines.vllm import VLLMRolloutEngine
from nla_shell.engines.vllm_requests import RequestSpec, rollouts_from_outputs


class _Handed(NamedTuple):
    """A request vLLM holds: the key it was admitted with and the spec it was built from."""

    key: Hashable
    spec: RequestSpec


class VLLMStream:
    """Continuous batching through vLLM's scheduler on a VLLMRolloutEngine: see the module docstring.

    Args:
      engine: the vLLM engine (its LLM, steering backend, stop tokens, seeds, sleep mode).
      slots: most rows (sites x samples) handed to vLLM at once.
      max_new_tokens: longest row admitted (a row's own max_new_tokens is given at admission).
    """

    def __init__(self, engine: VLLMRolloutEngine, *, slots: int, max_new_tokens: int) -> None:
        if slots < 1 or max_new_tokens < 1:
            raise ValueError(f"need slots, max_new_tokens >= 1, got {slots}, {max_new_tokens}")
        self.engine, self.n_slots, self.max_new_tokens = engine, slots, max_new_tokens
        self._handed: dict[str, _Handed] = {}  # request id -> what it answers
        self._rows = 0  # rows of the handed requests
        self._ids = itertools.count()

    @property
    def free(self) -> int:
        return self.n_slots - self._rows

    @property
    def busy(self) -> bool:
        return bool(self._handed)

    @property
    def _llm_engine(self) -> Any:
        return self.engine.llm.llm_engine

    def running(self) -> contextlib.AbstractContextManager[None]:
        """vLLM awake (its sleep mode: woken, and the weight push made if one is due) for a run of admit/step calls."""
        return self.engine.awake()

    def admit(self, requests: Sequence[RolloutRequest], *, keys: Sequence[Hashable], rows: int = 1,
              max_new_tokens: int | Sequence[int] | None = None,
              greedy: bool | Sequence[bool] = False) -> list[FinishedRow]:
        """Hand `requests` to vLLM, one request of n = `rows` samples each, with its own max_new_tokens and greedy.

        Needs len(requests) * rows free slots. Returns [] (rows come back from `step`). A request vLLM refuses
        raises; those handed before it stay in flight (`drop_all` aborts them).
        """
        budgets, greedies = admission_settings(len(requests), keys=keys, rows=rows, free=self.free,
                                               max_new_tokens=max_new_tokens or self.max_new_tokens, greedy=greedy,
                                               longest=self.max_new_tokens)
        for request, key, budget, argmax in zip(requests, keys, budgets, greedies):
            (spec,) = self.engine.build_specs([request], group_size=rows, max_new_tokens=budget)
            prompt, params = self.engine.request_inputs(spec, greedy=argmax)
            request_id = f"nla-stream-{next(self._ids)}"
            self._llm_engine.add_request(request_id, prompt, params)
            self._handed[request_id] = _Handed(key, spec)
            self._rows += spec.n
        return []

    def step(self) -> list[FinishedRow]:
        """One `LLMEngine.step()` (call while busy); the rows of the requests that finished in it, sample by sample."""
        if not self._handed:
            raise RuntimeError("step: no request is in flight; admit some first")
        engine = self._llm_engine
        if not engine.has_unfinished_requests():
            # vLLM lost them: stepping on would wait forever (a multiprocess engine's step blocks for output)
            raise RuntimeError(f"vLLM holds none of the {len(self._handed)} requests handed to it")
        finished = []
        for output in engine.step():
            if not output.finished:  # FINAL_ONLY sends none of these; LLM.generate skips them too
                continue
            handed = self._handed.pop(output.request_id, None)
            if handed is None:
                raise RuntimeError(f"vLLM finished request {output.request_id!r}, which this stream never handed it")
            self._rows -= handed.spec.n
            rollouts = rollouts_from_outputs([output], [handed.spec], decode=self.engine.decode)
            finished += [FinishedRow(handed.key, sample, rollout) for sample, rollout in enumerate(rollouts)]
        return finished

    def drop_all(self) -> None:
        """Abort every request in flight (after a failure: the next admissions start clean)."""
        request_ids = list(self._handed)
        self._handed.clear()
        self._rows = 0
        if request_ids:
            self._llm_engine.abort_request(request_ids)
