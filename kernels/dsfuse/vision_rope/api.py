"""Public API of the vision RoPE.

Layers, bottom up: the backends' launchers (``dsfuse.vision_rope.triton``: forward and backward;
``dsfuse.vision_rope.cutedsl``: the backward, imported on first use), reached through the registry
(``BACKENDS``); declared ops (``dsfuse._common.declare_op``, one per backend that serves the call, by
``declare_backend_ops``): ``dsfuse::vision_rope_bwd`` (dQ, dK, dV or dQ, dK alone -> packed dQKV),
``dsfuse::vision_rope_bwd_out`` (into a caller's buffer), their CuTe DSL twins
``dsfuse::vision_rope_bwd_cutedsl`` and ``dsfuse::vision_rope_bwd_out_cutedsl`` (so
``backend="cutedsl"`` traces under ``torch.compile(fullgraph=True)`` too) and
``dsfuse::vision_rope_fwd`` (differentiable: rotated q, k and the v view of ``qkv``; eagerly its
backward packs dQKV in one kernel, under ``auto`` the first backend of the GPU family's order that
serves the gradients); and the functions below. The forward kernels are Triton only.
"""

from __future__ import annotations

import torch

from dsfuse._common import (
    FLOAT_DTYPES, REFERENCE, check_aligned, check_contiguous, check_dtype, check_out, check_outputs_free,
    check_same_device, check_same_dtype, check_tensor, check_tensors, declare_backend_ops, on_stream, register,
)
from dsfuse._common.backends import AUTO
from dsfuse._common.plans import Plans
from dsfuse.vision_rope.reference import attention_front, vision_rope_backward_reference

__all__ = ["vision_rope_attention_front", "vision_rope_backward", "vision_rope_forward"]

BACKENDS = register("vision_rope")  # auto's order per GPU family: the backend packages' tables
# the public functions' verdicts (checks passed, backend chosen) by call signature
BACKWARD_PLANS, FRONT_PLANS = Plans(BACKENDS, "backward"), Plans(BACKENDS, "forward")


# -- declared ops ----------------------------------------------------------------------------


def _new_dqkv(dq: torch.Tensor) -> torch.Tensor:
    heads, tokens, dim = dq.shape
    return torch.empty((tokens, 3 * heads * dim), dtype=dq.dtype, device=dq.device)


def _backward(backend: str):
    def _backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor | None, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        """dQ, dK, dV ``[H, T, D]`` logical -> new packed dQKV; ``dv=None``: zeros in the v columns."""
        return BACKENDS.load(backend)["backward"](dq, dk, dv, cos, sin, _new_dqkv(dq))

    return _backward


backward_ops = declare_backend_ops(BACKENDS, "vision_rope_bwd", "backward", _backward,
                                   fake=lambda dq, dk, dv, cos, sin: _new_dqkv(dq))


