"""The CuTe DSL backend of the vision RoPE: the backward kernel (`kernels`), its table.

``TABLE`` imports without the ``cutedsl`` extra; the kernel module (which imports ``cutlass``) is
imported on first use: a launch, or the call's reasons (asked only where the extra is installed).
Names the table does not define (``launch_backward``, ``shape_reasons``, ``CACHE``, ...) are read
from the kernel module.

``auto`` on Hopper tries this backend first (both backends are bitwise equal to autograd, so the
choice never changes a bit). Measured on the H200 (experiments/vision_rope/raw/20261201-024409-h200,
the op page's tables): faster with the cache evicted at every geometry but one small one, faster
eagerly with a hot cache everywhere (less host time per call), a little slower in graph replay with
a hot cache. Blackwell keeps Triton until a B200 run decides.
"""

from __future__ import annotations

import torch

from dsfuse._common.backends import KERNEL_DTYPES, BackendTable, kernel_module_getattr
from dsfuse._common.cutedsl import kernel_module

KERNELS = "dsfuse.vision_rope.cutedsl.kernels"

_kernels = kernel_module(KERNELS)


def _backward_reasons(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor) -> list[str]:
    """What the kernel asks beyond the op's validation: a head dim it compiles for, and the model's
    storage (``dk`` the ``[H, T, D]`` view of a contiguous ``[H, D, T]`` buffer, contiguous ``dq``
    and ``dv``, 16-byte aligned tensors and table rows)."""
    kernels = _kernels()
    heads, _, dim = dq.shape
    return kernels.shape_reasons(dq.dtype, heads, dim) + kernels.layout_reasons(dq, dk.transpose(1, 2), dv, cos,
                                                                                sin, None)


def _load() -> dict:
    return {"backward": _kernels().launch_backward}


TABLE = BackendTable("cutedsl", dtypes=KERNEL_DTYPES, calls={"backward": _backward_reasons}, kernels=(KERNELS,),
                     load=_load, auto={"sm_90": 0, "sm_100": None})

__getattr__ = kernel_module_getattr(KERNELS)
