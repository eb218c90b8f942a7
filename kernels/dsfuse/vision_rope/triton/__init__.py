"""The Triton backend of the vision RoPE: forward and backward kernels (`kernels`), its table.

``TABLE`` says what the backend serves; the kernel module is imported on first use. Names the
table does not define (``launch_backward``, ``TOKENS_PER_PROGRAM``, ``AOT_SPECS``, ...) are read
from the kernel module.
"""

from __future__ import annotations

import torch

from dsfuse._common.backends import KERNEL_DTYPES, BackendTable, kernel_module_getattr

KERNELS = "dsfuse.vision_rope.triton.kernels"


def head_dim_reasons(dim: int) -> list[str]:
    """What the Triton kernels ask of the head dim: ``D / 2`` a power of two (their channel block)."""
    half = dim // 2
    return [] if half & (half - 1) == 0 else [f"D / 2 = {half} is not a power of two (the Triton kernels' "
                                               "channel block)"]


def _backward_reasons(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor) -> list[str]:
    return head_dim_reasons(dq.shape[-1])


def _forward_reasons(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> list[str]:
    return head_dim_reasons(qkv.shape[1] // (3 * heads))


def _load() -> dict:
    from dsfuse.vision_rope.triton import kernels

    return {"backward": kernels.launch_backward, "forward": kernels.launch_forward}


TABLE = BackendTable("triton", dtypes=KERNEL_DTYPES, calls={"backward": _backward_reasons, "forward": _forward_reasons},
                     kernels=(KERNELS,), load=_load)

__getattr__ = kernel_module_getattr(KERNELS)
