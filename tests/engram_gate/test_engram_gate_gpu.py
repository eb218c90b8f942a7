"""Engram gate on CUDA, every fused backend (the ``backend`` fixture): the model's width, tails of the
thread mapping, bitwise reproducibility, either backend's saved state in the other's backward,
explicit streams, and the prepared plan (CUDA Graph replay on changed and NaN-poisoned buffers,
rebinding, no allocation, compile or sync on execute, its device).

The contract at the test widths (float64 end to end and from the same saved state, fp16 and fp32,
caller-owned outputs, autograd, torch.compile) runs on CUDA too, from ``test_engram_gate.py``.
"""

import pytest
import torch
from helpers import assert_bitwise, compiled_kernels
from test_engram_gate import all_masked_and_deterministic, assert_close_fp32, assert_rounded_from, check_all, make

from dsfuse.engram_gate import (
    EngramGatePlan,
    engram_gate_backward,
    engram_gate_backward_from_saved,
    engram_gate_forward,
)

pytestmark = pytest.mark.gpu
D = 5120  # DeepSeek-V4.1 hidden size


@pytest.mark.parametrize("n", [1, 3, 65, 4096, 4097])
def test_model_width_against_fp64(n, backend):
    check_all(*make(n, D, "cuda", seed=n), eps=1e-20, backend=backend)


@pytest.mark.parametrize("n", [1, 3, 65])
@pytest.mark.parametrize("dim", [24, 4104])
def test_tails_of_the_thread_mapping(n, dim, backend):
    """D = 24 and 4104 (rows of 3 and 513 vectors of 8 bf16: threads and vectors past the row are
    predicated off), N = 1 included, against the float64 reference."""
    check_all(*make(n, dim, "cuda", seed=n + dim), eps=1e-20, backend=backend)


def test_model_width_all_masked_and_bitwise_reproducible(backend):
    all_masked_and_deterministic(300, 300, D, "cuda", backend)


def test_saved_state_is_interchangeable(backend, other_backend):
    """One backend's backward from the other's saved state, against the float64 formula from that state."""
    x, kv, weight, mask, dout = make(65, D, "cuda", seed=21)
    _, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend=other_backend)
    dx, dkv, dweight = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend=backend)
    fx, fkv, fw = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
    assert_rounded_from(dx, fx, "dx")
    assert_rounded_from(dkv, fkv, "dkv")
    assert_close_fp32(dweight, fw, "dweight")


def test_explicit_stream(backend):
    """Forward and backward on a side stream: bitwise the results on the current stream."""
    x, kv, weight, mask, dout = make(7, 96, "cuda", seed=5)
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend=backend)
    grads = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend=backend)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out2, saved2 = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend=backend, stream=stream)
    grads2 = engram_gate_backward(dout, x, kv, weight, mask, saved2, eps=1e-20, backend=backend, stream=stream)
    torch.cuda.current_stream().wait_stream(stream)
    for a, b, name in zip((out2, saved2, *grads2), (out, saved, *grads), ("out", "saved", "dx", "dkv", "dweight")):
        assert_bitwise(a, b, f"stream {name}")


def _plan_buffers(n, dim=D):
    x, kv, weight, mask, dout = make(n, dim, "cuda", seed=11)
    bufs = dict(out=torch.empty_like(x), saved=torch.empty(n, 4, 4, device="cuda"), dx=torch.empty_like(x),
                dkv=torch.empty_like(kv), dweight=torch.empty(4, dim, device="cuda"))
    return (x, kv, weight, mask, dout), bufs


def test_plan_graph_replay_changed_poisoned_inputs_and_rebinding(backend):
    n = 257
    plan = EngramGatePlan(dim=D, max_tokens=4096, device="cuda", eps=1e-20, backend=backend)
    (x, kv, weight, mask, dout), b = _plan_buffers(n)

    def step(saved):
        plan.forward(x, kv, weight, mask, b["out"], saved)
        plan.backward(dout, x, kv, weight, mask, saved, b["dx"], b["dkv"], b["dweight"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(b["saved"])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(b["saved"])
    for seed in (12, 13):
        fresh = make(n, D, "cuda", seed=seed)
        for buf, new in zip((x, kv, weight, mask, dout), fresh):
            buf.copy_(new)
        for t in b.values():
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = [t.clone() for t in b.values()]
        # eager execution of the same plan on the same inputs, into a rebound saved-state buffer
        other_saved = torch.full_like(b["saved"], float("nan"))
        step(other_saved)
        assert_bitwise(other_saved, want[1], "rebound saved state")
        for (name, got), w in zip(b.items(), want):
            assert not torch.isnan(w).any(), f"graph left {name} unwritten"
            assert_bitwise(got, w, f"graph vs eager {name}")
        check_all(*fresh, eps=1e-20, backend=backend)


def test_plan_matches_functional_and_allocates_compiles_syncs_nothing(backend):
    n = 1000
    plan = EngramGatePlan(dim=D, max_tokens=4096, device="cuda", eps=1e-20, backend=backend)
    (x, kv, weight, mask, dout), b = _plan_buffers(n)
    compiled = compiled_kernels("engram_gate", backend)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        stream = torch.cuda.Stream()
        plan.forward(x, kv, weight, mask, b["out"], b["saved"], stream=stream)
        plan.backward(dout, x, kv, weight, mask, b["saved"], b["dx"], b["dkv"], b["dweight"], stream=stream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "execute allocated memory"
    assert compiled_kernels("engram_gate", backend) == compiled, "execute compiled a kernel"
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend=backend)
    grads = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend=backend)
    for (name, got), want in zip(b.items(), (out, saved, *grads)):
        assert_bitwise(got, want, f"plan {name}")
    check_all(x, kv, weight, mask, dout, eps=1e-20, backend=backend)


def test_plan_device_binding(backend):
    plan = EngramGatePlan(dim=64, max_tokens=8, device="cuda", eps=1e-20, backend=backend)
    x, kv, weight, mask, _ = make(4, 64, "cpu", seed=14)
    with pytest.raises(ValueError, match="expected device cuda"):
        plan.forward(x, kv, weight, mask, torch.empty_like(x), torch.empty(4, 4, 4))
