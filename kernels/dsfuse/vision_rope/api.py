"""Public API of the vision RoPE.

Layers, bottom up: the launchers (:mod:`dsfuse.vision_rope.triton`); ``torch.library``
custom ops ``dsfuse::vision_rope_bwd``, ``dsfuse::vision_rope_bwd_out`` and
``dsfuse::vision_rope_fwd`` (with its autograd formula) that ``torch.compile`` traces as
opaque nodes; :class:`VisionRopeFunction` for eager training (fused forward, fused
backward that packs dQKV in one kernel); and the functions below.
"""

from __future__ import annotations

import torch

from dsfuse._common import (
    check_dtype,
    check_no_overlap,
    check_same_device,
    check_tensor,
    on_stream,
    resolve_backend,
    triton_can_run_on,
)
from dsfuse.vision_rope.reference import attention_front, vision_rope_backward_reference
from dsfuse.vision_rope.triton import FUSED_DTYPES, launch_backward, launch_forward

__all__ = ["VisionRopeFunction", "vision_rope_attention_front", "vision_rope_backward", "vision_rope_forward"]


# -- custom ops ------------------------------------------------------------------------------


def _new_dqkv(dq: torch.Tensor) -> torch.Tensor:
    heads, tokens, dim = dq.shape
    return torch.empty((tokens, 3 * heads * dim), dtype=dq.dtype, device=dq.device)


@torch.library.custom_op("dsfuse::vision_rope_bwd", mutates_args=())
def _bwd_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return launch_backward(dq, dk, dv, cos, sin, _new_dqkv(dq))


@_bwd_op.register_fake
def _(dq, dk, dv, cos, sin):
    return _new_dqkv(dq)


@torch.library.custom_op("dsfuse::vision_rope_bwd_out", mutates_args=("out",))
def _bwd_out_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out: torch.Tensor) -> None:
    launch_backward(dq, dk, dv, cos, sin, out)


@torch.library.custom_op("dsfuse::vision_rope_bwd_qk", mutates_args=())
def _bwd_qk_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient of qkv from dq and dk alone (zeros in the v columns)."""
    return launch_backward(dq, dk, None, cos, sin, _new_dqkv(dq))


@_bwd_qk_op.register_fake
def _(dq, dk, cos, sin):
    return _new_dqkv(dq)


def _new_rotated(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, width = qkv.shape
    shape = (tokens, heads, width // (3 * heads))
    return (torch.empty(shape, dtype=qkv.dtype, device=qkv.device),
            torch.empty(shape, dtype=qkv.dtype, device=qkv.device))


@torch.library.custom_op("dsfuse::vision_rope_fwd", mutates_args=())
def _fwd_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    q_thd, k_thd = _new_rotated(qkv, heads)
    launch_forward(qkv, cos, sin, heads, q_thd, k_thd)
    return q_thd, k_thd


@_fwd_op.register_fake
def _(qkv, cos, sin, heads):
    return _new_rotated(qkv, heads)


def _fwd_setup(ctx, inputs, output):
    _, cos, sin, _ = inputs
    ctx.save_for_backward(cos, sin)


def _fwd_backward(ctx, dq_thd, dk_thd):
    cos, sin = ctx.saved_tensors
    # the v columns of qkv get their gradient through v's own view; this op adds zeros there
    dqkv = torch.ops.dsfuse.vision_rope_bwd_qk(dq_thd.transpose(0, 1), dk_thd.transpose(0, 1), cos, sin)
    return dqkv, None, None, None


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _v_htd(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """v as the model takes it: a view of qkv's last column block, [H, T, D]."""
    return qkv.chunk(3, -1)[2].view(qkv.shape[0], heads, -1).transpose(0, 1)


class VisionRopeFunction(torch.autograd.Function):
    """qkv ``[T, 3HD]`` -> ``q, k, v`` ``[H, T, D]`` views for SDPA; backward packs dQKV in one kernel.

    Forward: one kernel rotates q and k into ``[T, H, D]`` buffers (returned transposed,
    exactly the layout the model feeds SDPA); v is a view of ``qkv``. Backward: the
    fused kernel reads dQ, dK, dV in whatever layout autograd delivers (the model's
    3D math SDPA delivers HTD, HDT, HTD) and writes ``dqkv``.
    """

    @staticmethod
    def forward(ctx, qkv, cos, sin, heads):
        q_thd, k_thd = _new_rotated(qkv, heads)
        launch_forward(qkv, cos, sin, heads, q_thd, k_thd)
        ctx.save_for_backward(cos, sin)
        return q_thd.transpose(0, 1), k_thd.transpose(0, 1), _v_htd(qkv, heads)

    @staticmethod
    def backward(ctx, dq_htd, dk_htd, dv_htd):
        cos, sin = ctx.saved_tensors
        dqkv = _new_dqkv(dq_htd)
        launch_backward(dq_htd, dk_htd, dv_htd, cos, sin, dqkv)
        return dqkv, None, None, None


