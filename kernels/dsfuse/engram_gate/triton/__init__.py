"""The Triton backend of the Engram gate: forward and backward kernels (`kernels`), its table.

``TABLE`` says what the backend serves; it reads the kernels' width limit from the kernel module
(imported with the table: Triton is always installed, and torch.compile traces the reasons). Names
the table does not define (``launch_forward``, ``workspace_elements``, ``MAX_DIM``, ...) are read from
the kernel module. ``auto`` takes this backend on Hopper and Blackwell (see the CuTe DSL table).
"""

from __future__ import annotations

import torch

from dsfuse._common.backends import KERNEL_DTYPES, BackendTable, kernel_module_getattr
from dsfuse.engram_gate.triton import kernels

KERNELS = "dsfuse.engram_gate.triton.kernels"


def _width_reasons(x: torch.Tensor, *_) -> list[str]:
    """Why the kernels cannot serve a gate of this width (the forward keeps a row in registers)."""
    dim, limit = x.shape[-1], kernels.MAX_DIM
    return [f"D = {dim} is above the kernels' limit of {limit} channels per row"] if dim > limit else []


def _backward_reasons(dout: torch.Tensor, x: torch.Tensor, *_) -> list[str]:
    return _width_reasons(x)


def _load() -> dict:
    return {"forward": kernels.launch_forward, "backward": kernels.launch_backward,
            "workspace_elements": kernels.workspace_elements}


TABLE = BackendTable("triton", dtypes=KERNEL_DTYPES, calls={"forward": _width_reasons, "backward": _backward_reasons},
                     kernels=(KERNELS,), load=_load)

__getattr__ = kernel_module_getattr(KERNELS)
