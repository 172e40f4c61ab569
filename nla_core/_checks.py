"""Up-front argument checks shared by the core: fail with the actual shapes, never deep in torch."""

from __future__ import annotations

import torch


def require_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def require_floating(name: str, x: object) -> torch.Tensor:
    x = require_tensor(name, x)
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    return x


def require_integer(name: str, x: object) -> torch.Tensor:
    x = require_tensor(name, x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x


def require_bool(name: str, x: object) -> torch.Tensor:
    x = require_tensor(name, x)
    if x.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a bool tensor (True = counts), got dtype {x.dtype}; "
            f"pass `{name}.bool()` if it holds 0/1"
        )
    return x


def require_ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {layout} ({ndim}-D), got shape {tuple(x.shape)}")


def require_same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
            "they must match"
        )


def require_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")


def float32_or_wider(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 inputs are upcast to float32 for the math; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
