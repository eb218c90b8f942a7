"""q, k and v as head views of one packed projection row, and their gradient as one row.

The model projects each token to one row ``[q heads | k heads | v heads]`` of width
``(2H + HV) D``; `packed_qkv_views` hands out the three head views of it without a copy::

    row [T, (2H + HV) D] or [B, T, (2H + HV) D]
    q = heads [0, H),  k = heads [H, 2H),  v = heads [2H, 2H + HV)   # [B, T, H | H | HV, D], B = 1 for a 2-D row

Conditions (a ``TypeError`` or ``ValueError`` naming ``row`` or the head count and the condition):
``row`` a floating-point tensor of 2 or 3 dims; ``num_qk_heads`` (``H``) an int >= 1,
``num_v_heads`` (``HV``) a positive multiple of ``H``; the width a multiple of ``2H + HV`` (the
head dim ``D`` is the quotient, any ``D >= 1``); the channel dim dense (stride 1), the token
stride exactly the width and, for a 3-D row, the batch stride ``T`` times the width (rows packed
one after the other; as for ``Tensor.is_contiguous``, a dim of size 1 may have any stride).

Autograd. A row that does not require grad, or any row under ``torch.no_grad`` /
``inference_mode``, gets plain views (no autograd node). A row that requires grad gets the
views as the three outputs of ONE autograd node (``_PackedQKV``), whose backward receives
``dq``, ``dk``, ``dv`` and returns ONE gradient of the row:

* when ``dq``, ``dk``, ``dv`` are exactly the head views of one buffer in the packed layout
  (`is_packed_qkv`: one storage, offsets ``0``, ``H D``, ``2H D`` from a common base,
  the packed strides, the row's dtype), that buffer is handed over as the row's gradient (a
  view of it covering the whole row): no copy, no concatenation. A consumer gets this by
  allocating its gradients with `packed_grad_row`;
* otherwise (a gradient is None because an output was not used, a gradient made by ordinary
  ops, or one accumulated from several uses of a view) the row gradient is assembled once by
  writing the three gradients into a new buffer (zeros for None): the concatenation the first
  case avoids. Under ``create_graph`` with gradients that require grad this path is taken too,
  so the row gradient stays differentiable.

Hooks registered on q, k or v (``register_hook``) and ``retain_grad`` work as for any tensor:
the views are outputs of the node, so their gradients pass through their hooks before the node's
backward sees them (a hook that returns a new gradient sends the node down the second path).
In-place changes of the views while the row requires grad are refused by torch, as for any
view returned by a function with several view outputs ("Output 0 of _PackedQKV is a view and is
being modified inplace. This view is the output of a function that returns multiple views ...");
under ``torch.no_grad`` they are allowed, as for every torch view, and change the row.

Plain split views (``row.view(T, 2H + HV, D).split([H, H, HV], 1)``, unsqueezed to
``[1, T, ...]``) stay usable and go through torch's own autograd (split and unsqueeze nodes,
hooks and ``retain_grad`` as usual); `packed_grad_row` recognises them too, and since both
paths only move values, the row gradient is bitwise the same either way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PackedGrad", "is_packed_qkv", "packed_grad_row", "packed_qkv_views"]


# ----------------------------------------------------------------------------- layout


def _packed_strides(shape) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _strides_match(t: torch.Tensor, strides) -> bool:
    """``t``'s strides equal ``strides`` in every dim of size > 1 (a dim of size 1 may have any stride)."""
    return all(size == 1 or got == want for size, got, want in zip(t.shape, t.stride(), strides, strict=True))


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage, None where there is none to compare (e.g. fake tensors)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def is_packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``q``, ``k``, ``v`` are the head views of one packed row, q heads then k then v.

    ``q``, ``k`` ``[B, T, H, D]`` and ``v`` ``[B, T, HV, D]`` (or all three without the batch
    dim) of one dtype and device, in one storage, ``k`` starting ``H D`` elements after ``q`` and
    ``v`` ``2H D`` after it, all with the strides of the packed row ``[B, T, (2H + HV) D]``
    (batch ``T W``, token ``W``, head ``D``, channel 1, ``W = (2H + HV) D``; any stride in a
    dim of size 1). Pure layout: the values are not looked at.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if not (q.dim() == k.dim() == v.dim() and q.dim() in (3, 4)):
        return False
    if q.shape != k.shape or v.shape[:-2] != q.shape[:-2] or v.shape[-1] != q.shape[-1]:
        return False
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        return False
    heads, value_heads, dim = q.shape[-2], v.shape[-2], q.shape[-1]
    if heads < 1 or value_heads < 1 or dim < 1:
        return False
    width = (2 * heads + value_heads) * dim
    row_strides = _packed_strides((*q.shape[:-2], width))
    view_strides = (*row_strides[:-1], dim, 1)
    if not all(_strides_match(t, view_strides) for t in (q, k, v)):
        return False
    base = q.storage_offset()
    if k.storage_offset() != base + heads * dim or v.storage_offset() != base + 2 * heads * dim:
        return False
    ptr = _storage_ptr(q)
    return ptr is not None and _storage_ptr(k) == ptr and _storage_ptr(v) == ptr


