"""Reused verdicts and bound launches: a call whose signature was seen skips the checks and Triton's
argument binding, and still refuses what reads more than the signature (overlap, leaves), still
separates what Triton specialises on (alignment, dtype, strides, flags) and still computes the
reference's bits. The bound launch itself needs CUDA (the ``gpu`` tests)."""

import types

import pytest
import torch
from helpers import assert_bitwise

from dsfuse._common import launch as launch_mod
from dsfuse._common.plans import Plans
from dsfuse.engram_gate import api as engram_api
from dsfuse.engram_gate import engram_gate_forward, engram_gate_reference
from dsfuse.text_rope import api as text_api
from dsfuse.text_rope import apply_rope, rope_reference
from dsfuse.vision_rope import api as vision_api
from dsfuse.vision_rope import vision_cos_sin, vision_rope_backward, vision_rope_backward_reference

CUDA = pytest.mark.gpu


def _count_choices(monkeypatch, backends) -> list:
    """Record each full backend choice of ``backends`` (an op's registry)."""
    calls = []
    choose = type(backends).choose

    def counting(self, *args, **kwargs):
        calls.append(args[0])
        return choose(self, *args, **kwargs)

    monkeypatch.setattr(type(backends), "choose", counting)
    return calls


def _text_inputs(device, offset: int = 0):
    gen = torch.Generator().manual_seed(3)
    flat = torch.randn(2 * 6 * 3 * 16 + offset, generator=gen).to(device)
    values = flat[offset:].view(2, 6, 3, 16)
    angles = (torch.rand(1, 6, 4, generator=gen) * 6).to(device)
    return values, angles


def test_plan_key_separates_what_the_checks_read():
    plans = Plans()
    t = torch.zeros(4, 8)
    key = plans.key("auto", t)
    assert key == plans.key("auto", torch.zeros(4, 8))
    assert key != plans.key("auto", torch.zeros(8, 4))  # shape
    assert key != plans.key("auto", t.t().contiguous().t())  # strides
    assert key != plans.key("auto", t.double())  # dtype
    assert key != plans.key("auto", torch.zeros(4, 8).requires_grad_())
    assert key != plans.key("auto", torch.zeros(33)[1:].view(4, 8))  # 4-byte offset: another alignment
    assert key != plans.key("triton", t)
    with torch.no_grad():
        assert key != plans.key("auto", t)
    assert plans.key("auto", [t]) is None  # not a tensor: the full path raises the usual error
    assert plans.get(None) is None and plans.put(None, "x") == "x" and plans.get(None) is None


def test_plans_stay_bounded(monkeypatch):
    monkeypatch.setattr("dsfuse._common.plans.CACHE_LIMIT", 3)
    plans = Plans()
    for n in range(10):
        plans.put(plans.key(n), n)
    assert len(plans._verdicts) <= 3 and plans.get(plans.key(9)) == 9


def test_repeat_call_reuses_the_choice_and_still_checks_addresses(monkeypatch):
    calls = _count_choices(monkeypatch, text_api.BACKENDS)
    values, angles = _text_inputs("cpu")
    first = apply_rope(values, angles, backend="triton")
    second = apply_rope(values, angles, backend="triton")
    assert len(calls) == 1, "the second call of one signature chooses again"
    assert_bitwise(second, first, "repeat call")
    # the same signature, but out overlapping values: refused on the reused path too
    apply_rope(values, angles, out=torch.empty_like(values), backend="triton")
    shared = torch.empty_like(values)
    with pytest.raises(ValueError, match="must not overlap"):
        apply_rope(shared, angles, out=shared, backend="triton")
    # a leaf that requires grad, rotated in place: refused on every call
    leaf = values.clone().requires_grad_()
    with pytest.raises(ValueError, match="leaf tensor"):
        apply_rope(leaf, angles, inplace=True, backend="triton")
    with pytest.raises(ValueError, match="leaf tensor"):
        apply_rope(leaf, angles, inplace=True, backend="triton")