# -- public functions ------------------------------------------------------------------------


def _tables(name_cos, cos, name_sin, sin, tokens, half):
    """Accept ``[T, D/2]`` or ``[T, 1, D/2]`` fp32 tables; return them as ``[T, D/2]``."""
    out = []
    for name, t in ((name_cos, cos), (name_sin, sin)):
        check_tensor(name, t)
        check_dtype(name, t, (torch.float32,))
        if t.ndim == 3 and t.shape[1] == 1:
            t = t[:, 0]
        if tuple(t.shape) != (tokens, half):
            raise ValueError(f"{name}: expected shape [{tokens}, {half}] (or [{tokens}, 1, {half}]), got "
                             f"{list(t.shape)}")
        out.append(t)
    return out


def _check_aligned(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got address {t.data_ptr():#x}")


def vision_rope_backward(
    dq_htd: torch.Tensor,
    dk_hdt: torch.Tensor,
    dv_htd: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Split-half rotary backward of Q and K plus V packing: native layouts in, packed dQKV out.

    Args:
        dq_htd: gradient of the rotated queries, contiguous ``[H, T, D]``.
        dk_hdt: gradient of the rotated keys in the storage 3D math SDPA gives it:
            a contiguous ``[H, D, T]`` tensor (``dk.transpose(1, 2)`` of the
            ``[H, T, D]`` gradient).
        dv_htd: gradient of the values, contiguous ``[H, T, D]``.
        cos: fp32 ``[T, D/2]`` or ``[T, 1, D/2]`` (:func:`~dsfuse.vision_rope.vision_cos_sin`).
        sin: fp32, the shape of ``cos``.
        out: caller-owned contiguous ``[T, 3 * H * D]`` output in the gradients'
            dtype; must not overlap any input.
        stream: CUDA stream to run on (default: the current stream).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``dqkv`` ``[T, 3 * H * D]``: the gradient of the ``qkv`` projection output,
        q columns then k columns then v columns, head-major within each.

    The three gradients share a dtype (bf16, fp16 or fp32 fused) and 16-byte aligned
    storage; ``D`` is even. ``T`` changes without recompiling. On CUDA the result
    is bitwise equal to eager autograd of the model's rotary.
    """
    for name, t in (("dq_htd", dq_htd), ("dk_hdt", dk_hdt), ("dv_htd", dv_htd)):
        check_tensor(name, t)
        if t.ndim != 3:
            raise ValueError(f"{name}: expected 3 dims, got shape {list(t.shape)}")
    heads, tokens, dim = dq_htd.shape
    if dim % 2:
        raise ValueError(f"dq_htd: expected an even head dim D, got {dim}")
    if tuple(dk_hdt.shape) != (heads, dim, tokens):
        raise ValueError(f"dk_hdt: expected shape [H, D, T] = [{heads}, {dim}, {tokens}], got {list(dk_hdt.shape)}")
    if tuple(dv_htd.shape) != (heads, tokens, dim):
        raise ValueError(f"dv_htd: expected shape [H, T, D] = [{heads}, {tokens}, {dim}], got {list(dv_htd.shape)}")
    for name, t in (("dk_hdt", dk_hdt), ("dv_htd", dv_htd)):
        if t.dtype != dq_htd.dtype:
            raise TypeError(f"{name}: expected dtype {dq_htd.dtype} (that of dq_htd), got {t.dtype}")
    cos, sin = _tables("cos", cos, "sin", sin, tokens, dim // 2)
    check_same_device(dq_htd=dq_htd, dk_hdt=dk_hdt, dv_htd=dv_htd, cos=cos, sin=sin, out=out)
    for name, t, storage in (("dq_htd", dq_htd, "[H, T, D]"), ("dk_hdt", dk_hdt, "[H, D, T]"),
                             ("dv_htd", dv_htd, "[H, T, D]")):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous {storage} storage, got strides {list(t.stride())}")
    if out is not None:
        check_tensor("out", out)
        if tuple(out.shape) != (tokens, 3 * heads * dim) or out.dtype != dq_htd.dtype or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous [{tokens}, {3 * heads * dim}] {dq_htd.dtype} tensor, got "
                             f"{list(out.shape)} {out.dtype} with strides {list(out.stride())}")
    if not torch.compiler.is_compiling():
        _check_aligned(dq_htd=dq_htd, dk_hdt=dk_hdt, dv_htd=dv_htd, **({"out": out} if out is not None else {}))
        if out is not None:
            check_no_overlap({"out": out}, {"dq_htd": dq_htd, "dk_hdt": dk_hdt, "dv_htd": dv_htd, "cos": cos,
                                            "sin": sin})
    reasons = []
    if not triton_can_run_on(dq_htd):
        reasons.append(f"tensors are on {dq_htd.device} (Triton needs CUDA, or TRITON_INTERPRET=1 for CPU)")
    if dq_htd.dtype not in FUSED_DTYPES:
        reasons.append(f"dtype {dq_htd.dtype} is not one of bf16, fp16, fp32")
    which = resolve_backend(backend, reasons, on_cuda=dq_htd.is_cuda)
    dk_htd = dk_hdt.transpose(1, 2)
    with on_stream(stream, dq_htd.device):
        if which == "reference":
            result = vision_rope_backward_reference(dq_htd, dk_hdt, dv_htd, cos, sin)
            return result if out is None else out.copy_(result)
        if torch.compiler.is_compiling():
            if out is None:
                return torch.ops.dsfuse.vision_rope_bwd(dq_htd, dk_htd, dv_htd, cos, sin)
            torch.ops.dsfuse.vision_rope_bwd_out(dq_htd, dk_htd, dv_htd, cos, sin, out)
            return out
        return launch_backward(dq_htd, dk_htd, dv_htd, cos, sin, _new_dqkv(dq_htd) if out is None else out)


def _check_front(qkv, cos, sin, heads):
    check_tensor("qkv", qkv)
    if not isinstance(heads, int) or heads < 1:
        raise TypeError(f"heads: expected a positive int, got {heads!r}")
    if qkv.ndim != 2 or qkv.shape[1] % (3 * heads) or (qkv.shape[1] // (3 * heads)) % 2:
        raise ValueError(f"qkv: expected [T, 3 * heads * D] with even D for heads={heads}, got {list(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv: expected unit channel stride, got strides {list(qkv.stride())}")
    cos, sin = _tables("cos", cos, "sin", sin, qkv.shape[0], qkv.shape[1] // (6 * heads))
    check_same_device(qkv=qkv, cos=cos, sin=sin)
    reasons = []
    if not triton_can_run_on(qkv):
        reasons.append(f"qkv is on {qkv.device} (Triton needs CUDA, or TRITON_INTERPRET=1 for CPU)")
    if qkv.dtype not in FUSED_DTYPES:
        reasons.append(f"dtype {qkv.dtype} is not one of bf16, fp16, fp32")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        reasons.append("cos/sin require grad (the fused path gives the tables no gradient)")
    return cos, sin, reasons


def vision_rope_attention_front(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, *,
                                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable drop-in for the model's front end: ``qkv`` -> ``q, k, v`` ``[H, T, D]`` for SDPA.

    Args:
        qkv: ``[T, 3 * heads * D]`` output of the ``wqkv`` projection (unit channel stride).
        cos: fp32 ``[T, D/2]`` or ``[T, 1, D/2]``.
        sin: fp32, the shape of ``cos``.
        heads: number of heads ``H``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``q, k, v`` as ``[H, T, D]`` views: q and k rotated (split-half pairs ``(i, i + D/2)``)
        in ``[T, H, D]`` storage, v a view of ``qkv``, exactly as the model hands them to SDPA.
        Forward and backward are bitwise equal to the model's; the backward writes
        ``qkv``'s gradient in one kernel.
    """
    cos, sin, reasons = _check_front(qkv, cos, sin, heads)
    which = resolve_backend(backend, reasons, on_cuda=qkv.is_cuda)
    if which == "reference":
        return attention_front(qkv, cos, sin, heads)
    if torch.compiler.is_compiling():
        q_thd, k_thd = torch.ops.dsfuse.vision_rope_fwd(qkv, cos, sin, heads)
        return q_thd.transpose(0, 1), k_thd.transpose(0, 1), _v_htd(qkv, heads)
    return VisionRopeFunction.apply(qkv, cos, sin, heads)


def vision_rope_forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, *,
                        stream: torch.cuda.Stream | None = None, backend: str = "auto"):
    """Non-differentiable fused forward: ``q, k, v`` ``[H, T, D]`` views (see :func:`vision_rope_attention_front`)."""
    with torch.no_grad(), on_stream(stream, qkv.device):
        return vision_rope_attention_front(qkv, cos, sin, heads, backend=backend)
