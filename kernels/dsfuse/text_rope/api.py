"""Public API of the text RoPE.

Layers, bottom up:

1. :func:`~dsfuse.text_rope.triton.launch_rope`: one kernel launch into a given output.
2. ``torch.library`` custom ops (``dsfuse::text_rope_freqs``, ``dsfuse::text_rope``,
   ``dsfuse::text_rope_out``, ``dsfuse::text_rope_``) wrapping it, with the
   autograd formula registered on ``dsfuse::text_rope``. ``torch.compile(fullgraph=True)``
   traces them as opaque nodes, so the frequencies and the rotation keep their
   eager bits under compilation.
3. :class:`RopeFunction` / :class:`RopeInplaceFunction`: the same launches as
   ``autograd.Function`` for eager calls, which skip the custom-op dispatch
   (tens of microseconds of host time per call).
4. :func:`apply_rope`: validation, backend choice, stream, ``out=``/``inplace``.
"""

from __future__ import annotations

import torch

from dsfuse._common import (
    check_dtype,
    check_no_internal_overlap,
    check_no_overlap,
    check_same_device,
    check_tensor,
    on_stream,
    resolve_backend,
    triton_can_run_on,
)
from dsfuse.text_rope.reference import rope_freqs, rope_reference, rope_reference_inplace
from dsfuse.text_rope.triton import FUSED_DTYPES, launch_rope

__all__ = ["apply_rope", "RopeFunction", "RopeInplaceFunction"]


# -- custom ops ------------------------------------------------------------------------------