def test_reused_choice_follows_the_triton_mode(monkeypatch):
    values, angles = _text_inputs("cpu")
    apply_rope(values, angles, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a machine without a GPU nor the interpreter
    with pytest.raises(ValueError, match="Triton needs CUDA"):
        apply_rope(values, angles, backend="triton")


def test_reused_choice_is_logged(caplog):
    values, angles = _text_inputs("cpu")
    with caplog.at_level("DEBUG", logger="dsfuse"):
        apply_rope(values, angles, backend="triton")
        apply_rope(values, angles, backend="triton")
    served = [r.getMessage() for r in caplog.records if "served" in r.getMessage()]
    assert len(served) == 2 and "first call of this signature" in served[1]


def test_vision_and_engram_repeat_calls_check_once(monkeypatch):
    cos, sin = vision_cos_sin(4, 4, 8)
    gen = torch.Generator().manual_seed(4)
    dq, dv = (torch.randn(2, 16, 16, generator=gen) for _ in range(2))
    dk_hdt = torch.randn(2, 16, 16, generator=gen)
    calls = _count_choices(monkeypatch, vision_api.BACKENDS)
    want = vision_rope_backward_reference(dq, dk_hdt, dv, cos, sin)
    for _ in range(3):
        assert_bitwise(vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="triton"), want, "vision")
    assert len(calls) == 1
    vision_rope_backward(dq, dk_hdt, dv, cos, sin, out=torch.empty(16, 96), backend="triton")
    storage = torch.empty(16 * 96)  # out and a dq of the same signature as before, sharing memory
    with pytest.raises(ValueError, match="must not overlap"):
        vision_rope_backward(storage[: dq.numel()].view_as(dq), dk_hdt, dv, cos, sin, out=storage.view(16, 96),
                             backend="triton")

    x = torch.randn(3, 4, 32, generator=gen)
    kv = torch.randn(3, 5 * 32, generator=gen)
    weight = torch.rand(4, 32, generator=gen)
    mask = torch.tensor([True, False, True])
    calls = _count_choices(monkeypatch, engram_api.BACKENDS)
    want_out, _ = engram_gate_reference(x, kv, weight, mask, eps=1e-20)
    for _ in range(2):
        out, _ = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="triton")
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1


def test_bind_orders_the_arguments_after_the_tensors():
    from triton.runtime.jit import JITFunction

    def kernel(a_ptr, b_ptr, n, stride, FLAG, BLOCK=128):
        pass

    launch = launch_mod.TritonLaunch(JITFunction(kernel), num_warps=4)
    compiled = types.SimpleNamespace(run="run", function="fn", packed_metadata="meta")
    bound = launch._bind(compiled, launch_mod.Geometry((7, 2), (10, 3), dict(FLAG=True, num_warps=4)), 2)
    assert bound == ("run", (7, 2, 1), "fn", "meta", (10, 3, True, 128))


# -- the bound launch on the GPU --------------------------------------------------------------


@CUDA
def test_bound_launch_skips_binding_and_keeps_the_bits(monkeypatch):
    from dsfuse.text_rope.triton import kernels

    fn = kernels._ROPE.fn
    runs = []
    monkeypatch.setattr(fn, "run", lambda *a, **k: runs.append(1) or type(fn).run(fn, *a, **k))
    monkeypatch.setattr(kernels, "_ROPE", launch_mod.TritonLaunch(fn, **kernels._ROPE.options))
    for offset in (0, 0, 1, 1, 0):  # aligned, again, 4-byte offset (another specialisation), again, aligned
        values, angles = _text_inputs("cuda", offset)
        values.mul_(1 + offset)  # other data under the same key
        assert_bitwise(apply_rope(values, angles, backend="triton"), rope_reference(values, angles),
                       f"offset {offset}")
    assert len(runs) == 2, f"Triton's path ran {len(runs)} times for 2 specialisations"


@CUDA
def test_bound_launch_under_graph_capture():
    values, angles = _text_inputs("cuda")
    apply_rope(values, angles, backend="triton")  # bound before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = apply_rope(values, angles, backend="triton")
    values.mul_(-2)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, rope_reference(values, angles), "graph replay")


@CUDA
def test_bound_engram_and_vision_launches_keep_the_bits():
    cos, sin = vision_cos_sin(5, 7, 32, device="cuda")
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(4, 35, 64, generator=gen).bfloat16().cuda() for _ in range(3)]
    dq, dk_hdt, dv = grads[0], grads[1].view(4, 64, 35), grads[2]
    for _ in range(3):
        assert_bitwise(vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="triton"),
                       vision_rope_backward_reference(dq, dk_hdt, dv, cos, sin), "vision backward")
        dq.mul_(2)
    x = torch.randn(5, 4, 256, generator=gen).bfloat16().cuda()
    kv = torch.randn(5, 5 * 256, generator=gen).bfloat16().cuda()
    weight = torch.rand(4, 256, generator=gen).cuda()
    mask = torch.tensor([True, False, True, True, True], device="cuda")
    first = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="triton")[0].clone()
    again = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="triton")[0]
    assert_bitwise(again, first, "engram forward, bound")
    torch.testing.assert_close(again.float(), engram_gate_reference(x, kv, weight, mask, eps=1e-20)[0].float(),
                               rtol=2e-2, atol=2e-2)
