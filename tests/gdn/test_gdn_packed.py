"""The packed q/k/v row helper (``dsfuse.gdn.packed``): head views, conditions, one autograd node.

CPU, pure torch. ``fake_consumer`` stands in for chunk_gdn's backward: an autograd Function of
q, k, v whose backward allocates its gradients with ``packed_grad_row`` (when the inputs are
packed) and fills them. Checked: the views' values and strides; every refused argument; the row
gradient handed over without a copy (the very buffer the consumer filled) and bitwise equal to
torch's own autograd through plain split views; the fallback for gradients made by ordinary ops,
for an unused view (None) and for a view used twice (accumulated); hooks and ``retain_grad`` on
the views; in-place changes of the views refused while the row requires grad; double backward.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from dsfuse.gdn.packed import is_packed_qkv, packed_grad_row, packed_qkv_views
from helpers import assert_bitwise

H, HV, D, T = 2, 6, 8, 5
WIDTH = (2 * H + HV) * D


def make_row(*lead, dtype=torch.float32, requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(*lead, WIDTH, generator=gen).to(dtype)
    return row.requires_grad_(requires_grad)


def plain_split(row):
    """torch's own split views of a 2-D row, unsqueezed to ``[1, T, ...]``."""
    q, k, v = row.view(row.shape[0], 2 * H + HV, D).split([H, H, HV], 1)
    return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)


