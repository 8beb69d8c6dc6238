"""Which dtype the model computes in, and whether this device can compute in it."""

import torch
import torch.nn.functional as F


def params_dtype(fp16: bool = False, bf16: bool = False) -> torch.dtype:
    """The model's parameter dtype from the fp16/bf16 switches (both off: fp32)."""
    if fp16 and bf16:
        raise ValueError("fp16 and bf16 are exclusive; choose one")
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32


def _probe(dtype: torch.dtype, device: torch.device) -> None:
    """The ops a transformer step needs, forward and backward, on a tiny tensor."""
    x = torch.randn(4, 8, device=device).to(dtype).requires_grad_()
    w = torch.randn(8, 8, device=device).to(dtype)
    y = F.layer_norm(F.linear(x, w), (8,))
    torch.softmax(F.gelu(y), dim=-1).float().sum().backward()


def check_device_supports(dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise a clear error when `device` cannot train in `dtype` (fp16/bf16)."""
    device = torch.device(device)
    if dtype == torch.float32:
        return
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    other = "bf16 or fp32" if dtype == torch.float16 else "fp16 or fp32"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        need = (8, 0) if dtype == torch.bfloat16 else (6, 0)
        if (major, minor) < need:
            raise RuntimeError(
                f"{name} asked for, but {torch.cuda.get_device_name(device)} (compute capability "
                f"{major}.{minor}) needs at least {need[0]}.{need[1]} for {name} training; "
                f"use {other}"
            )
        return
    try:
        _probe(dtype, device)
    except (RuntimeError, NotImplementedError) as e:
        raise RuntimeError(
            f"{name} asked for, but device '{device}' cannot train in it ({e}); use {other}"
        ) from e
