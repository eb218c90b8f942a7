"""Public API of the text RoPE.

Layers, bottom up:

1. The backends' launchers of the call ``"rope"`` (one kernel launch into a given output; the
   Triton one in ``dsfuse.text_rope.triton``), reached through the registry (``BACKENDS``).
2. Declared ops (``dsfuse._common.declare_op``, one per fused backend by
   ``declare_backend_ops``): ``dsfuse::text_rope_freqs``, ``dsfuse::text_rope``
   (differentiable: its gradient is the conjugate rotation), ``dsfuse::text_rope_out`` and
   ``dsfuse::text_rope_`` (in place, differentiable in eager mode).
   ``torch.compile(fullgraph=True)`` traces them as opaque nodes, so the frequencies and the
   rotation keep their eager bits; eager calls skip the dispatcher.
3. [apply_rope][dsfuse.text_rope.apply_rope]: validation, backend choice, stream, ``out=``/``inplace``.
"""

from __future__ import annotations

import torch

from dsfuse._common import (
    REFERENCE, check_dtype, check_outputs_free, check_same_device, check_tensor, declare_backend_ops, declare_op,
    on_stream, register,
)
from dsfuse._common.plans import Plans
from dsfuse.text_rope.reference import (
    rope_freqs,
    rope_reference,
    rope_reference_inplace,
)

__all__ = ["apply_rope"]

BACKENDS = register("text_rope")
PLANS = Plans(BACKENDS, "rope")  # apply_rope's verdicts (checks passed, backend chosen) by call signature


# -- declared ops ----------------------------------------------------------------------------