class FakeConsumer(torch.autograd.Function):
    """``o = 3 v + repeat(2 q - k)`` over each qk head's group ``[B, T, HV, D]``; backward writes
    its gradients into ``packed_grad_row``'s buffers when the inputs are packed."""

    buffers: ClassVar[list] = []  # the gradient rows the backward allocated (to compare addresses)

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        group = v.shape[-2] // q.shape[-2]
        return 3 * v + (2 * q - k).repeat_interleave(group, dim=-2)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        packed = packed_grad_row(q, k, v)
        if packed is None:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        else:
            FakeConsumer.buffers.append(packed.row)
            dq, dk, dv = packed.q, packed.k, packed.v
        summed = do.unflatten(-2, (q.shape[-2], v.shape[-2] // q.shape[-2])).sum(-2)
        torch.mul(summed, 2, out=dq)
        torch.neg(summed, out=dk)
        torch.mul(do, 3, out=dv)
        return dq, dk, dv


def fake_consumer(q, k, v):
    return FakeConsumer.apply(q, k, v)


def loss_of(o):
    if o.dim() == 0:
        return o
    weights = torch.linspace(-1, 1, o.numel()).to(o.dtype).view(o.shape)
    return (o * weights).sum()


# ----------------------------------------------------------------------------- views


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("lead", [(T,), (3, T)], ids=["2d", "3d"])
def test_views_values_and_strides(lead, requires_grad):
    row = make_row(*lead, requires_grad=requires_grad)
    q, k, v = packed_qkv_views(row, H, HV)
    batch = lead[0] if len(lead) == 2 else 1
    assert q.shape == k.shape == (batch, T, H, D) and v.shape == (batch, T, HV, D)
    for t in (q, k, v):
        assert t.stride() == (T * WIDTH, WIDTH, D, 1)
    r = row.detach().reshape(batch, T, WIDTH)
    assert_bitwise(q.detach(), r[..., : H * D].reshape(batch, T, H, D), "q")
    assert_bitwise(k.detach(), r[..., H * D : 2 * H * D].reshape(batch, T, H, D), "k")
    assert_bitwise(v.detach(), r[..., 2 * H * D :].reshape(batch, T, HV, D), "v")
    assert q.data_ptr() == row.data_ptr() and k.data_ptr() == row.data_ptr() + H * D * row.element_size()
    assert is_packed_qkv(q, k, v)
    if requires_grad:  # one node for all three
        assert q.grad_fn is k.grad_fn is v.grad_fn and type(q.grad_fn).__name__ == "_PackedQKVBackward"
    else:
        assert q.grad_fn is None and not q.requires_grad


def test_no_node_without_grad_mode():
    row = make_row(T, requires_grad=True)
    with torch.no_grad():
        q, _, _ = packed_qkv_views(row, H, HV)
    assert q.grad_fn is None and q._base is row  # torch's plain views (no node)
    with torch.inference_mode():
        q, _, _ = packed_qkv_views(row, H, HV)
    assert q.grad_fn is None


def test_any_head_dim_and_size_one_dims():
    row = torch.randn(1, 1, 5 * 3)  # T = 1, B = 1: strides of size-1 dims are free
    q, _, v = packed_qkv_views(row.transpose(0, 1), 1, 3)
    assert q.shape == (1, 1, 1, 3) and v.shape == (1, 1, 3, 3)
    assert_bitwise(v.reshape(-1), row.reshape(-1)[6:], "v")


@pytest.mark.parametrize(
    "make, heads, value_heads, error, match",
    [
        (lambda: [[1.0]], 1, 1, TypeError, r"row: expected a torch.Tensor"),
        (lambda: torch.zeros(T, WIDTH, dtype=torch.int32), H, HV, TypeError, r"row: expected a floating-point dtype"),
        (lambda: torch.zeros(WIDTH), H, HV, ValueError, r"row: expected \[T, \(2H \+ HV\) \* D\]"),
        (lambda: torch.zeros(1, T, 1, WIDTH), H, HV, ValueError, r"row: expected \[T, \(2H \+ HV\) \* D\]"),
        (lambda: torch.zeros(T, WIDTH + 1), H, HV, ValueError, r"row: width 81 is not a positive multiple of"),
        (lambda: torch.zeros(T, 0), H, HV, ValueError, r"row: width 0 is not a positive multiple"),
        (lambda: torch.zeros(WIDTH, T).t(), H, HV, ValueError, r"row: the channel dim must be dense \(stride 1\)"),
        (lambda: torch.zeros(T, 2 * WIDTH)[:, :WIDTH], H, HV, ValueError, r"row: rows must be packed"),
        (lambda: torch.zeros(3, T + 1, WIDTH)[:, :T], H, HV, ValueError, r"row: batches must be packed"),
        (lambda: torch.zeros(T, WIDTH), 0, HV, ValueError, r"num_qk_heads: expected at least 1"),
        (lambda: torch.zeros(T, WIDTH), H, 5, ValueError, r"num_v_heads: expected a positive multiple of"),
        (lambda: torch.zeros(T, WIDTH), H, 0, ValueError, r"num_v_heads: expected a positive multiple of"),
        (lambda: torch.zeros(T, WIDTH), 2.0, HV, TypeError, r"num_qk_heads: expected an int"),
        (lambda: torch.zeros(T, WIDTH), True, HV, TypeError, r"num_qk_heads: expected an int"),
        (lambda: torch.zeros(T, WIDTH), H, None, TypeError, r"num_v_heads: expected an int"),
    ],
    ids=["not_tensor", "int_dtype", "1d", "4d", "width", "width0", "channel_stride", "token_stride",
         "batch_stride", "h0", "hv_not_multiple", "hv0", "h_float", "h_bool", "hv_none"],
)
def test_refused(make, heads, value_heads, error, match):
    with pytest.raises(error, match=match):
        packed_qkv_views(make(), heads, value_heads)


def test_is_packed_qkv():
    row = make_row(T)
    q, k, v = plain_split(row)
    assert is_packed_qkv(q, k, v) and is_packed_qkv(q[0], k[0], v[0])
    assert not is_packed_qkv(k, q, v)  # wrong order
    assert not is_packed_qkv(q.clone(), k, v)  # another storage
    assert not is_packed_qkv(q, k, v.contiguous())
    assert not is_packed_qkv(q.double(), k.double(), v.double())
    assert is_packed_qkv(q[:, 1:], k[:, 1:], v[:, 1:])  # a token range of a packed row is packed
    assert not is_packed_qkv(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:])  # a head range is not
    wide = torch.randn(T, WIDTH + D)  # a wider row: token stride != (2H + HV) D
    wq, wk, wv = wide.view(T, -1, D)[:, :H], wide.view(T, -1, D)[:, H : 2 * H], wide.view(T, -1, D)[:, 2 * H : -1]
    assert not is_packed_qkv(wq, wk, wv)
    assert packed_grad_row(wq, wk, wv) is None
    grad = packed_grad_row(q, k, v)
    assert grad.row.shape == (1, T, WIDTH) and is_packed_qkv(grad.q, grad.k, grad.v)
    assert grad.q.shape == q.shape and grad.v.shape == v.shape and grad.q.data_ptr() == grad.row.data_ptr()


# ----------------------------------------------------------------------------- backward


def grad_through(views_of, consumer, *lead, hooks=False, dtype=torch.float32):
    """``(row.grad, hook_calls, retained)`` of ``loss_of(consumer(q, k, v))`` with the views of ``views_of``."""
    row = make_row(*lead, dtype=dtype, requires_grad=True)
    q, k, v = views_of(row)
    calls, retained = [], []
    if hooks:
        for name, t in zip("qkv", (q, k, v), strict=True):
            t.register_hook(lambda g, name=name: calls.append((name, g.clone())))
            t.retain_grad()
    loss_of(consumer(q, k, v)).backward()
    if hooks:
        retained = [t.grad for t in (q, k, v)]
    return row.grad, calls, retained


def packed(row):
    return packed_qkv_views(row, H, HV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead", [(T,), (3, T)], ids=["2d", "3d"])
def test_packed_gradient_is_the_consumers_buffer(lead, dtype):
    FakeConsumer.buffers.clear()
    got, _, _ = grad_through(packed, fake_consumer, *lead, dtype=dtype)
    assert len(FakeConsumer.buffers) == 1
    buffer = FakeConsumer.buffers.pop()
    assert got.data_ptr() == buffer.data_ptr(), "the row gradient was copied"
    assert_bitwise(got, buffer.view(got.shape), "row gradient")
    if len(lead) == 1:  # torch's own autograd through plain split views: the same bits
        want, _, _ = grad_through(plain_split, fake_consumer, *lead, dtype=dtype)
        assert_bitwise(got, want, "row gradient (packed views vs plain split views)")


def test_plain_split_views_use_torch_autograd():
    FakeConsumer.buffers.clear()
    got, _, _ = grad_through(plain_split, fake_consumer, T)
    assert len(FakeConsumer.buffers) == 1  # recognised as packed: the consumer wrote one buffer
    q, _, _ = plain_split(make_row(T, requires_grad=True))
    assert type(q.grad_fn).__name__ == "UnsqueezeBackward0"  # not the helper's node
    assert torch.isfinite(got).all()


def ordinary(q, k, v):
    return (q * 2).sum() + (k * k).sum() + (v * 3).sum()


@pytest.mark.parametrize(
    "consumer",
    [
        ordinary,
        lambda q, k, v: (q * 2).sum() + v.sum(),  # k unused: its gradient is None
        lambda q, k, v: fake_consumer(q, k, v) + q.sum(),  # q used twice: accumulated
        lambda q, k, v: fake_consumer(q.clone(), k, v),  # inputs not packed: separate gradients
    ],
    ids=["ordinary_ops", "unused_view", "accumulated", "not_packed"],
)
def test_fallback_gradient(consumer):
    got, _, _ = grad_through(packed, consumer, T)
    want, _, _ = grad_through(plain_split, consumer, T)
    assert torch.isfinite(got).all()
    assert_bitwise(got, want, "row gradient (fallback vs plain split views)")


def test_unused_view_gets_zeros():
    got, _, _ = grad_through(packed, lambda q, k, v: (q * 2).sum() + v.sum(), T)
    assert_bitwise(got[:, H * D : 2 * H * D], torch.zeros(T, H * D), "k part")
    assert_bitwise(got[:, : H * D], torch.full((T, H * D), 2.0), "q part")


@pytest.mark.parametrize("views_of", [packed, plain_split], ids=["packed", "plain_split"])
@pytest.mark.parametrize("consumer", [fake_consumer, ordinary], ids=["packed_grads", "ordinary_ops"])
def test_hooks_and_retain_grad(views_of, consumer):
    FakeConsumer.buffers.clear()
    got, calls, retained = grad_through(views_of, consumer, T, hooks=True)
    assert sorted(name for name, _ in calls) == ["k", "q", "v"]
    hooked = dict(calls)
    flat = got.view(T, 2 * H + HV, D)
    parts = {"q": flat[:, :H], "k": flat[:, H : 2 * H], "v": flat[:, 2 * H :]}
    for name, grad in zip("qkv", retained, strict=True):
        assert_bitwise(grad, parts[name][None], f"retain_grad {name}")
        assert_bitwise(hooked[name], parts[name][None], f"hook {name}")
    if views_of is packed and consumer is fake_consumer:  # hooks that return nothing keep the handover
        assert got.data_ptr() == FakeConsumer.buffers[-1].data_ptr()


def test_hook_returning_a_new_gradient():
    row = make_row(T, requires_grad=True)
    q, k, v = packed(row)
    q.register_hook(lambda g: g * 2)
    loss_of(fake_consumer(q, k, v)).backward()
    row2 = make_row(T, requires_grad=True)
    q2, k2, v2 = plain_split(row2)
    q2.register_hook(lambda g: g * 2)
    loss_of(fake_consumer(q2, k2, v2)).backward()
    assert_bitwise(row.grad, row2.grad, "row gradient with a hook on q")


def test_non_leaf_row():
    x = torch.randn(T, 4, requires_grad=True)
    weight = torch.randn(4, WIDTH)
    got = []
    for views_of in (packed, plain_split):
        x.grad = None
        loss_of(fake_consumer(*views_of(x @ weight))).backward()
        got.append(x.grad)
    assert_bitwise(got[0], got[1], "gradient through a projection")


@pytest.mark.parametrize("consumer", [fake_consumer, ordinary], ids=["packed_grads", "ordinary_ops"])
def test_empty_row(consumer):
    row = torch.zeros(0, WIDTH, requires_grad=True)
    q, k, v = packed(row)
    assert q.shape == (1, 0, H, D) and v.shape == (1, 0, HV, D)
    consumer(q, k, v).sum().backward()
    assert row.grad.shape == (0, WIDTH)


def test_inplace_on_a_view_is_refused():
    row = make_row(T, requires_grad=True)
    q, k, v = packed(row)
    message = r"Output \d of _PackedQKV is a view and is being modified inplace.*returns multiple views"
    with pytest.raises(RuntimeError, match=message):
        q.add_(1)
    with pytest.raises(RuntimeError, match=message):
        v.mul_(2)
    with pytest.raises(RuntimeError, match=r"is a view and is being modified inplace"):
        k[:, 1:].zero_()
    plain_q, _, _ = packed(row.detach())  # a row without grad: ordinary views, in-place allowed
    plain_q.add_(0)


def test_double_backward():
    row = make_row(T, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r: ordinary(*packed(r)), (row,))
    assert torch.autograd.gradgradcheck(lambda r: ordinary(*packed(r)), (row,))
