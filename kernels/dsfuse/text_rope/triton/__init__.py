"""The Triton backend of the text RoPE: one kernel (`kernels`), its table for the registry.

``TABLE`` says what the backend serves; the kernel module is imported on first use. Names the
table does not define (``launch_rope``, ``AOT_SPECS``, ...) are read from the kernel module.
"""

from __future__ import annotations

from dsfuse._common.backends import (
    KERNEL_DTYPES,
    BackendTable,
    kernel_module_getattr,
    no_reasons,
)

KERNELS = "dsfuse.text_rope.triton.kernels"


def _load() -> dict:
    from dsfuse.text_rope.triton import kernels

    return {"rope": kernels.launch_rope}


TABLE = BackendTable("triton", dtypes=KERNEL_DTYPES, calls={"rope": no_reasons}, kernels=(KERNELS,), load=_load)

__getattr__ = kernel_module_getattr(KERNELS)
