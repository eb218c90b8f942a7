"""Every bad argument of apply_rope raises a clear error naming the argument, alike on ``auto``, every
fused backend and the reference (the ``backend`` fixture with ``@pytest.mark.refusals``)."""

import pytest
import torch

from dsfuse.text_rope import apply_rope


def ok_args(device="cpu"):
    return torch.randn(2, 5, 3, 12, device=device), torch.rand(2, 5, 3, device=device)


BAD_CALLS = {
    "values not a tensor": (lambda v, a: apply_rope(v.tolist(), a), TypeError, "values: expected a torch.Tensor"),
    "values 2D": (lambda v, a: apply_rope(v[0, 0], a), ValueError, r"values: expected \[B, S, C\]"),
    "values 5D": (lambda v, a: apply_rope(v[None], a), ValueError, r"values: expected \[B, S, C\]"),
    "values integer": (lambda v, a: apply_rope(v.long(), a), TypeError, "values: expected a floating-point"),
    "angles fp16": (lambda v, a: apply_rope(v, a.half()), TypeError, r"angles: expected dtype in \(float32\)"),
    "angles wrong seq": (lambda v, a: apply_rope(v, a[:, :4]), ValueError, r"angles: expected shape \[2 \(or 1\), 5, P\]"),
    "angles wrong batch": (lambda v, a: apply_rope(v, torch.cat([a, a])), ValueError, "angles: expected shape"),
    "angles 2D": (lambda v, a: apply_rope(v, a[0]), ValueError, "angles: expected shape"),
    "too many pairs": (lambda v, a: apply_rope(v, torch.rand(2, 5, 7)), ValueError, r"P <= channels / 2 = 6"),
    "zero pairs": (lambda v, a: apply_rope(v, torch.rand(2, 5, 0)), ValueError, "rotary pairs, got P = 0"),
    "out not a tensor": (lambda v, a: apply_rope(v, a, out=[0.0]), TypeError, "out: expected a torch.Tensor"),
    "out wrong shape": (lambda v, a: apply_rope(v, a, out=torch.empty(2, 5, 3, 10)), ValueError, "out: expected shape"),
    "out wrong dtype": (lambda v, a: apply_rope(v, a, out=v.half()), ValueError, "out: expected shape .* and dtype"),
    "out with inplace": (lambda v, a: apply_rope(v, a, inplace=True, out=torch.empty_like(v)), ValueError,
                         "out: must be None when inplace=True"),
    "out expanded": (lambda v, a: apply_rope(v, a, out=torch.empty(1, 5, 3, 12).expand(2, 5, 3, 12)), ValueError,
                     "out: expected a tensor whose elements do not alias"),
    "out is values": (lambda v, a: apply_rope(v, a, out=v), ValueError, "out: must not overlap values"),
    "out overlaps values": (lambda v, a: apply_rope(v[:, :4], a[:, :4], out=v[:, 1:]), ValueError,
                            "out: must not overlap values"),
    "out overlaps angles": (lambda v, a: apply_rope(v, **_sharing_out()), ValueError, "out: must not overlap angles"),
    "inplace over angles": (lambda v, a: apply_rope(*_sharing_values(), inplace=True), ValueError,
                            "values: must not overlap angles"),
    "inplace expanded": (lambda v, a: apply_rope(torch.randn(1, 5, 3, 12).expand(2, 5, 3, 12), a, inplace=True),
                         ValueError, "values: expected a tensor whose elements do not alias"),
    "bad backend": (lambda v, a: apply_rope(v, a, backend="cutedsl"), ValueError, "backend: expected one of"),
    "stream on cpu": (lambda v, a: apply_rope(v, a, stream=object()), TypeError, "stream: expected a torch.cuda.Stream"),
}


def _sharing_out():
    """angles [2,5,3] and an out [2,5,3,12] cut from one storage, as keyword arguments."""
    storage = torch.rand(2 * 5 * 3 * 12)
    return {"angles": storage[-30:].view(2, 5, 3), "out": storage[:360].view(2, 5, 3, 12)}


def _sharing_values():
    storage = torch.rand(2 * 5 * 3 * 12)
    return storage.view(2, 5, 3, 12), storage[:30].view(2, 5, 3)


@pytest.mark.refusals
@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_arguments_raise(name, backend):
    call, exc, match = BAD_CALLS[name]
    with pytest.raises(exc, match=match):
        _with_backend(call, backend)(*ok_args())


def _with_backend(call, backend):
    """Run ``call`` with apply_rope's backend forced (the lambdas call the module-level name)."""
    def run(v, a):
        global apply_rope
        plain = apply_rope
        apply_rope = lambda *args, **kw: plain(*args, **({"backend": backend} | kw))  # noqa: E731
        try:
            return call(v, a)
        finally:
            apply_rope = plain
    return run


def test_out_with_autograd_is_refused():
    v, a = ok_args()
    v.requires_grad_()
    with pytest.raises(ValueError, match="out= does not support autograd"):
        apply_rope(v, a, out=torch.empty(2, 5, 3, 12))


@pytest.mark.gpu
def test_cross_device_and_stream_errors():
    v, a = ok_args("cuda")
    with pytest.raises(ValueError, match="angles: expected device cuda:0"):
        apply_rope(v, a.cpu())
    with pytest.raises(ValueError, match="out: expected device cuda:0"):
        apply_rope(v, a, out=torch.empty(2, 5, 3, 12))
    with pytest.raises(ValueError, match="stream: expected a stream on cpu"):
        apply_rope(v.cpu(), a.cpu(), stream=torch.cuda.Stream())
