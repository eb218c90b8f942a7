"""``dsfuse.gdn.chunk_gdn``: the fused forward schedule against the FP64 recurrence, backend choice
under autograd, packed views, determinism.

CPU: the stages in the interpreter on small shapes (K = V = 16, fp32: the interpreter truncates
bf16 stores); the same tests run on the GPU in bf16 at the contract's tolerance. Each fused backend
the op registers (the ``backend`` fixture).
"""

import pytest
import torch
from helpers import rel_rms

from dsfuse.gdn import chunk_gdn, gdn_gates, naive_recurrent_gdn

CONTRACT = {torch.float32: 1e-4, torch.bfloat16: 5e-3}  # relative RMS of o and the final state


def make(tokens, heads, heads_v, dim, dtype, device, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = randn(batch, tokens, heads, dim), randn(batch, tokens, heads, dim)
    v = randn(batch, tokens, heads_v, dim)
    g, beta = gdn_gates(randn(batch, tokens, heads_v), randn(batch, tokens, heads_v),
                        torch.rand(heads_v, generator=gen) * 3, randn(heads_v))
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), g=g.float().to(device), beta=cast(beta))




@pytest.mark.parametrize("l2", [False, True], ids=["l2-off", "l2-on"])
@pytest.mark.parametrize("layout", ["varlen", "batch2"])
def test_forward_against_fp64_recurrence(device, backend, l2, layout):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dim = 16 if device == "cpu" else 128
    if layout == "varlen":
        x = make(150, 2, 6, dim, dtype, device)
        x["cu_seqlens"] = torch.tensor([0, 1, 41, 41, 150], dtype=torch.int32)  # one token, an empty document
        num_seqs = 4
    else:
        x = make(100, 1, 3, dim, dtype, device, batch=2)
        num_seqs = 2
    # slow decay and small steps: the initial state still shapes o and the final state at the end
    # (checked below, so the comparison with the recurrence can see a dropped or misread state)
    x["g"], x["beta"] = x["g"].clamp(min=-0.01), x["beta"] * 0.1
    if not l2:  # keys of norm about 1, as the model's normalised keys (raw randn keys make the recurrence diverge)
        x["k"] = x["k"] * dim**-0.5
    x["initial_state"] = torch.randn(num_seqs, x["v"].shape[2], dim, dim, device=device)
    o, ht = chunk_gdn(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2, backend=backend)
    ref_o, ref_ht = naive_recurrent_gdn(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    no_h0 = naive_recurrent_gdn(**dict(x, initial_state=None), output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert rel_rms(no_h0[0], ref_o) > 10 * CONTRACT[dtype] and rel_rms(no_h0[1], ref_ht) > 10 * CONTRACT[dtype]
    assert o.dtype == x["v"].dtype and ht.dtype == torch.float32
    assert rel_rms(o, ref_o) <= CONTRACT[dtype] and rel_rms(ht, ref_ht) <= CONTRACT[dtype]
    again = chunk_gdn(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2, backend=backend)
    assert torch.equal(o, again[0]) and torch.equal(ht, again[1])  # deterministic


def test_packed_row_views_equal_contiguous_inputs(device, backend):
    """q, k, v as head views of one packed row [T, (2H + HV) K] give bitwise the contiguous result."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    heads, heads_v, dim, tokens = 2, 4, 16 if device == "cpu" else 64, 70
    x = make(tokens, heads, heads_v, dim, dtype, device)
    row = torch.cat([x["q"].flatten(2), x["k"].flatten(2), x["v"].flatten(2)], -1)[0]  # [T, (2H + HV) K]
    q, k, v = row.split([heads * dim, heads * dim, heads_v * dim], -1)
    views = dict(x, q=q.view(1, tokens, heads, dim), k=k.view(1, tokens, heads, dim), v=v.view(1, tokens, heads_v, dim))
    assert views["q"].stride(1) == (2 * heads + heads_v) * dim
    got, want = chunk_gdn(**views, backend=backend)[0], chunk_gdn(**x, backend=backend)[0]
    assert torch.equal(got, want)


def test_a_forward_no_backward_reads_keeps_no_A(device, backend, monkeypatch):
    """The forward op without ``save`` (`chunk_gdn` without gradients): ``A`` empty (with it, the
    Triton stages' ``[T, HV, 64]``, or the fused backward's buffer where it serves), o and the final
    state bitwise those of a saving call, and `chunk_gdn` the same bits with and without autograd,
    asking for ``save`` only when an input requires a gradient in grad mode."""
    from dsfuse.gdn import api

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dim, tokens = (16, 70) if device == "cpu" else (128, 200)
    x = make(tokens, 2, 4, dim, dtype, device)
    cu = torch.tensor([0, 1, 66, tokens])
    outs = [api.forward_ops[backend](x["q"], x["k"], x["v"], x["g"], x["beta"], None, cu, dim**-0.5, True, False, save)
            for save in (False, True)]
    (o0, ht0, g0, a0), (o1, ht1, g1, a1) = outs
    saved_rows = tokens  # the Triton stages' A; the cutedsl backend's fused backward reads a buffer of its own
    if backend == "cutedsl" and device == "cuda":
        from dsfuse.gdn.cutedsl import backward as fused

        if fused.serves(x["v"].device, 2, 4, dim, dim, dtype):
            saved_rows = fused.saved_rows(tokens, len(cu) - 1, dim, dim)
    assert a0.shape == (0, 4, 64) and a1.shape == (saved_rows, 4, 64)
    assert torch.equal(o0, o1) and torch.equal(ht0, ht1) and torch.equal(g0, g1)
    op, saves = api.forward_ops[backend], []
    monkeypatch.setitem(api.forward_ops, backend, lambda *args: saves.append(args[-1]) or op(*args))
    leaf = x["v"].detach().requires_grad_()
    with torch.no_grad():
        plain = chunk_gdn(**x, cu_seqlens=cu, output_final_state=True, backend=backend)
        no_grad_mode = chunk_gdn(**dict(x, v=leaf), cu_seqlens=cu, output_final_state=True, backend=backend)
    graded = chunk_gdn(**dict(x, v=leaf), cu_seqlens=cu, output_final_state=True, backend=backend)
    assert saves == [False, False, True]
    assert torch.equal(plain[0], graded[0]) and torch.equal(plain[1], graded[1])
    assert torch.equal(plain[0], o0) and torch.equal(no_grad_mode[0], o0)


def test_a_compiled_forward_without_gradients(device, backend):
    """`chunk_gdn` under ``torch.compile(fullgraph=True)`` and no grad mode (the op's fake output with
    an empty ``A``): the eager call's bits."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dim, tokens = (16, 70) if device == "cpu" else (128, 200)
    x = make(tokens, 2, 4, dim, dtype, device)
    cu = torch.tensor([0, 1, 66, tokens])

    def fwd(q, k, v, g, beta):
        return chunk_gdn(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, backend=backend)

    with torch.no_grad():
        want = fwd(**x)
        got = torch.compile(fwd, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(**x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_autograd_on_the_cpu_takes_the_reference():
    """``auto`` on the CPU is the reference (differentiable in fp32); the fused backward under the
    interpreter is tested in tests/gdn/test_gdn_backward.py."""
    x = make(40, 1, 2, 16, torch.float32, "cpu")
    x["q"].requires_grad_()
    o, _ = chunk_gdn(**x)
    (dq,) = torch.autograd.grad(o.sum(), x["q"])
    leaf = x["q"].detach().requires_grad_()
    (want,) = torch.autograd.grad(naive_recurrent_gdn(**dict(x, q=leaf))[0].sum(), leaf)
    assert rel_rms(dq, want) <= 1e-5


def test_the_op_is_registered_with_its_stage_modules():
    from dsfuse._common.backends import OPS

    assert set(OPS["gdn"].kernels["triton"]) == {f"dsfuse.gdn.triton.{m}" for m in (
        "cumsum", "wy", "state", "output", "state_bwd", "dqkwg", "wy_bwd", "finalize")}