def _backward_into(backend: str):
    def _backward_into(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
        return BACKENDS.load(backend)["backward"](dq, dk, dv, cos, sin, out)

    return _backward_into


def _aliasing(dq, dk, dv, cos, sin, out):
    return {"out": out}, {"dq_htd": dq, "dk_hdt": dk, "dv_htd": dv, "cos": cos, "sin": sin}


backward_into_ops = declare_backend_ops(BACKENDS, "vision_rope_bwd_out", "backward", _backward_into,
                                        mutates=("out",), aliasing=_aliasing)


def _new_rotated(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, width = qkv.shape
    shape = (tokens, heads, width // (3 * heads))
    return (torch.empty(shape, dtype=qkv.dtype, device=qkv.device),
            torch.empty(shape, dtype=qkv.dtype, device=qkv.device))


def _v_htd(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, backward: str) -> tuple[torch.Tensor]:
    """v as the model takes it: a view of qkv's last column block, [H, T, D]."""
    return (qkv.chunk(3, -1)[2].view(qkv.shape[0], heads, -1).transpose(0, 1),)


def _save_tables(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.backward_backend = inputs[4]


def _forward(backend: str):
    def _forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 backward: str) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv ``[T, 3HD]`` -> rotated q, k as ``[H, T, D]`` views of ``[T, H, D]`` buffers (the model's
        layout). ``backward``: the backend of its backward, a backend's name or ``"auto"`` (chosen when
        the gradients arrive)."""
        q_thd, k_thd = _new_rotated(qkv, heads)
        BACKENDS.load(backend)["forward"](qkv, cos, sin, heads, q_thd, k_thd)
        return q_thd.transpose(0, 1), k_thd.transpose(0, 1)

    def _forward_grad(ctx, dq_htd, dk_htd, dv_htd=None):
        """The gradient of qkv. Eagerly dV arrives here and one kernel writes the whole row; under
        compilation v is a view outside the op, so this writes zeros in the v columns and torch adds dV.
        Under ``auto`` the first backend of the family's order that takes the gradients' storage serves
        them (the CuTe DSL kernel on Hopper takes the model's: dK the transpose of a contiguous
        ``[H, D, T]`` buffer), else the forward's backend (the same bits)."""
        cos, sin = ctx.saved_tensors
        which = ctx.backward_backend
        if which == AUTO:
            which = BACKENDS.choose(AUTO, dq_htd.device, dq_htd.dtype, call="backward",
                                    args=(dq_htd, dk_htd, dv_htd, cos, sin))
            which = backend if which == REFERENCE else which
        return (backward_ops[which](dq_htd, dk_htd, dv_htd, cos, sin),)

    return _forward, {"backward": _forward_grad}


forward_ops = declare_backend_ops(BACKENDS, "vision_rope_fwd", "forward", _forward, setup=_save_tables, views=_v_htd,
                                  fake=lambda qkv, cos, sin, heads, backward: tuple(
                                      t.transpose(0, 1) for t in _new_rotated(qkv, heads)))


# -- public functions ------------------------------------------------------------------------


def _table_reasons(cos: torch.Tensor, sin: torch.Tensor) -> list[str]:
    """Why no fused backend can read the tables (they load a row of frequencies as one vector)."""
    return [f"{name} has frequency stride {t.stride(-1)} (the kernels read unit-stride rows)"
            for name, t in (("cos", cos), ("sin", sin)) if t.stride(-1) != 1]


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


def _check_out_free(dq_htd, dk_hdt, dv_htd, cos, sin, out) -> None:
    if out is not None:
        check_outputs_free({"out": out}, {"dq_htd": dq_htd, "dk_hdt": dk_hdt, "dv_htd": dv_htd, "cos": cos, "sin": sin})


def _check_backward(dq_htd, dk_hdt, dv_htd, cos, sin, out, backend) -> str:
    """The backward's checks that its signature decides, and the backend chosen for it."""
    check_tensors({"dq_htd": dq_htd, "dk_hdt": dk_hdt, "dv_htd": dv_htd}, ndim=3)
    heads, tokens, dim = dq_htd.shape
    if dim % 2:
        raise ValueError(f"dq_htd: expected an even head dim D, got {dim}")
    if tuple(dk_hdt.shape) != (heads, dim, tokens):
        raise ValueError(f"dk_hdt: expected shape [H, D, T] = [{heads}, {dim}, {tokens}], got {list(dk_hdt.shape)}")
    if tuple(dv_htd.shape) != (heads, tokens, dim):
        raise ValueError(f"dv_htd: expected shape [H, T, D] = [{heads}, {tokens}, {dim}], got {list(dv_htd.shape)}")
    check_dtype("dq_htd", dq_htd, FLOAT_DTYPES)
    check_same_dtype("dk_hdt", dk_hdt, "dq_htd", dq_htd)
    check_same_dtype("dv_htd", dv_htd, "dq_htd", dq_htd)
    cos, sin = _tables("cos", cos, "sin", sin, tokens, dim // 2)
    check_same_device(dq_htd=dq_htd, dk_hdt=dk_hdt, dv_htd=dv_htd, cos=cos, sin=sin, out=out)
    for name, t, storage in (("dq_htd", dq_htd, "[H, T, D]"), ("dk_hdt", dk_hdt, "[H, D, T]"),
                             ("dv_htd", dv_htd, "[H, T, D]")):
        check_contiguous(name, t, storage)
        check_aligned(name, t)
    if out is not None:
        check_out("out", out, (tokens, 3 * heads * dim), dq_htd.dtype, dq_htd.device)
        check_contiguous("out", out, f"[{tokens}, {3 * heads * dim}]")
        check_aligned("out", out)
    _check_out_free(dq_htd, dk_hdt, dv_htd, cos, sin, out)
    return BACKENDS.choose(backend, dq_htd.device, dq_htd.dtype, _table_reasons(cos, sin), call="backward",
                            args=(dq_htd, dk_hdt.transpose(1, 2), dv_htd, cos, sin))


def vision_rope_backward(
    dq_htd: torch.Tensor,
    dk_hdt: torch.Tensor,
    dv_htd: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *, out: torch.Tensor | None = None, stream: torch.cuda.Stream | None = None, backend: str = "auto",
) -> torch.Tensor:
    """Split-half rotary backward of Q and K plus V packing: native layouts in, packed dQKV out.

    The three gradients share a dtype (bf16, fp16 or fp32 fused) and 16-byte aligned
    storage; ``D`` is even. ``T`` changes without recompiling. On CUDA the result
    is bitwise equal to eager autograd of the model's rotary.

    Args:
        dq_htd: gradient of the rotated queries, contiguous ``[H, T, D]``.
        dk_hdt: gradient of the rotated keys in the storage 3D math SDPA gives it:
            a contiguous ``[H, D, T]`` tensor (``dk.transpose(1, 2)`` of the
            ``[H, T, D]`` gradient).
        dv_htd: gradient of the values, contiguous ``[H, T, D]``.
        cos: fp32 ``[T, D/2]`` or ``[T, 1, D/2]`` ([vision_cos_sin][dsfuse.vision_rope.vision_cos_sin]).
        sin: fp32, the shape of ``cos``.
        out: caller-owned contiguous ``[T, 3 * H * D]`` output in the gradients'
            dtype; must not overlap any input.
        stream: CUDA stream to run on (default: the current stream).
        backend: ``"auto"`` (on Hopper the CuTe DSL kernel where the ``cutedsl`` extra is
            installed and serves the call, else Triton; Triton on Blackwell; the result is the
            same bits either way), ``"triton"``, ``"cutedsl"`` or ``"reference"``.
            ``"cutedsl"`` (the ``cutedsl`` extra) also asks for a head dim that is a multiple of
            8 with ``D / 2`` a power-of-two number of 16-byte vectors (at most 32) and 16-byte
            aligned table rows; it traces under ``torch.compile`` as its own custom op.

    Returns:
        ``dqkv`` ``[T, 3 * H * D]``, the gradient of the ``qkv`` projection output (q columns
            then k columns then v columns, head-major within each).

    Examples:
        The gradients as 3D math SDPA returns them for 16 heads of 64 channels over a
        39 x 39 patch grid (dK arrives as the transpose of a contiguous ``[H, D, T]``
        buffer):

        ```python
        import torch
        from dsfuse.vision_rope import vision_cos_sin, vision_rope_backward

        device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the reference
        cos, sin = vision_cos_sin(39, 39, device=device)  # fp32 [1521, 32]
        grad = dict(device=device, dtype=torch.bfloat16)
        dq = torch.randn(16, 1521, 64, **grad)
        dk_hdt = torch.randn(16, 64, 1521, **grad)
        dv = torch.randn(16, 1521, 64, **grad)
        dqkv = vision_rope_backward(dq, dk_hdt, dv, cos, sin)  # [1521, 3072]
        ```
    """
    which = BACKWARD_PLANS.backend(BACKWARD_PLANS.key(backend, dq_htd, dk_hdt, dv_htd, cos, sin, out),
                                   lambda: _check_backward(dq_htd, dk_hdt, dv_htd, cos, sin, out, backend),
                                   lambda: _check_out_free(dq_htd, dk_hdt, dv_htd, cos, sin, out))
    if cos.ndim == 3:
        cos, sin = cos[:, 0], sin[:, 0]
    dk_htd = dk_hdt.transpose(1, 2)
    with on_stream(stream, dq_htd.device):
        if which == REFERENCE:
            result = vision_rope_backward_reference(dq_htd, dk_hdt, dv_htd, cos, sin)
            return result if out is None else out.copy_(result)
        if out is None:
            return backward_ops[which](dq_htd, dk_htd, dv_htd, cos, sin)
        backward_into_ops[which](dq_htd, dk_htd, dv_htd, cos, sin, out)
        return out


def _check_front(qkv, cos, sin, heads):
    check_tensor("qkv", qkv)
    if not isinstance(heads, int) or heads < 1:
        raise TypeError(f"heads: expected a positive int, got {heads!r}")
    if qkv.ndim != 2 or qkv.shape[1] % (3 * heads) or (qkv.shape[1] // (3 * heads)) % 2:
        raise ValueError(f"qkv: expected [T, 3 * heads * D] with even D for heads={heads}, got {list(qkv.shape)}")
    check_dtype("qkv", qkv, FLOAT_DTYPES)
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv: expected unit channel stride, got strides {list(qkv.stride())}")
    cos, sin = _tables("cos", cos, "sin", sin, qkv.shape[0], qkv.shape[1] // (6 * heads))
    check_same_device(qkv=qkv, cos=cos, sin=sin)
    extra = _table_reasons(cos, sin)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        extra.append("cos/sin require grad (the fused kernels give the tables no gradient)")
    return cos, sin, extra


def _choose_front(qkv, cos, sin, heads, backend) -> str:
    cos, sin, extra = _check_front(qkv, cos, sin, heads)
    return BACKENDS.choose(backend, qkv.device, qkv.dtype, extra, call="forward", args=(qkv, cos, sin, heads))


def vision_rope_attention_front(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, *,
                                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable drop-in for the model's front end: ``qkv`` -> ``q, k, v`` ``[H, T, D]`` for SDPA.

    Args:
        qkv: ``[T, 3 * heads * D]`` output of the ``wqkv`` projection (unit channel stride).
        cos: fp32 ``[T, D/2]`` or ``[T, 1, D/2]``.
        sin: fp32, the shape of ``cos``.
        heads: number of heads ``H``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (the forward has no CuTe DSL kernel).

    Returns:
        The tuple ``(q, k, v)`` of ``[H, T, D]`` views, exactly as the model hands them to
            SDPA: q and k rotated (split-half pairs ``(i, i + D/2)``) in ``[T, H, D]``
            storage, v a view of ``qkv``. Forward and backward are bitwise equal to the
            model's; the backward writes ``qkv``'s gradient in one kernel.

    Examples:
        The attention of one vision block with the fused front end:

        ```python
        import torch
        from dsfuse.vision_rope import vision_cos_sin, vision_rope_attention_front

        device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the reference
        cos, sin = vision_cos_sin(39, 39, device=device)  # T = 1521
        x = torch.randn(1521, 1024, device=device, dtype=torch.bfloat16)
        wqkv = torch.nn.Linear(1024, 3 * 16 * 64, device=device, dtype=torch.bfloat16)
        qkv = wqkv(x)                                     # [1521, 3 * 16 * 64]
        q, k, v = vision_rope_attention_front(qkv, cos, sin, heads=16)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        ```
    """
    which = FRONT_PLANS.backend(FRONT_PLANS.key(backend, qkv, cos, sin, heads),
                                lambda: _choose_front(qkv, cos, sin, heads, backend))
    if cos.ndim == 3:
        cos, sin = cos[:, 0], sin[:, 0]
    if which == REFERENCE:
        return attention_front(qkv, cos, sin, heads)
    return forward_ops[which](qkv, cos, sin, heads, AUTO if backend == AUTO else which)


def vision_rope_forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, *,
                        stream: torch.cuda.Stream | None = None, backend: str = "auto"):
    """Non-differentiable fused forward: ``q, k, v`` ``[H, T, D]`` views (see ``vision_rope_attention_front``;
    ``backend`` likewise: ``"auto"``, ``"triton"`` or ``"reference"``)."""
    with torch.no_grad(), on_stream(stream, qkv.device):
        return vision_rope_attention_front(qkv, cos, sin, heads, backend=backend)