def _row_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape) -> torch.Tensor:
    """The packed row of ``shape`` whose head views are ``q``, ``k``, ``v`` (`is_packed_qkv` holds)."""
    return q.as_strided(shape, _packed_strides(shape), q.storage_offset())


def _split(row: torch.Tensor, heads: int, value_heads: int):
    """``(q, k, v)`` ``[B, T, H | H | HV, D]`` head views of a checked row (``B = 1`` for a 2-D row)."""
    *lead, width = row.shape
    if len(lead) == 1:
        lead = [1, *lead]
    n = 2 * heads + value_heads
    x = row.view(*lead, n, width // n)
    return x[:, :, :heads], x[:, :, heads : 2 * heads], x[:, :, 2 * heads :]


class PackedGrad(NamedTuple):
    """A new gradient row and its head views (see `packed_grad_row`)."""

    row: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def packed_grad_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> PackedGrad | None:
    """Gradient buffers for ``q``, ``k``, ``v`` laid out as one packed row, or None.

    If ``q``, ``k``, ``v`` are head views of one packed row (`is_packed_qkv`: the views of
    `packed_qkv_views`, or plain split views of a packed row), returns
    ``PackedGrad(row, dq, dk, dv)``: a new uninitialised ``row`` shaped ``[B, T, (2H + HV) D]``
    (``[T, ...]`` for 3-D views) in q's dtype and device, and ``dq``, ``dk``, ``dv`` its head
    views, shaped like ``q``, ``k``, ``v``. A backward that writes its gradients into them hands
    the row gradient over without a copy. Otherwise None (allocate the gradients separately).
    """
    if not is_packed_qkv(q, k, v):
        return None
    heads, value_heads, dim = q.shape[-2], v.shape[-2], q.shape[-1]
    shape = (*q.shape[:-2], (2 * heads + value_heads) * dim)
    row = torch.empty(shape, dtype=q.dtype, device=q.device)
    x = row.view(*q.shape[:-2], 2 * heads + value_heads, dim)
    return PackedGrad(row, x[..., :heads, :], x[..., heads : 2 * heads, :], x[..., 2 * heads :, :])


# ----------------------------------------------------------------------------- autograd


class _PackedQKV(torch.autograd.Function):
    """One node: the row in, its three head views out; backward returns one row gradient."""

    @staticmethod
    def forward(ctx, row: torch.Tensor, heads: int, value_heads: int):
        ctx.set_materialize_grads(False)  # an unused view's gradient stays None (no zeros allocated)
        ctx.heads, ctx.value_heads = heads, value_heads
        ctx.row_shape, ctx.row_dtype, ctx.row_device = row.shape, row.dtype, row.device
        return _split(row, heads, value_heads)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        grads = (dq, dk, dv)
        if (all(g is not None and g.dtype == ctx.row_dtype and g.device == ctx.row_device for g in grads)
                and not (torch.is_grad_enabled() and any(g.requires_grad for g in grads))
                and is_packed_qkv(dq, dk, dv)):
            return _row_of(dq, dk, dv, ctx.row_shape), None, None
        grad = torch.empty(ctx.row_shape, dtype=ctx.row_dtype, device=ctx.row_device)
        heads = ctx.heads
        lead = ctx.row_shape[:-1] if len(ctx.row_shape) == 3 else (1, *ctx.row_shape[:-1])
        n = 2 * heads + ctx.value_heads
        x = grad.view(*lead, n, ctx.row_shape[-1] // n)
        for lo, hi, g in ((0, heads, dq), (heads, 2 * heads, dk), (2 * heads, None, dv)):
            # each part's view made just before it is written (a differentiable write under create_graph)
            if g is None:
                x[:, :, lo:hi].zero_()
            else:
                x[:, :, lo:hi].copy_(g)
        return grad, None, None


# ----------------------------------------------------------------------------- public


def _check_heads(num_qk_heads, num_v_heads) -> None:
    for name, value in (("num_qk_heads", num_qk_heads), ("num_v_heads", num_v_heads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if num_qk_heads < 1:
        raise ValueError(f"num_qk_heads: expected at least 1 head, got {num_qk_heads}")
    if num_v_heads < 1 or num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads: expected a positive multiple of num_qk_heads = {num_qk_heads}, "
                         f"got {num_v_heads}")


def _check_row(row, num_qk_heads: int, num_v_heads: int) -> None:
    if not isinstance(row, torch.Tensor):
        raise TypeError(f"row: expected a torch.Tensor, got {type(row).__name__}")
    if not row.is_floating_point():
        raise TypeError(f"row: expected a floating-point dtype, got {row.dtype}")
    if row.dim() not in (2, 3):
        raise ValueError(f"row: expected [T, (2H + HV) * D] or [B, T, (2H + HV) * D], got shape {list(row.shape)}")
    _check_heads(num_qk_heads, num_v_heads)
    n = 2 * num_qk_heads + num_v_heads
    width = row.shape[-1]
    if width == 0 or width % n:
        raise ValueError(f"row: width {width} is not a positive multiple of 2 * num_qk_heads + num_v_heads = {n} "
                         f"(the heads of q, k and v)")
    if width > 1 and row.stride(-1) != 1:
        raise ValueError(f"row: the channel dim must be dense (stride 1), got stride {row.stride(-1)}")
    if row.shape[-2] > 1 and row.stride(-2) != width:
        raise ValueError(f"row: rows must be packed (token stride = width = {width}), got token stride "
                         f"{row.stride(-2)}")
    if row.dim() == 3 and row.shape[0] > 1 and row.stride(0) != row.shape[1] * width:
        raise ValueError(f"row: batches must be packed (batch stride = T * width = {row.shape[1] * width}), "
                         f"got batch stride {row.stride(0)}")


def packed_qkv_views(row: torch.Tensor, num_qk_heads: int, num_v_heads: int):
    """``(q, k, v)``: head views ``[B, T, H, D]``, ``[B, T, H, D]``, ``[B, T, HV, D]`` of a packed row.

    ``row`` ``[T, (2H + HV) D]`` (``B = 1``) or ``[B, T, (2H + HV) D]``: q heads first, then k
    heads, then v heads; ``D = width / (2H + HV)``. Conditions and autograd: see the module
    docstring. A row that requires grad (with grad mode on) gets views that are outputs of one
    autograd node returning one row gradient; otherwise plain views.
    """
    _check_row(row, num_qk_heads, num_v_heads)
    if row.requires_grad and torch.is_grad_enabled():
        return _PackedQKV.apply(row, num_qk_heads, num_v_heads)
    return _split(row, num_qk_heads, num_v_heads)
