"""Shared machinery of every op: validation vocabulary, op declaration, backends, launch helpers."""

from dsfuse._common.backends import AUTO, BACKENDS, REFERENCE, OpBackends, gpu_family, interpreting, register
from dsfuse._common.launch import on_stream
from dsfuse._common.op import DeclaredOp, declare_op, tracing
from dsfuse._common.validation import (
    FLOAT_DTYPES,
    addresses_known,
    check_aligned,
    check_contiguous,
    check_dtype,
    check_no_internal_overlap,
    check_no_overlap,
    check_out,
    check_outputs_free,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    memory_span,
)

__all__ = [
    "AUTO",
    "BACKENDS",
    "FLOAT_DTYPES",
    "REFERENCE",
    "DeclaredOp",
    "OpBackends",
    "addresses_known",
    "check_aligned",
    "check_contiguous",
    "check_dtype",
    "check_no_internal_overlap",
    "check_no_overlap",
    "check_out",
    "check_outputs_free",
    "check_same_device",
    "check_same_dtype",
    "check_shape",
    "tracing",
    "check_tensor",
    "declare_op",
    "gpu_family",
    "interpreting",
    "memory_span",
    "on_stream",
    "register",
]
