"""The CuTe DSL backend of the Engram gate: forward and backward kernels (`kernels`), its table.

``TABLE`` imports without the ``cutedsl`` extra; the kernel module (which imports ``cutlass``) is
imported on first use. Names the table does not define (``launch_forward``, ``shape_reasons``,
``workspace_elements``, ``CACHE``, ...) are read from the kernel module.

``auto`` takes Triton on Hopper and Blackwell; this backend is chosen by name. Measured on the
H200 (experiments/engram_gate/raw/20261201-022130-h200, cited on the op page): Triton's forward and
forward + backward are the faster; the CuTe DSL backward alone is faster, but the backends' last
bits differ, so auto does not change them with the extras installed. No B200 run yet.
"""

from __future__ import annotations

import torch

from dsfuse._common.backends import KERNEL_DTYPES, BackendTable, kernel_module_getattr
from dsfuse._common.cutedsl import kernel_module

KERNELS = "dsfuse.engram_gate.cutedsl.kernels"

_kernels = kernel_module(KERNELS)


def _reasons(x: torch.Tensor, backward: bool, tensors: dict) -> list[str]:
    """A geometry the kernels compile for, and 128-bit aligned rows (16-byte aligned data pointers
    and row strides) of every tensor of the call."""
    kernels = _kernels()
    return (kernels.shape_reasons(x.dtype, x.shape[1], x.shape[2], backward=backward)
            + kernels.layout_reasons(**{name: t for name, t in tensors.items() if name != "token_mask"}))


def _forward_reasons(x: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, token_mask: torch.Tensor,
                     out: torch.Tensor | None = None, saved: torch.Tensor | None = None) -> list[str]:
    return _reasons(x, False, dict(x=x, kv=kv, weight=weight, out=out, saved=saved))


def _backward_reasons(dout: torch.Tensor, x: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor,
                      saved: torch.Tensor | None = None, dx: torch.Tensor | None = None,
                      dkv: torch.Tensor | None = None, dweight: torch.Tensor | None = None,
                      workspace: torch.Tensor | None = None) -> list[str]:
    return _reasons(x, True, dict(x=x, dout=dout, kv=kv, weight=weight, saved=saved, dx=dx, dkv=dkv,
                                  dweight=dweight, workspace=workspace))


def _load() -> dict:
    kernels = _kernels()
    return {"forward": kernels.launch_forward, "backward": kernels.launch_backward,
            "workspace_elements": kernels.workspace_elements}


TABLE = BackendTable("cutedsl", dtypes=KERNEL_DTYPES, calls={"forward": _forward_reasons, "backward": _backward_reasons},
                     kernels=(KERNELS,), load=_load, auto={"sm_90": None, "sm_100": None})

__getattr__ = kernel_module_getattr(KERNELS)