def _freqs(angles: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, S, P, 2]`` (cos, sin): the model's ``torch.polar(ones_like(angles), angles)`` (same
    trig bits). The modulus is filled per call: a cached device constant would be unordered against
    other streams and could live in a CUDA-graph pool that is later reused."""
    return torch.view_as_real(rope_freqs(angles))


freqs_op = declare_op("text_rope_freqs", _freqs, fake=lambda angles: angles.new_empty((*angles.shape, 2)))


def _save_freqs(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.conj = inputs[2]


def _rotate_back(backend: str):
    def backward(ctx, grad):
        """d(x * f)/dx applied to grad is grad * conj(f); ``grad_sum`` reproduces eager's sum of the
        copied-channel and rotated-channel gradient paths (-0.0 -> +0.0)."""
        (freqs,) = ctx.saved_tensors
        return (rotate_ops[backend](grad, freqs, not ctx.conj, True),)

    return backward


def _rotating(backend: str):
    def _rotate(values: torch.Tensor, freqs: torch.Tensor, conj: bool, grad_sum: bool) -> torch.Tensor:
        out = torch.empty(values.shape, dtype=values.dtype, device=values.device)
        return BACKENDS.load(backend)["rope"](values, freqs, out, conj=conj, grad_sum=grad_sum)

    return _rotate, {"backward": _rotate_back(backend)}


rotate_ops = declare_backend_ops(BACKENDS, "text_rope", "rope", _rotating, setup=_save_freqs,
                                 fake=lambda values, freqs, conj, grad_sum: torch.empty_like(
                                     values, memory_format=torch.contiguous_format))


def _rotating_into(backend: str):
    def _rotate_into(values: torch.Tensor, freqs: torch.Tensor, conj: bool, out: torch.Tensor) -> torch.Tensor:
        return BACKENDS.load(backend)["rope"](values, freqs, out, conj=conj)

    return _rotate_into


rotate_into_ops = declare_backend_ops(
    BACKENDS, "text_rope_out", "rope", _rotating_into, mutates=("out",),
    aliasing=lambda values, freqs, conj, out: ({"out": out}, {"values": values, "freqs": freqs}))


def _rotating_inplace(backend: str):
    def _rotate_inplace(values: torch.Tensor, freqs: torch.Tensor, conj: bool) -> torch.Tensor:
        return BACKENDS.load(backend)["rope"](values, freqs, values, conj=conj, copy=False)

    return _rotate_inplace, {"backward": _rotate_back(backend)}


rotate_inplace_ops = declare_backend_ops(
    BACKENDS, "text_rope_", "rope", _rotating_inplace, mutates=("values",), dirty="values", setup=_save_freqs,
    aliasing=lambda values, freqs, conj: ({"values": values}, {"freqs": freqs}))


# -- public function -------------------------------------------------------------------------


def _validate(values, angles, inplace, out) -> None:
    """Every check of a call: those its signature decides (see ``dsfuse._common.plans``), then `_check_call`."""
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
    if out is not None:
        if inplace:
            raise ValueError("out: must be None when inplace=True (the result is written into values)")
        if out.shape != values.shape or out.dtype != values.dtype:
            raise ValueError(
                f"out: expected shape {list(values.shape)} and dtype {values.dtype} (those of values), "
                f"got {list(out.shape)} and {out.dtype}"
            )
        if torch.is_grad_enabled() and values.requires_grad:
            raise ValueError("out: apply_rope with out= does not support autograd (values requires grad)")
    _check_call(values, angles, inplace, out)


def _check_call(values, angles, inplace, out) -> None:
    """The checks that read more than the signature: addresses (overlap) and autograd leaves."""
    if out is not None:
        check_outputs_free({"out": out}, {"values": values, "angles": angles})
    if inplace:
        check_outputs_free({"values": values}, {"angles": angles})
        if values.requires_grad and values.is_leaf and torch.is_grad_enabled():
            raise ValueError(
                "values: a leaf tensor that requires grad cannot be rotated in place; "
                "use inplace=False or rotate a non-leaf tensor"
            )


def _choose(values, angles, inplace, backend) -> str:
    extra = []
    if angles.requires_grad and torch.is_grad_enabled():
        extra.append("angles requires grad (the fused kernels give angles no gradient)")
    if inplace and torch.is_grad_enabled() and values.requires_grad and torch.compiler.is_compiling():
        extra.append("an in-place rotation under autograd while torch.compile traces (a mutating custom op "
                     "carries no gradient formula)")
    rows = values.numel() // max(values.shape[-1], 1)
    if rows >= 2**31:
        extra.append(f"{rows} rows (batch x seq x heads): the kernel indexes rows in 32 bits")
    return BACKENDS.choose(backend, values.device, values.dtype, extra, call="rope", args=(values, angles))


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

    On CUDA the fused result is bitwise equal to
    [rope_reference][dsfuse.text_rope.reference.rope_reference] (forward and backward, signed
    zeros, NaN and Inf included). ``angles`` gets no gradient on the fused path; when it
    requires one, ``"auto"`` takes the reference path.

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

    Examples:
        The queries of one 4096-token sequence (64 heads of 512 channels, the last 64
        rotated), the de-rotation of the attention output, and the in-place form:

        ```python
        import torch
        from dsfuse.text_rope import apply_rope, rope_angles, yarn_inv_freq

        device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the reference
        q = torch.randn(1, 256, 64, 512, device=device, dtype=torch.bfloat16)
        positions = torch.arange(256, device=device)[None]        # [1, 256]
        inv_freq = yarn_inv_freq(64, 10000.0)                      # fp32 [32]
        angles = rope_angles(positions, inv_freq)                  # [1, 256, 32]
        q_rot = apply_rope(q, angles)
        q_back = apply_rope(q_rot, angles, inverse=True)           # q, rounded
        apply_rope(q, angles, inplace=True)                        # q's tail only
        ```
    """
    which = PLANS.backend(PLANS.key(backend, inverse, inplace, values, angles, out),
                          lambda: _validate(values, angles, inplace, out) or _choose(values, angles, inplace, backend),
                          lambda: _check_call(values, angles, inplace, out))
    with on_stream(stream, values.device):
        if which == REFERENCE:
            if inplace:
                return rope_reference_inplace(values, angles, inverse)
            result = rope_reference(values, angles, inverse)
            return result if out is None else out.copy_(result)
        freqs = freqs_op(angles)
        if inplace:
            result = rotate_inplace_ops[which](values, freqs, inverse)
            return values if result is None else result  # the custom op (under compile) returns nothing
        if out is not None:
            rotate_into_ops[which](values, freqs, inverse, out)
            return out
        return rotate_ops[which](values, freqs, inverse, False)
