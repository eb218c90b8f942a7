"""``chunk_gdn``'s fused forward and backward end to end, against the FP64 references, on every fused
backend the op registers (the ``backend`` fixture).

Oracles: autograd of the FP64 token-by-token recurrence (:func:`naive_recurrent_gdn`) where it is
affordable (up to about 2,000 tokens); at 32,768 tokens the FP64 chunked backward with explicit
formulas (:func:`chunk_gdn_backward_reference`), itself equal to autograd of the recurrence to
1e-10 (tests/gdn/test_gdn_reference_backward.py). The loss is ``sum(o * do) + sum(final_state * dht)``
with random ``do``, ``dht``, so every output's gradient path is used.

Tolerances (relative RMS over the whole tensor, the contract's): ``o`` and the final state
``0.005``; ``dq``, ``dk``, ``dv``, ``dh0`` ``0.008``; ``dg``, ``dbeta`` ``0.02``, for bf16 inputs
on the GPU. On the CPU (Triton's interpreter, fp32 inputs, full-fp32 dots) ``1e-4`` for all.

GPU cases: one sequence; five documents in 32,768 tokens; documents of one token and shorter than
a chunk, lengths not multiples of 64; B = 2 without ``cu_seqlens``; (H, HV) in (16, 16), (16, 32),
(16, 48), (4, 12); with and without an initial state; L2 norm on and off; direct and checkpointed
(``torch.utils.checkpoint``, non-reentrant: the forward runs twice). Also: 20 repeats bitwise equal;
packed views, plain split views and contiguous inputs bitwise equal, with hooks and retain_grad;
torch.compile(fullgraph=True); CUDA Graph capture of forward and backward.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise, model_like_gates
from helpers import rel_rms
from torch.utils.checkpoint import checkpoint

from dsfuse.gdn import chunk_gdn, naive_recurrent_gdn
from dsfuse.gdn.packed import packed_qkv_views
from dsfuse.gdn.reference_backward import chunk_gdn_backward_reference
from dsfuse.gdn.reference import chunk_gdn_reference

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
CONTRACT = {"o": 5e-3, "final_state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2,
            "dbeta": 2e-2}
CPU_RMS = 1e-4


def five_documents(tokens: int) -> list[int]:
    """Five documents of unequal lengths (none a multiple of 64) filling ``tokens``."""
    weights = [0.27, 0.09, 0.34, 0.18, 0.12]
    bounds = [0]
    for w in weights[:-1]:
        bounds.append(bounds[-1] + int(w * tokens) | 1)  # odd lengths
    return bounds + [tokens]


def make_case(tokens, cu, heads, heads_v, *, l2, h0, dtype, device, dim=128, batch=1, seed=0):
    """Inputs (leaves on ``device`` in ``dtype``; g fp32; the initial state fp32), ``do`` and ``dht``."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = randn(batch, tokens, heads, dim), randn(batch, tokens, heads, dim)
    if not l2:  # keys of norm about 1, as the model's normalised keys
        q, k = q * dim**-0.5, k * dim**-0.5
    v = randn(batch, tokens, heads_v, dim)
    g, beta = model_like_gates((batch, tokens, heads_v), gen)
    num_seqs = batch if cu is None else len(cu) - 1
    state = randn(num_seqs, heads_v, dim, dim) * 0.1 if h0 else None
    do = randn(batch, tokens, heads_v, dim)
    dht = randn(num_seqs, heads_v, dim, dim) * 0.1
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    x = dict(q=cast(q), k=cast(k), v=cast(v), g=g.float().to(device), beta=cast(beta),
             initial_state=None if state is None else state.to(device),
             cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))
    return x, cast(do), dht.to(device)


