"""The critic: an `ARModel`, the LM truncated after the extraction layer, its final norm
bypassed, and a float32 `Linear(D, D)` value head on the normalised last-token hidden state."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import nla_core
from nla_shell import families, quant as quantization
from nla_shell.models.common import (
    AR_LORA_FILE, AR_META_FILE, VALUE_HEAD_FILE, is_adapter_dir, is_ar_lora_dir, lora_config, pad_right,
)


@dataclass(frozen=True)
class ARLora:
    """The LoRA an AR trains on its frozen (possibly quantised) backbone: what ar_meta.json records."""

    r: int
    """LoRA rank."""
    alpha: int
    """LoRA alpha (scaling alpha/sqrt(r) with rsLoRA, EasyNLA's only choice, else alpha/r)."""
    use_rslora: bool
    """rsLoRA scaling."""
    targets: tuple[str, ...]
    """Adapted module names (families.lora_targets)."""
    base_model: str
    """The full LM the backbone is truncated from."""
    quant: str
    """How the backbone is loaded: none, 4bit or 8bit (nla_shell.quant)."""


class ARModel(nn.Module):
    """Activation reconstructor: explanation text -> predicted activation [D].

    pred = value_head(normalize(h_last, mse_scale)), h_last the truncated backbone's hidden
    state at the last real token (final norm bypassed: the AR reads the raw residual stream
    of the extraction layer, as the activations were captured).
    """

    def __init__(self, lm: nn.Module, value_head: nn.Linear, *, mse_scale: float | None) -> None:
        super().__init__()
        self.lm = lm
        self.value_head = value_head
        self.mse_scale = mse_scale
        self.lora: ARLora | None = None
        """Set by `add_lora`: the backbone is frozen and a LoRA on it trains (EasyNLA's AR-LoRA)."""
        self._final_norm = families.final_norm(lm)
        families.set_final_norm(lm, nn.Identity())
        self.requires_grad_(True)

    def requires_grad_(self, requires_grad: bool = True) -> "ARModel":
        """What the AR trains made trainable (or everything frozen); the rest never trainable.

        Trained: the backbone and value head, or with a LoRA the LoRA and value head only.
        The bypassed final norm and the lm_head (unless tied to the embeddings) are never in
        the forward: trainable, they would cost optimizer state and, under torchrun, an
        all-reduce of zeros every step. Quantised weights are never trainable.
        """
        if self.lora is None:
            trained = {id(p) for p in (*families.backbone(self.lm).parameters(), *self.value_head.parameters())}
        else:
            trained = {id(p) for name, p in self.lm.named_parameters() if "lora_" in name}
            trained |= {id(p) for p in self.value_head.parameters()}
        for p in self.parameters():
            p.requires_grad_(requires_grad and id(p) in trained and p.is_floating_point())
        return self

    def add_lora(self, *, r: int, alpha: int, use_rslora: bool, base_model: str | Path, quant: str = "none",
                 targets: Sequence[str] | None = None) -> "ARModel":
        """Freeze the backbone and put a fresh LoRA on it (B = 0: predictions unchanged), as EasyNLA's
        `train_sft.py --mode ar --use-lora` does (peft.inject_adapter_in_model on the backbone,
        no PeftModel wrapper, so `forward` is unchanged). The way to train a quantised AR.

        base_model: the full LM the backbone was truncated from (saved with the adapter);
        quant: how the backbone was loaded; targets: default families.lora_targets.
        """
        from peft import inject_adapter_in_model

        targets = families.lora_targets(self.lm, targets or ())
        inject_adapter_in_model(lora_config(r, alpha, use_rslora=use_rslora, targets=targets), self.lm)
        self.lora = ARLora(r=r, alpha=alpha, use_rslora=use_rslora, targets=tuple(targets),
                           base_model=str(Path(base_model).resolve()), quant=quant)
        return self.requires_grad_(True)

    def merge_lora(self) -> "ARModel":
        """Fold the LoRA into the backbone's weights (W + scale * B A) and drop it: a plain AR again."""
        from peft.tuners.lora import LoraLayer

        for name, module in list(self.lm.named_modules()):
            if isinstance(module, LoraLayer):
                module.merge()
                parent, _, attr = name.rpartition(".")
                setattr(self.lm.get_submodule(parent), attr, module.get_base_layer())
        self.lora = None
        return self.requires_grad_(True)

    @property
    def num_layers(self) -> int:
        return self.lm.config.num_hidden_layers

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        mse_scale: float | None,
        extraction_layer_index: int | None = None,
        create_head: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant: str = "none",
        full_precision: bool = False,
    ) -> "ARModel":
        """Load an AR dir (backbone + value_head.safetensors), or an AR-LoRA dir (ar_meta.json + the LoRA
        and value head, rebuilt around its base as it was trained, whatever `quant` says).

        With create_head=True, `path` may be any causal-LM checkpoint: it is truncated after
        `extraction_layer_index` and given an identity value head (the AR warm start).
        quant ("4bit" / "8bit") loads the backbone quantised onto `device` (frozen: see nla_shell.quant).
        full_precision rebuilds an AR-LoRA trained on a quantised backbone on the full-precision base
        instead, so the LoRA can be merged (lossy; EasyNLA's scripts/merge_lora_to_hf.py does the same).
        """
        path = Path(path)
        if is_ar_lora_dir(path):
            return cls._from_ar_lora(path, mse_scale=mse_scale, dtype=dtype, device=device, full_precision=full_precision)
        head_file = path / VALUE_HEAD_FILE
        if not head_file.exists() and not create_head:
            what = "an AV adapter" if is_adapter_dir(path) else "not an AR checkpoint"
            raise FileNotFoundError(
                f"the AR dir {path} has no {VALUE_HEAD_FILE}: it is {what}. Give a checkpoint of "
                "`nla sft --mode ar` (its save_dir/step_NNNNNN) or a co-trained critic (an nla train run's step_NNNNNN/critic)"
            )
        lm = families.load_causal_lm(
            path, dtype=dtype, **quantization.load_kwargs(quant, dtype=dtype, device=torch.device(device))
        )
        families.family_of(lm)  # an unsupported architecture stops here, with the supported list
        if extraction_layer_index is not None:
            keep = extraction_layer_index + 1
            if keep > lm.config.num_hidden_layers:
                raise ValueError(
                    f"extraction_layer_index={extraction_layer_index} but {path} has only "
                    f"{lm.config.num_hidden_layers} layers"
                )
            families.truncate_blocks(lm, keep)
        d = lm.config.hidden_size
        head = nn.Linear(d, d, bias=False, dtype=torch.float32)
        if head_file.exists():
            weight = load_file(str(head_file))["weight"]
            if weight.shape != (d, d):
                raise ValueError(f"{head_file} holds weight {tuple(weight.shape)}, expected [{d}, {d}]")
            head.weight.data.copy_(weight)
        else:
            nn.init.eye_(head.weight)
        model = cls(lm, head, mse_scale=mse_scale)
        if quant != "none":  # the quantised backbone is already on its device
            head.to(device)
            return model
        return model.to(device)

    @classmethod
    def _from_ar_lora(cls, path: Path, *, mse_scale: float | None, dtype: torch.dtype, device: torch.device | str,
                      full_precision: bool) -> "ARModel":
        """An AR-LoRA dir: its base truncated and loaded as it was trained (ar_meta.json's quant:
        the LoRA compensates that backbone's quantisation error, which is why EasyNLA refuses a
        mismatch), the LoRA and value head from ar_lora_value_head.safetensors."""
        meta_file = path / AR_META_FILE
        meta = json.loads(meta_file.read_text())
        base = meta.get("base_model_name_or_path")
        if base is None:
            raise ValueError(f"{meta_file} names no base_model_name_or_path (EasyNLA passes it as --base-ckpt); add "
                             "that key: the full LM this AR's backbone was truncated from")
        if meta.get("final_norm_stripped") is False:
            raise ValueError(f"{meta_file}: final_norm_stripped is false, but nla's AR always reads the raw residual "
                             "(final norm stripped); retrain the AR with the final norm stripped")
        quant = "none" if full_precision else meta.get("quant", "none")
        if quant != "none":
            quantization.require_quant(quant, torch.device(device), what=f"{meta_file}'s 'quant'")
        model = cls.from_pretrained(base, mse_scale=mse_scale, extraction_layer_index=meta["ar_num_layers"] - 1,
                                    create_head=True, dtype=dtype, device=device, quant=quant)
        model.add_lora(r=meta["lora_r"], alpha=meta["lora_alpha"], use_rslora=meta.get("use_rslora", True),
                       base_model=base, quant=quant, targets=meta["target_modules"])
        tensors = load_file(str(path / AR_LORA_FILE))
        own = dict(model._ar_lora_tensors())
        if tensors.keys() != own.keys():
            missing, unexpected = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())
            raise ValueError(f"{path / AR_LORA_FILE} does not fit the AR that {meta_file} describes: missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}; was it written for another base model?")
        with torch.no_grad():
            for name, tensor in own.items():
                if tensor.shape != tensors[name].shape:
                    raise ValueError(f"{path / AR_LORA_FILE}: {name} is {tuple(tensors[name].shape)}, expected "
                                     f"{tuple(tensor.shape)}")
                tensor.copy_(tensors[name])
        return model

    def _ar_lora_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of what an AR-LoRA trains, named as EasyNLA's NLACriticModel names them
        (its backbone attribute is `backbone`; PEFT's LoRA keys `...q_proj.lora_A.default.weight`)."""
        for name, p in self.lm.named_parameters():
            if "lora_" in name:
                yield f"backbone.{name}", p
        yield "value_head.weight", self.value_head.weight

    @contextlib.contextmanager
    def final_norm_restored(self) -> Iterator[None]:
        """The backbone's final norm in place, as a plain checkpoint holds it, for the duration."""
        identity = families.final_norm(self.lm)
        families.set_final_norm(self.lm, self._final_norm)
        try:
            yield
        finally:
            families.set_final_norm(self.lm, identity)

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """What `save_pretrained` writes, by name: an AR-LoRA's LoRA and value head (`_ar_lora_tensors`' names);
        else the backbone's state dict with its final norm in place and VALUE_HEAD_FILE's "weight" as
        "value_head.weight"."""
        if self.lora is not None:
            return dict(self._ar_lora_tensors())
        with self.final_norm_restored():
            tensors = dict(self.lm.state_dict())
        return {**tensors, "value_head.weight": self.value_head.weight}

    def save_pretrained(self, path: str | Path, *, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """A plain HF causal-LM checkpoint of the truncated backbone + value_head.safetensors; with a
        LoRA, EasyNLA's AR-LoRA layout instead (the frozen backbone is not saved): AR_LORA_FILE and
        AR_META_FILE, whose base_model_name_or_path and use_rslora keys are nla's additions.

        tensors: `saved_tensors` gathered whole elsewhere (sharding=fsdp2 shards the AR's own), written instead.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            save_file({name: t.detach().float().cpu().contiguous()
                       for name, t in (tensors or dict(self._ar_lora_tensors())).items()},
                      str(path / AR_LORA_FILE))
            meta = {"ar_num_layers": self.num_layers, "lora_r": self.lora.r, "lora_alpha": self.lora.alpha,
                    "quant": self.lora.quant, "target_modules": list(self.lora.targets), "final_norm_stripped": True,
                    "base_model_name_or_path": self.lora.base_model, "use_rslora": self.lora.use_rslora}
            (path / AR_META_FILE).write_text(json.dumps(meta, indent=2))
            return
        lm_tensors = None if tensors is None else {k: v for k, v in tensors.items() if k != "value_head.weight"}
        with self.final_norm_restored():
            self.lm.save_pretrained(path, **({} if lm_tensors is None else {"state_dict": lm_tensors}))
        head = self.value_head.weight if tensors is None else tensors["value_head.weight"]
        save_file({"weight": head.detach().float().cpu().contiguous()}, str(path / VALUE_HEAD_FILE))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, right_padded: bool = False) -> torch.Tensor:
        """Args: input_ids, attention_mask: [B, S] (any padding side); right_padded: every row's padding (if any)
        follows its tokens (`pad_right`), so causal attention alone keeps each real token from the pads and
        the backbone runs unmasked (SDPA's causal kernel on the grouped heads, no mask made; the same
        arithmetic). Returns: [B, D] float32."""
        mask = None if right_padded else attention_mask
        hidden = families.backbone(self.lm)(input_ids=input_ids, attention_mask=mask).last_hidden_state
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = torch.where(attention_mask.bool(), positions, -1).amax(dim=1)
        h_last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
        return self.value_head(nla_core.normalize_activation(h_last, self.mse_scale))


def ar_predict(
    ar: ARModel,
    token_lists: Sequence[Sequence[int]],
    *,
    pad_id: int,
    micro_batch: int,
    device: torch.device,
) -> torch.Tensor:
    """Batched AR predictions for many AR inputs. Returns [N, D] float32 (no grad)."""
    preds = []
    with torch.no_grad():
        for start in range(0, len(token_lists), micro_batch):
            ids, mask = pad_right(token_lists[start : start + micro_batch], pad_id, device)
            preds.append(ar(ids, mask, right_padded=True))
    return torch.cat(preds) if preds else torch.zeros(0, ar.value_head.in_features)
