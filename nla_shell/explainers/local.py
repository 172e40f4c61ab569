"""Explanations from a local HF instruct model: batched generate, on the GPU when there is one.

Each prompt becomes the user turn of the model's chat template (with the generation
prompt); the batch is left-padded and generated at once. Temperature 0 is greedy; any
other temperature samples, seeded per batch so a rerun without the cache writes the same;
None keeps the checkpoint's own generation_config.
For vLLM's throughput, serve the model with `vllm serve DIR` and use the api explainer
(explainer_provider=openai, explainer_base_url=http://127.0.0.1:8000/v1): vLLM's server
speaks the OpenAI chat-completions format, so no second code path is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from nla_shell.explainers.cache import Reply
from nla_shell.io.config import ConfigError


class LocalCompleter:
    """A Completer over a local HF causal LM checkpoint dir (loaded on the first uncached prompt)."""

    def __init__(self, *, model: str, max_tokens: int = 300, temperature: float | None = 1.0, device: str = "auto",
                 dtype: str = "auto", seed: int = 0) -> None:
        path = Path(model)
        if not path.is_dir():
            raise ConfigError(
                f"config key 'explainer_model' = {model!r} is invalid: the local explainer loads an HF checkpoint "
                "directory, and there is none at that path"
            )
        self.model = str(path.resolve())
        self.max_tokens, self.temperature = max_tokens, temperature
        self.device_name, self.dtype_name, self.seed = device, dtype, seed
        self._lm: Any = None
        self._tokenizer: Any = None

    def settings(self) -> dict[str, Any]:
        return {"provider": "hf", "model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}

    def complete(self, prompts: Sequence[str], on_reply: Callable[[int, Reply], None]) -> dict[int, str]:
        import torch

        lm, tokenizer = self._load()
        texts = [self._chat_text(p) for p in prompts]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(lm.device)
        torch.manual_seed(self.seed)
        if self.temperature is None:
            sampling = {}
        elif self.temperature > 0:
            sampling = {"do_sample": True, "temperature": self.temperature, "top_p": 1.0, "top_k": 0}
        else:
            sampling = {"do_sample": False}
        with torch.no_grad():
            out = lm.generate(**batch, max_new_tokens=self.max_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
        new = out[:, batch["input_ids"].shape[1]:].cpu()
        prompt_lengths = batch["attention_mask"].sum(dim=1).tolist()
        for i, tokens in enumerate(new.tolist()):
            tokens = self._until_eos(tokens, lm.generation_config.eos_token_id)
            on_reply(i, Reply(tokenizer.decode(tokens, skip_special_tokens=True), input_tokens=int(prompt_lengths[i]),
                              output_tokens=len(tokens)))
        return {}

    def _chat_text(self, prompt: str) -> str:
        if self._tokenizer.chat_template is None:
            return prompt
        return self._tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)

    @staticmethod
    def _until_eos(tokens: list[int], eos: int | list[int] | None) -> list[int]:
        """The generated tokens up to (not including) the first end-of-sequence token."""
        stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        cut = next((j for j, t in enumerate(tokens) if t in stops), len(tokens))
        return tokens[:cut]

    def _load(self) -> tuple[Any, Any]:
        if self._lm is None:
            from nla_shell.families import load_causal_lm, load_tokenizer
            from nla_shell.training.runtime import resolve_device

            device, dtype = resolve_device(self.device_name, self.dtype_name)
            tokenizer = load_tokenizer(self.model)  # left padding needs a pad id: eos when there is none
            tokenizer.padding_side = "left"
            self._tokenizer = tokenizer
            self._lm = load_causal_lm(self.model, dtype=dtype).to(device).eval()
        return self._lm, self._tokenizer