def run_dsfuse(x, do, dht, *, l2, backend, checkpointed=False):
    """Outputs and gradients of the leaves q, k, v, g, beta (and the initial state) as a dict."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    if x["initial_state"] is not None:
        leaves["initial_state"] = x["initial_state"].detach().clone().requires_grad_()

    def fn(*args):
        kw = dict(x, **dict(zip(leaves, args)))
        return chunk_gdn(**kw, output_final_state=True, use_qk_l2norm_in_kernel=l2, backend=backend)

    if checkpointed:
        o, ht = checkpoint(fn, *leaves.values(), use_reentrant=False)
    else:
        o, ht = fn(*leaves.values())
    loss = (o.float() * do.float()).sum() + (ht * dht).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    out = {"o": o.detach(), "final_state": ht.detach()}
    for name, grad in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        out[name] = grad
    return out


def reference(x, do, dht, *, l2, naive: bool):
    """The FP64 oracle's outputs and gradients (see the module docstring)."""
    x64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}
    if naive:
        leaves = {n: x64[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
        if x64["initial_state"] is not None:
            leaves["initial_state"] = x64["initial_state"].clone().requires_grad_()
        o, ht = naive_recurrent_gdn(**dict(x64, **leaves), output_final_state=True, use_qk_l2norm_in_kernel=l2)
        loss = (o * do.double()).sum() + (ht * dht.double()).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
    else:
        with torch.no_grad():
            o, ht = chunk_gdn_reference(**x64, output_final_state=True, use_qk_l2norm_in_kernel=l2)
            grads = chunk_gdn_backward_reference(**x64, use_qk_l2norm_in_kernel=l2, do=do.double(),
                                                 dht=dht.double())
    out = {"o": o.detach(), "final_state": ht.detach()}
    for name, grad in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        out[name] = grad
    return out




def assert_matches(got, want, tol):
    errors = {}
    for name in NAMES:
        if name not in want or want[name] is None:
            continue
        assert got[name] is not None, f"{name}: no gradient"
        assert got[name].shape == want[name].shape, (name, got[name].shape, want[name].shape)
        assert torch.isfinite(got[name]).all(), f"{name}: non-finite values"
        errors[name] = rel_rms(got[name], want[name])
    bad = {n: e for n, e in errors.items() if e > (tol[n] if isinstance(tol, dict) else tol)}
    assert not bad, f"relative RMS over the bound: {bad} (all: {errors})"
    return errors


# ----------------------------------------------------------------------------- CPU: the interpreter


CPU_CASES = {
    # name: (tokens, cu_seqlens, (H, HV), l2, initial state, batch)
    "docs-H2_HV6-l2-h0": (150, [0, 1, 41, 41, 150], (2, 6), True, True, 1),
    "batch2-H1_HV2-raw": (70, None, (1, 2), False, False, 2),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_interpreter_against_fp64_recurrence(name, backend):
    tokens, cu, (h, hv), l2, h0, batch = CPU_CASES[name]
    x, do, dht = make_case(tokens, cu, h, hv, l2=l2, h0=h0, dtype=torch.float32, device="cpu", dim=16, batch=batch)
    got = run_dsfuse(x, do, dht, l2=l2, backend=backend)
    assert_matches(got, reference(x, do, dht, l2=l2, naive=True), CPU_RMS)


def test_cpu_packed_split_and_contiguous_are_bitwise_equal(backend):
    _packed_split_contiguous("cpu", torch.float32, backend, tokens=90, cu=[0, 20, 90], heads=(1, 3), dim=16)


def test_cpu_an_unused_output_gets_no_zeros_and_counts_as_zero(backend, monkeypatch):
    """The backward gets None, not zeros, for the forward's internal outputs (g_cum and A: zeros the size
    of A would be a gigabyte at the experiment's shape) and for an unused o or final state; an unused
    output's gradient is then zero: the same bits as a loss that weights it by zeros."""
    from dsfuse.gdn.api import forward_ops

    fn = forward_ops[backend].function
    original = fn.backward
    seen = []

    def spy(ctx, *grads):
        seen.append(tuple(g is None for g in grads))
        return original(ctx, *grads)

    monkeypatch.setattr(fn, "backward", staticmethod(spy))
    x, do, dht = make_case(90, [0, 20, 90], 1, 3, l2=True, h0=True, dtype=torch.float32, device="cpu", dim=16)
    for used in ("o", "final_state"):
        keep_do, keep_dht = (do, torch.zeros_like(dht)) if used == "o" else (torch.zeros_like(do), dht)
        want = run_dsfuse(x, keep_do, keep_dht, l2=True, backend=backend)
        leaves = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")}
        o, ht = chunk_gdn(**dict(x, **leaves), output_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend)
        loss = (o.float() * do.float()).sum() if used == "o" else (ht * dht).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        for name, grad in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
            assert_bitwise(grad, want[name], f"{name}, only {used} used")
    assert seen[1::2] == [(False, True, True, True), (True, False, True, True)], seen  # the one-output calls


# ----------------------------------------------------------------------------- GPU: the contract


GPU_CASES = {
    # name: (tokens, cu_seqlens, (H, HV), l2, initial state, batch, checkpointed, naive oracle)
    "one_seq-16_48-l2-h0": (1000, None, (16, 48), True, True, 1, False, True),
    "docs5_32k-16_48-l2-h0": (32768, five_documents(32768), (16, 48), True, True, 1, False, False),
    "docs5_32k-16_48-raw-h0": (32768, five_documents(32768), (16, 48), False, True, 1, False, False),
    "docs5_32k-16_48-l2-zero-ckpt": (32768, five_documents(32768), (16, 48), True, False, 1, True, False),
    "short_docs-16_16-l2-h0": (263, [0, 1, 2, 40, 104, 105, 169, 200, 263], (16, 16), True, True, 1, False, True),
    "short_docs-16_32-raw-zero": (263, [0, 1, 2, 40, 104, 105, 169, 200, 263], (16, 32), False, False, 1, False,
                                  True),
    "short_docs-4_12-l2-h0-ckpt": (263, [0, 1, 2, 40, 104, 105, 169, 200, 263], (4, 12), True, True, 1, True, True),
    "one_token_docs-4_12-raw-h0": (5, [0, 1, 2, 3, 4, 5], (4, 12), False, True, 1, False, True),
    "batch2-16_32-l2-h0": (300, None, (16, 32), True, True, 2, False, True),
    "docs-16_48-raw-zero-ckpt": (2000, [0, 700, 701, 1333, 2000], (16, 48), False, False, 1, True, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_bf16_against_fp64(name, backend):
    tokens, cu, (h, hv), l2, h0, batch, ckpt, naive = GPU_CASES[name]
    x, do, dht = make_case(tokens, cu, h, hv, l2=l2, h0=h0, dtype=torch.bfloat16, device="cuda", batch=batch)
    got = run_dsfuse(x, do, dht, l2=l2, backend=backend, checkpointed=ckpt)
    errors = assert_matches(got, reference(x, do, dht, l2=l2, naive=naive), CONTRACT)
    print(name, {n: f"{e:.2e}" for n, e in errors.items()})


@pytest.mark.gpu
def test_gpu_twenty_repeats_are_bitwise_equal(backend):
    x, do, dht = make_case(32768, five_documents(32768), 16, 48, l2=True, h0=True, dtype=torch.bfloat16,
                           device="cuda")
    first = run_dsfuse(x, do, dht, l2=True, backend=backend)
    for _ in range(20):
        again = run_dsfuse(x, do, dht, l2=True, backend=backend)
        for name in NAMES:
            assert_bitwise(again[name], first[name], name)


@pytest.mark.gpu
def test_gpu_packed_split_and_contiguous_are_bitwise_equal(backend):
    _packed_split_contiguous("cuda", torch.bfloat16, backend, tokens=2000, cu=[0, 700, 701, 1333, 2000],
                             heads=(16, 48), dim=128)


def _packed_split_contiguous(device, dtype, backend, *, tokens, cu, heads, dim):
    """One packed row through packed_qkv_views, through plain split views, and as contiguous leaves:
    bitwise equal outputs and gradients; hooks and retain_grad fire on the views; the packed row's
    gradient is assembled without a concatenation (no ``aten::cat`` in the packed backward)."""
    h, hv = heads
    x, do, dht = make_case(tokens, cu, h, hv, l2=True, h0=True, dtype=dtype, device=device, dim=dim)
    rest = dict(g=x["g"], beta=x["beta"], initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
                output_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend)
    row_data = torch.cat([x["q"].flatten(2), x["k"].flatten(2), x["v"].flatten(2)], -1)[0]  # [T, (2H + HV) D]

    def loss_of(o, ht):
        return (o.float() * do.float()).sum() + (ht * dht).sum()

    results = {}
    for how in ("packed", "split"):
        row = row_data.clone().requires_grad_()
        if how == "packed":
            q, k, v = packed_qkv_views(row, h, hv)
        else:
            q, k, v = (t.unflatten(-1, (-1, dim)).unsqueeze(0) for t in row.split([h * dim, h * dim, hv * dim], -1))
        fired = []
        q.register_hook(lambda grad: fired.append("q"))
        v.retain_grad()
        o, ht = chunk_gdn(q, k, v, **rest)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss_of(o, ht).backward()
        cats = [e for e in prof.events() if e.name == "aten::cat"]
        assert fired == ["q"], f"{how}: the hook on q did not fire"
        assert v.grad is not None, f"{how}: retain_grad on v kept nothing"
        results[how] = (o.detach(), ht.detach(), row.grad, v.grad)
        if how == "packed":
            assert not cats, f"packed views: {len(cats)} concatenation(s) in the backward"
        else:
            assert cats, "plain split views: expected torch's split backward to concatenate"
    leaves = [t.detach().clone().requires_grad_() for t in (x["q"], x["k"], x["v"])]
    o, ht = chunk_gdn(*leaves, **rest)
    loss_of(o, ht).backward()
    contiguous_row = torch.cat([t.grad.flatten(2) for t in leaves], -1)[0]
    for a, b in ((results["packed"], results["split"]),):
        for i, what in enumerate(("o", "final_state", "row grad", "v grad")):
            assert_bitwise(a[i], b[i], f"packed vs split: {what}")
    assert_bitwise(results["packed"][0], o.detach(), "packed vs contiguous: o")
    assert_bitwise(results["packed"][2], contiguous_row, "packed vs contiguous: row grad")


# ----------------------------------------------------------------------------- compile, graphs


def test_compile_fullgraph_equals_eager(device, backend):
    dtype, dim = (torch.float32, 16) if device == "cpu" else (torch.bfloat16, 128)
    x, do, dht = make_case(130, [0, 1, 70, 130], 2, 4, l2=True, h0=True, dtype=dtype, device=device, dim=dim)
    want = run_dsfuse(x, do, dht, l2=True, backend=backend)

    def step(q, k, v, g, beta, h0):
        o, ht = chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=x["cu_seqlens"],
                          use_qk_l2norm_in_kernel=True, backend=backend)
        return (o.float() * do.float()).sum() + (ht * dht).sum(), o, ht

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    loss, o, ht = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    assert_bitwise(o.detach(), want["o"], "o")
    assert_bitwise(ht.detach(), want["final_state"], "final_state")
    for name, grad in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        assert_bitwise(grad, want[name], name)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_of_forward_and_backward(backend):
    """B = 2 sequences (no cu_seqlens): after one eager call, forward and backward replay in a
    CUDA Graph and give bitwise the eager results."""
    x, do, dht = make_case(300, None, 4, 12, l2=True, h0=True, dtype=torch.bfloat16, device="cuda", batch=2)
    want = run_dsfuse(x, do, dht, l2=True, backend=backend)  # the warm-up: chunk table on the GPU, kernels compiled
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]

    def step():
        o, ht = chunk_gdn(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                          use_qk_l2norm_in_kernel=True, backend=backend)
        loss = (o.float() * do.float()).sum() + (ht * dht).sum()
        return (o.detach(), ht.detach(), *torch.autograd.grad(loss, leaves))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, got in zip(NAMES, outs):
        assert_bitwise(got, want[name], name)


@pytest.mark.gpu
def test_gpu_graph_capture_of_unseen_documents_is_refused_clearly():
    """The chunk table of new documents needs a host-to-device copy, which a capture cannot hold."""
    from dsfuse.gdn import schedule

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be copied while a CUDA Graph is captured"):
        with torch.cuda.graph(graph):
            schedule.chunk_table([0, 3, 777], torch.device("cuda"))