def _freqs(angles: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, S, P, 2]`` (cos, sin) from the eager ``torch.polar`` (same trig bits)."""
    return torch.view_as_real(rope_freqs(angles))


@torch.library.custom_op("dsfuse::text_rope_freqs", mutates_args=())
def _freqs_op(angles: torch.Tensor) -> torch.Tensor:
    return _freqs(angles)


@_freqs_op.register_fake
def _(angles):
    return angles.new_empty((*angles.shape, 2))


def _rope_new(values: torch.Tensor, freqs: torch.Tensor, conj: bool, grad_sum: bool) -> torch.Tensor:
    out = torch.empty(values.shape, dtype=values.dtype, device=values.device)
    return launch_rope(values, freqs, out, conj=conj, grad_sum=grad_sum)


@torch.library.custom_op("dsfuse::text_rope", mutates_args=())
def _rope_op(values: torch.Tensor, freqs: torch.Tensor, conj: bool, grad_sum: bool) -> torch.Tensor:
    return _rope_new(values, freqs, conj, grad_sum)


@_rope_op.register_fake
def _(values, freqs, conj, grad_sum):
    return torch.empty_like(values, memory_format=torch.contiguous_format)


def _rope_setup(ctx, inputs, output):
    _, freqs, conj, _ = inputs
    ctx.save_for_backward(freqs)
    ctx.conj = conj


def _rope_backward(ctx, grad):
    (freqs,) = ctx.saved_tensors
    # d(x * f)/dx applied to grad is grad * conj(f); GRAD_SUM reproduces eager's
    # sum of the copied-channel and rotated-channel gradient paths (-0.0 -> +0.0).
    return torch.ops.dsfuse.text_rope(grad, freqs, not ctx.conj, True), None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


@torch.library.custom_op("dsfuse::text_rope_out", mutates_args=("out",))
def _rope_out_op(values: torch.Tensor, freqs: torch.Tensor, conj: bool, out: torch.Tensor) -> None:
    launch_rope(values, freqs, out, conj=conj)


@torch.library.custom_op("dsfuse::text_rope_", mutates_args=("values",))
def _rope_inplace_op(values: torch.Tensor, freqs: torch.Tensor, conj: bool) -> None:
    launch_rope(values, freqs, values, conj=conj, copy=False)


class RopeFunction(torch.autograd.Function):
    """Out-of-place rotary with its backward (the conjugate rotation), for eager calls."""

    @staticmethod
    def forward(ctx, values, freqs, conj):
        ctx.save_for_backward(freqs)
        ctx.conj = conj
        return _rope_new(values, freqs, conj, False)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _rope_new(grad, freqs, not ctx.conj, True), None, None


class RopeInplaceFunction(torch.autograd.Function):
    """In-place rotary of the last ``2P`` channels with autograd (``mark_dirty``).

    The gradient is the same as for the out-of-place form: the incoming gradient
    rotated by the conjugate frequencies on the rotary channels, copied elsewhere.
    """

    @staticmethod
    def forward(ctx, values, freqs, conj):
        launch_rope(values, freqs, values, conj=conj, copy=False)
        ctx.mark_dirty(values)
        ctx.save_for_backward(freqs)
        ctx.conj = conj
        return values

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _rope_new(grad, freqs, not ctx.conj, True), None, None


# -- public function -------------------------------------------------------------------------


def _validate(values, angles, inplace, out) -> None:
    check_tensor("values", values)
    check_tensor("angles", angles)
    if values.ndim not in (3, 4):
        raise ValueError(f"values: expected [B, S, C] or [B, S, H, C], got shape {list(values.shape)}")
    if not values.is_floating_point():
        raise TypeError(f"values: expected a floating-point dtype, got {values.dtype}")
    check_dtype("angles", angles, (torch.float32,))
    batch, seq, channels = values.shape[0], values.shape[1], values.shape[-1]
    if angles.ndim != 3 or angles.shape[0] not in (1, batch) or angles.shape[1] != seq:
        raise ValueError(
            f"angles: expected shape [{batch} (or 1), {seq}, P] for values of shape "
            f"{list(values.shape)}, got {list(angles.shape)}"
        )
    pairs = angles.shape[2]
    if pairs < 1 or 2 * pairs > channels:
        raise ValueError(
            f"angles: expected 1 <= P <= channels / 2 = {channels // 2} rotary pairs, got P = {pairs}"
        )
    if out is not None:
        check_tensor("out", out)
    check_same_device(values=values, angles=angles, out=out)
    aliasing_checkable = not torch.compiler.is_compiling()  # fake tensors have no addresses
    if out is not None:
        if inplace:
            raise ValueError("out: must be None when inplace=True (the result is written into values)")
        if out.shape != values.shape or out.dtype != values.dtype:
            raise ValueError(
                f"out: expected shape {list(values.shape)} and dtype {values.dtype} (those of values), "
                f"got {list(out.shape)} and {out.dtype}"
            )
        check_no_internal_overlap("out", out)
        if aliasing_checkable:
            check_no_overlap({"out": out}, {"values": values, "angles": angles})
    if inplace:
        check_no_internal_overlap("values", values)
        if aliasing_checkable:
            check_no_overlap({"values": values}, {"angles": angles})
        if values.requires_grad and values.is_leaf and torch.is_grad_enabled():
            raise ValueError(
                "values: a leaf tensor that requires grad cannot be rotated in place; "
                "use inplace=False or rotate a non-leaf tensor"
            )


def _reasons_against_triton(values, angles) -> list[str]:
    reasons = []
    if not triton_can_run_on(values):
        reasons.append(f"values is on {values.device} (Triton needs CUDA, or TRITON_INTERPRET=1 for CPU)")
    if values.dtype not in FUSED_DTYPES:
        reasons.append(f"values dtype {values.dtype} is not one of bf16, fp16, fp32")
    if angles.requires_grad and torch.is_grad_enabled():
        reasons.append("angles requires grad (the fused path gives angles no gradient)")
    return reasons


def apply_rope(
    values: torch.Tensor,
    angles: torch.Tensor,
    inverse: bool = False,
    *,
    inplace: bool = False,
    out: torch.Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Rotate the last ``2P`` channels of ``values`` as adjacent complex pairs (DeepSeek-V4.1 RoPE).

    Args:
        values: ``[B, S, C]`` or ``[B, S, H, C]``, bf16/fp16/fp32 for the fused
            path (any floating dtype on the reference path). Any strides, e.g. a
            channel slice of a wider tensor; no hidden ``.contiguous()`` copy.
        angles: fp32 ``[B, S, P]`` or ``[1, S, P]`` (broadcast over the batch):
            the rotation angle of each pair, ``position * inv_freq``.
        inverse: rotate by the conjugate (de-rotation of the attention output).
        inplace: write the rotated channels into ``values`` and leave the
            leading ``C - 2P`` channels untouched (the model's in-place form);
            returns ``values``. Differentiable for non-leaf ``values``.
        out: caller-owned output with the shape and dtype of ``values`` (any
            non-aliasing strides); must not overlap ``values`` or ``angles``.
            Not differentiable (like torch's ``out=`` functions).
        stream: CUDA stream to run on (default: the current stream). The
            caller orders it against the streams that produce and consume
            the tensors.
        backend: ``"auto"`` (Triton on CUDA when it applies, eager otherwise),
            ``"triton"`` (error when the kernel cannot serve the call) or
            ``"reference"``.

    Returns:
        The rotated tensor: a new contiguous tensor, ``out``, or ``values``.

    On CUDA the fused result is bitwise equal to :func:`~dsfuse.text_rope.reference.rope_reference`
    (forward and backward, signed zeros, NaN and Inf included). ``angles`` gets no
    gradient on the fused path; when it requires one, ``"auto"`` takes the
    reference path.

    Example:
        >>> q = torch.randn(1, 4096, 64, 512, device="cuda", dtype=torch.bfloat16)
        >>> angles = torch.arange(4096, device="cuda")[None, :, None] * inv_freq  # [1, 4096, 32]
        >>> q_rot = apply_rope(q, angles.float())
    """
    _validate(values, angles, inplace, out)
    grad_needed = torch.is_grad_enabled() and values.requires_grad
    if out is not None and grad_needed:
        raise ValueError("out: apply_rope with out= does not support autograd (values requires grad)")
    which = resolve_backend(backend, _reasons_against_triton(values, angles), on_cuda=values.is_cuda)

    with on_stream(stream, values.device):
        if which == "reference":
            if inplace:
                return rope_reference_inplace(values, angles, inverse)
            result = rope_reference(values, angles, inverse)
            if out is None:
                return result
            out.copy_(result)
            return out
        if torch.compiler.is_compiling():  # opaque custom ops: no graph break, eager bits
            freqs = torch.ops.dsfuse.text_rope_freqs(angles)
            if inplace:
                torch.ops.dsfuse.text_rope_(values, freqs, inverse)
                return values
            if out is not None:
                torch.ops.dsfuse.text_rope_out(values, freqs, inverse, out)
                return out
            return torch.ops.dsfuse.text_rope(values, freqs, inverse, False)
        freqs = _freqs(angles)
        if inplace:
            if grad_needed:
                return RopeInplaceFunction.apply(values, freqs, inverse)
            launch_rope(values, freqs, values, conj=inverse, copy=False)
            return values
        if out is not None:
            return launch_rope(values, freqs, out, conj=inverse)
        if grad_needed:
            return RopeFunction.apply(values, freqs, inverse)
        return _rope_new(values, freqs, inverse, False)
