"""Backend choice and stream handling shared by every op.

``backend`` follows one convention across dsfuse:

* ``"auto"``: the fused Triton kernels for CUDA tensors they support, the eager
  reference otherwise (CPU tensors, unsupported dtypes, inputs the fused path
  does not differentiate). The choice never changes the numbers where the op's
  contract promises bitwise equality with the reference.
* ``"triton"``: the fused kernels or an error saying why they cannot run. With
  ``TRITON_INTERPRET=1`` they also run on CPU tensors (how CI tests them).
* ``"reference"``: the eager reference.
"""

from __future__ import annotations

import contextlib
import os

import torch

BACKENDS = ("auto", "triton", "reference")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_can_run_on(t: torch.Tensor) -> bool:
    return t.is_cuda or (interpreting() and t.device.type == "cpu")


def resolve_backend(backend: str, reasons_against_triton: list[str], *, on_cuda: bool) -> str:
    """Pick ``"triton"`` or ``"reference"``.

    ``reasons_against_triton`` lists why the fused path cannot serve this call
    (empty when it can). ``"triton"`` with a reason raises; ``"auto"`` takes the
    reference then, and also for CPU tensors even under the interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if backend == "triton":
        if reasons_against_triton:
            raise ValueError("backend='triton' cannot run this call: " + "; ".join(reasons_against_triton))
        return "triton"
    return "triton" if on_cuda and not reasons_against_triton else "reference"


def on_stream(stream: torch.cuda.Stream | None, device: torch.device):
    """Context that makes ``stream`` current (allocations and launches go to it).

    ``None`` keeps the current stream. A stream on another device is an error.
    """
    if stream is None:
        return contextlib.nullcontext()
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream: expected a torch.cuda.Stream or None, got {type(stream).__name__}")
    if device.type != "cuda" or stream.device != device:
        raise ValueError(f"stream: expected a stream on {device}, got one on {stream.device}")
    return torch.cuda.stream(stream)
