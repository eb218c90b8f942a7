"""Shared machinery of every op: argument validation and launch helpers."""

from dsfuse._common.launch import (
    BACKENDS,
    interpreting,
    on_stream,
    resolve_backend,
    triton_can_run_on,
)
from dsfuse._common.validation import (
    check_dtype,
    check_no_internal_overlap,
    check_no_overlap,
    check_same_device,
    check_shape,
    check_tensor,
    memory_span,
)

__all__ = [
    "BACKENDS",
    "check_dtype",
    "check_no_internal_overlap",
    "check_no_overlap",
    "check_same_device",
    "check_shape",
    "check_tensor",
    "interpreting",
    "memory_span",
    "on_stream",
    "resolve_backend",
    "triton_can_run_on",
]
