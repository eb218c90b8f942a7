"""Gated DeltaNet references: the chunked algorithm against the token-by-token recurrence (CPU).

Oracles, from the ground up:

* ``delta_rule_trace`` below: one sequence, one head, scalar loops over the brief's
  recurrence, with its own L2 norm and grouped-head mapping. It checks
  :func:`naive_recurrent_gdn` (so a slip shared by both references' input preparation is
  caught) and gives the per-token corrections ``u_t`` and the states at chunk starts that
  each chunk stage is checked against.
* :func:`naive_recurrent_gdn` in fp64 is the oracle of :func:`chunk_gdn_reference` and of its
  autograd gradients (dq, dk, dv, dg, dbeta, dh0, through ``o`` and the final state).

Tolerances:

* fp64 against fp64: every element within ``1e-10`` of the tensor's largest magnitude
  (observed ~1e-15: the two orders of summation differ only in rounding).
* fp32 chunked against fp64 naive: relative RMS ``<= 1e-5`` and largest element error
  ``<= 1e-4`` of the largest magnitude, for ``o``, the final state and every gradient but
  ``dg`` (observed 1e-7 to 2.4e-6 RMS: fp32's unit roundoff 6e-8 times sums over a chunk;
  the UT transform is unit triangular and well conditioned for ``0 < beta < 1``,
  ``|k| ~ 1``). ``dg``: relative RMS ``<= max(1e-5, u32 * max|G|)`` (``u32 = 2^-24``, ``G``
  the within-chunk cumulative gate; largest element ``10x``). The chunked form
  exponentiates differences of fp32 cumulative sums, each off by about ``u32 * |G|``
  absolutely; with model gates ``|G| <= ~70`` and the bound is 1e-5 (observed <= 5e-7),
  with strong gates ``|G| ~ 4e3``, bound 2.3e-4, observed 1e-5 to 6e-5, where the fp32
  naive recurrence (no cumulative sums) stays at 2e-7. The kernels inherit this.

Sizes: head dims K = 16, V = 24 (parameters; 128 in the model) to stay fast, and the model's
128 in one test; T = 150 (not a multiple
of 64), B = 2 without ``cu_seqlens``, and four packed documents of 1, 45, 0 and 130 tokens
followed by 4 tokens in no document (output and gradients there must be 0). Head groups
(H, HV) = (2, 2), (2, 4), (2, 6) and (1, 3). Gates as the model makes them
(``g = -exp(A_log) * softplus(a + dt_bias)``), and strongly decaying ones (|g| up to ~100 per
token: within-chunk cumulative gates of -10^3 to -10^4, whose upper-triangle differences
would overflow ``exp`` if not masked).
"""

from __future__ import annotations

import itertools
import math

import pytest
from helpers import model_like_gates
import torch
from dsfuse.gdn import (
    chunk_gdn_reference,
    chunk_gdn_stages,
    chunk_local_cumsum,
    chunk_output,
    chunk_state_pass,
    decay_matrix,
    from_chunks,
    gdn_gates,
    naive_recurrent_gdn,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    split_by_documents,
    to_chunks,
    ut_transform,
    wy_representation,
)

F64 = torch.float64
DK, DV = 16, 24  # different, so a transposed [K, V] state cannot pass
# name: (B, T, cu_seqlens)
LAYOUTS = {
    "one_seq_T150": (1, 150, None),
    "batch2_T100": (2, 100, None),
    "docs_1_45_0_130_tail4": (1, 180, [0, 1, 46, 46, 176]),
}
HEAD_GROUPS = [(2, 2), (2, 4), (2, 6), (1, 3)]


# ----------------------------------------------------------------------------- inputs


def make_inputs(layout, heads, *, seed=0, gates="model", dtype=torch.float32, with_h0=True, dk=DK, dv=DV):
    """Random q, k, v, model-made gates, initial state, and cotangents for o and the final state."""
    batch, tokens, cu = LAYOUTS[layout] if isinstance(layout, str) else layout
    h, hv = heads
    gen = torch.Generator().manual_seed(seed)
    num_seqs = batch if cu is None else len(cu) - 1
    q = torch.randn(batch, tokens, h, dk, generator=gen)
    k = torch.randn(batch, tokens, h, dk, generator=gen) * dk**-0.5  # |k| ~ 1 without the L2 norm
    v = torch.randn(batch, tokens, hv, dv, generator=gen)
    g, beta = model_like_gates((batch, tokens, hv), gen, gates)
    h0 = torch.randn(num_seqs, hv, dk, dv, generator=gen) if with_h0 else None
    do = torch.randn(batch, tokens, hv, dv, generator=gen)
    dht = torch.randn(num_seqs, hv, dk, dv, generator=gen)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0, "cu_seqlens": cu}, do, dht


def as_leaves(inputs, dtype):
    out = dict(inputs)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        if out[name] is not None:
            out[name] = out[name].to(dtype).requires_grad_()
    return out


def forward_and_grads(fn, inputs, do, dht, dtype, **kwargs):
    """``(o, final_state, {name: grad})`` of ``sum(o * do) + sum(final_state * dht)``."""
    leaves = as_leaves(inputs, dtype)
    o, final = fn(**leaves, output_final_state=True, compute_dtype=dtype, **kwargs)
    loss = (o * do.to(o.dtype)).sum() + (final * dht.to(final.dtype)).sum()
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if leaves[n] is not None]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return o, final, dict(zip(names, grads))


# ----------------------------------------------------------------------------- comparisons


def assert_max_rel(got, want, tol, what):
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got - want).abs().max() / want.abs().max().clamp_min(1e-300)
    assert err <= tol, f"{what}: largest error {err:.2e} of the largest magnitude > {tol:.0e}"


def assert_rel_rms(got, want, tol, what, worst=None):
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    rms = (got - want).norm() / want.norm().clamp_min(1e-300)
    assert rms <= tol, f"{what}: relative RMS error {rms:.2e} > {tol:.0e}"
    if worst is not None:
        assert_max_rel(got, want, worst, what)


# ----------------------------------------------------------------------------- independent scalar oracle


def delta_rule_trace(q, k, v, g, beta, h0, scale, l2):
    """One sequence, one head, the brief's loop literally. ``q, k`` ``[T, K]``, ``v`` ``[T, V]``, ``g, beta`` ``[T]``.

    Returns ``o`` ``[T, V]``, ``u`` ``[T, V]`` (each token's correction) and the states after
    every token ``[T + 1, K, V]`` (index 0: the initial state).
    """
    if l2:
        q = q / torch.sqrt((q**2).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k**2).sum(-1, keepdim=True) + 1e-6)
    state = h0.clone()
    os, us, states = [], [], [state]
    for t in range(q.shape[0]):
        state = math.exp(g[t]) * state
        u = beta[t] * (v[t] - state.T @ k[t])
        state = state + torch.outer(k[t], u)
        os.append(scale * state.T @ q[t])
        us.append(u)
        states.append(state)
    empty = v.new_zeros(0, v.shape[-1])
    return (torch.stack(os) if os else empty), (torch.stack(us) if us else empty), torch.stack(states)


def trace_all(inputs, scale, l2):
    """:func:`delta_rule_trace` for every document and value head: packed o, u ``[T, HV, V]``, states."""
    q, k, v, g, beta = (inputs[n].double() for n in ("q", "k", "v", "g", "beta"))
    batch, tokens, h, hv = q.shape[0], q.shape[1], q.shape[2], v.shape[2]
    q, k, v, g, beta = (x.flatten(0, 1) for x in (q, k, v, g, beta))
    cu = inputs["cu_seqlens"] or [i * tokens for i in range(batch + 1)]
    h0 = inputs["initial_state"]
    o, u = torch.zeros_like(v), torch.zeros_like(v)
    states = {}
    for n, (bos, eos) in enumerate(itertools.pairwise(cu)):
        for j in range(hv):
            i = j // (hv // h)
            start = h0[n, j].double() if h0 is not None else v.new_zeros(q.shape[-1], v.shape[-1])
            o_t, u_t, s_t = delta_rule_trace(q[bos:eos, i], k[bos:eos, i], v[bos:eos, j], g[bos:eos, j].tolist(),
                                             beta[bos:eos, j].tolist(), start, scale, l2)
            o[bos:eos, j], u[bos:eos, j] = o_t, u_t
            states[n, j] = s_t
    return o, u, states


# ----------------------------------------------------------------------------- the naive recurrence itself


@pytest.mark.parametrize("heads", [(2, 6), (1, 3)], ids=lambda p: f"H{p[0]}_HV{p[1]}")
@pytest.mark.parametrize("l2", [False, True], ids=["raw_qk", "l2norm"])
def test_naive_matches_scalar_trace(heads, l2):
    inputs, _, _ = make_inputs("docs_1_45_0_130_tail4", heads, seed=1)
    scale = 0.3
    o, final = naive_recurrent_gdn(**inputs, scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    want_o, _, states = trace_all(inputs, scale, l2)
    assert_max_rel(o[0], want_o, 1e-12, "o")
    want_final = torch.stack([torch.stack([states[n, j][-1] for j in range(heads[1])]) for n in range(4)])
    assert_max_rel(final, want_final, 1e-12, "final state")
    assert torch.equal(final[2], inputs["initial_state"][2].double()), "an empty document keeps its initial state"
    assert (o[0, 176:] == 0).all(), "tokens in no document"


def test_naive_default_scale_and_dtypes():
    inputs, _, _ = make_inputs("one_seq_T150", (2, 4), dtype=torch.bfloat16)
    o64, s64 = naive_recurrent_gdn(**inputs, output_final_state=True)
    o_scaled, _ = naive_recurrent_gdn(**inputs, scale=DK**-0.5)
    assert torch.equal(o64, o_scaled), "scale defaults to K ** -0.5"
    assert o64.dtype == s64.dtype == F64
    o32, s32 = chunk_gdn_reference(**inputs, output_final_state=True, compute_dtype=torch.float32)
    assert o32.dtype == torch.bfloat16 and s32.dtype == torch.float32, "fp32 compute: o in v's dtype, state fp32"
    assert naive_recurrent_gdn(**inputs)[1] is None and chunk_gdn_reference(**inputs)[1] is None


# ----------------------------------------------------------------------------- chunked == naive (fp64)


@pytest.mark.parametrize("with_h0", [False, True], ids=["h0_zero", "h0"])
@pytest.mark.parametrize("l2", [False, True], ids=["raw_qk", "l2norm"])
@pytest.mark.parametrize("heads", HEAD_GROUPS, ids=lambda p: f"H{p[0]}_HV{p[1]}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunk_matches_naive_fp64(layout, heads, l2, with_h0):
    inputs, _, _ = make_inputs(layout, heads, seed=2, with_h0=with_h0)
    kw = {"output_final_state": True, "use_qk_l2norm_in_kernel": l2}
    o, final = chunk_gdn_reference(**inputs, **kw)
    want_o, want_final = naive_recurrent_gdn(**inputs, **kw)
    assert o.shape == want_o.shape and final.shape == want_final.shape
    assert_max_rel(o, want_o, 1e-10, "o")
    assert_max_rel(final, want_final, 1e-10, "final state")


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunk_matches_naive_scale_and_chunk_size(layout, chunk_size):
    inputs, _, _ = make_inputs(layout, (2, 6), seed=3)
    kw = {"scale": 0.37, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    o, final = chunk_gdn_reference(**inputs, **kw, chunk_size=chunk_size)
    want_o, want_final = naive_recurrent_gdn(**inputs, **kw)
    assert_max_rel(o, want_o, 1e-10, "o")
    assert_max_rel(final, want_final, 1e-10, "final state")


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("with_h0,l2", [(True, True), (False, False)], ids=["h0_l2norm", "h0_zero_raw_qk"])
@pytest.mark.parametrize("heads", HEAD_GROUPS, ids=lambda p: f"H{p[0]}_HV{p[1]}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunk_gradients_match_naive_fp64(layout, heads, with_h0, l2):
    inputs, do, dht = make_inputs(layout, heads, seed=4, with_h0=with_h0)
    kw = {"use_qk_l2norm_in_kernel": l2, "scale": 0.3}
    o, final, grads = forward_and_grads(chunk_gdn_reference, inputs, do, dht, F64, **kw)
    want_o, want_final, want = forward_and_grads(naive_recurrent_gdn, inputs, do, dht, F64, **kw)
    assert_max_rel(o, want_o, 1e-10, "o")
    assert_max_rel(final, want_final, 1e-10, "final state")
    assert set(grads) == set(want)
    for name in want:
        assert_max_rel(grads[name], want[name], 1e-10, f"d{name}")
    if inputs["cu_seqlens"] is not None:
        for name in ("q", "k", "v", "g", "beta"):
            assert (grads[name][0, 176:] == 0).all(), f"d{name} of tokens in no document"
        if with_h0:  # an empty document passes the final state's gradient straight to its initial state
            assert torch.equal(grads["initial_state"][2], dht[2].double())


# ----------------------------------------------------------------------------- fp32 and gates


@pytest.mark.parametrize("gates", ["model", "strong"])
@pytest.mark.parametrize("layout", ["one_seq_T150", "docs_1_45_0_130_tail4"])
def test_chunk_fp32_within_tolerance_of_naive_fp64(layout, gates):
    inputs, do, dht = make_inputs(layout, (2, 6), seed=5, gates=gates)
    kw = {"use_qk_l2norm_in_kernel": True}
    o, final, grads = forward_and_grads(chunk_gdn_reference, inputs, do, dht, torch.float32, **kw)
    want_o, want_final, want = forward_and_grads(naive_recurrent_gdn, inputs, do, dht, F64, **kw)
    assert o.dtype == final.dtype == torch.float32
    assert_rel_rms(o, want_o, 1e-5, "o", worst=1e-4)
    assert_rel_rms(final, want_final, 1e-5, "final state", worst=1e-4)
    # dg: the fp32 within-chunk cumulative gate G carries an absolute error ~ eps * |G|, and
    # so does every exp(G_i - G_j); with strong gates (|G| ~ 4e3) that dominates dg
    g_cum_max = chunk_gdn_stages(**inputs, **kw).g_cum.abs().max().item()
    dg_tol = max(1e-5, torch.finfo(torch.float32).eps / 2 * g_cum_max)  # unit roundoff * |G|
    for name in want:
        tol = dg_tol if name == "g" else 1e-5
        assert_rel_rms(grads[name], want[name], tol, f"d{name}", worst=10 * tol)


def test_strong_gates_stay_finite_and_exact():
    inputs, do, dht = make_inputs("docs_1_45_0_130_tail4", (2, 4), seed=6, gates="strong")
    g = inputs["g"]
    assert (g <= 0).all() and g.min() < -60, "strong gates reach |g| > 60 per token"
    stages = chunk_gdn_stages(**inputs, use_qk_l2norm_in_kernel=True)
    assert stages.g_cum.min() < -1000, "within-chunk cumulative gates far below exp's range"
    o, final, grads = forward_and_grads(chunk_gdn_reference, inputs, do, dht, F64, use_qk_l2norm_in_kernel=True)
    want_o, want_final, want = forward_and_grads(naive_recurrent_gdn, inputs, do, dht, F64,
                                                 use_qk_l2norm_in_kernel=True)
    assert_max_rel(o, want_o, 1e-10, "o")
    assert_max_rel(final, want_final, 1e-10, "final state")
    for name in want:
        assert_max_rel(grads[name], want[name], 1e-10, f"d{name}")  # includes the finiteness check


def test_gdn_gates_formula():
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(5, 3, generator=gen).bfloat16(), torch.randn(5, 3, generator=gen).bfloat16()
    a_log, dt_bias = torch.randn(3, generator=gen), torch.randn(3, generator=gen)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and (g <= 0).all()
    want = -a_log.exp() * torch.log1p(torch.exp(a.float() + dt_bias))
    torch.testing.assert_close(g, want)
    torch.testing.assert_close(beta, 1 / (1 + torch.exp(-b)))


# ----------------------------------------------------------------------------- stages, one by one


def test_chunk_local_cumsum_restarts_at_chunks_and_documents():
    inputs, _, _ = make_inputs("docs_1_45_0_130_tail4", (1, 3), seed=8)
    stages = chunk_gdn_stages(**inputs, chunk_size=16)
    g = inputs["g"][0].double()
    want = torch.zeros_like(g)
    for _, start, end in stages.chunk_indices.tolist():
        for t in range(start, end):
            want[t] = g[start : t + 1].sum(0)
    assert_max_rel(stages.g_cum, want, 1e-14, "g_cum")
    gc = to_chunks(g, stages.chunk_indices, 16)
    assert torch.equal(from_chunks(chunk_local_cumsum(gc), stages.chunk_indices, g.shape[0]), stages.g_cum)


def one_chunk(seed=9, size=12, heads=2, gates="model"):
    """One chunk in the padded chunk layout (chunk size 16, ``size`` real tokens): k, v, beta, g_cum, q."""
    inputs, _, _ = make_inputs((1, size, [0, size]), (heads, heads), seed=seed, gates=gates)
    ci = prepare_chunk_indices([0, size], 16)
    q, k, v, g, beta = (to_chunks(inputs[n][0].double(), ci, 16) for n in ("q", "k", "v", "g", "beta"))
    return q, k, v, beta, chunk_local_cumsum(g), inputs


def test_ut_transform_inverts_the_direct_lower_matrix():
    _, k, _, beta, g_cum, _ = one_chunk()
    A = ut_transform(k, beta, g_cum)
    size = A.shape[-1]
    lower = torch.zeros_like(A)
    for c, hd in itertools.product(range(A.shape[0]), range(A.shape[1])):
        for i in range(size):
            for j in range(i):
                decay = math.exp(g_cum[c, hd, i] - g_cum[c, hd, j])
                lower[c, hd, i, j] = beta[c, hd, i] * (k[c, hd, i] @ k[c, hd, j]) * decay
    eye = torch.eye(size, dtype=F64)
    assert_max_rel(A @ (eye + lower), eye.expand_as(A), 1e-13, "A (I + L)")
    assert torch.equal(A.triu(1), torch.zeros_like(A)), "A is lower triangular"
    assert (A.diagonal(dim1=-2, dim2=-1) == 1).all(), "with a unit diagonal"


def test_decay_matrix_masks_before_exp():
    g_cum = chunk_local_cumsum(torch.full((1, 1, 16), -200.0, dtype=F64)).requires_grad_()
    gamma = decay_matrix(g_cum, include_diagonal=True)
    assert torch.equal(gamma.triu(1), torch.zeros_like(gamma)) and (gamma.diagonal(dim1=-2, dim2=-1) == 1).all()
    assert gamma[0, 0, 5, 4].item() == pytest.approx(math.exp(-200))
    (grad,) = torch.autograd.grad(gamma.sum(), g_cum)
    assert torch.isfinite(grad).all(), "the masked upper triangle (exp(+3000)) must not reach the backward"
    strict = decay_matrix(g_cum.detach(), include_diagonal=False)
    assert torch.equal(strict, gamma.detach().tril(-1))


@pytest.mark.parametrize("gates", ["model", "strong"])
def test_wy_state_pass_and_output_match_the_recurrence(gates):
    """One document of 40 tokens in chunks of 16: per chunk, ``u - w h`` and ``v_new`` are the
    recurrence's ``u_t``, ``h`` its state at the chunk's start, ``o`` its output."""
    layout, heads, size = (1, 40, [0, 40]), (2, 2), 16
    inputs, _, _ = make_inputs(layout, heads, seed=10, gates=gates)
    _, u_trace, states = trace_all(inputs, scale=0.5, l2=True)
    stages = chunk_gdn_stages(**inputs, scale=0.5, use_qk_l2norm_in_kernel=True, chunk_size=size)
    ci = stages.chunk_indices
    assert ci.tolist() == [[0, 0, 16], [0, 16, 32], [0, 32, 40]]
    h_trace = torch.stack([torch.stack([states[0, j][start] for j in range(2)]) for _, start, _ in ci.tolist()])
    assert_max_rel(stages.h, h_trace, 1e-12, "h (state at each chunk start)")
    assert_max_rel(stages.v_new, u_trace, 1e-12, "v_new")
    assert_max_rel(stages.final_state[0], torch.stack([states[0, j][-1] for j in range(2)]), 1e-12, "final state")

    # the WY representation alone, from the recurrence's own chunk-start states
    q, k, v, beta, g_cum = (to_chunks(x, ci, size) for x in (stages.q, stages.k, inputs["v"][0].double(),
                                                            inputs["beta"][0].double(), stages.g_cum))
    A = ut_transform(k, beta, g_cum)
    w, u = wy_representation(A, k, v, beta, g_cum)
    assert_max_rel(from_chunks(u - w @ h_trace, ci, 40), u_trace, 1e-12, "u - w h")
    assert_max_rel(from_chunks(A, ci, 40), stages.A, 0, "A")

    # the state pass alone, from w, u
    h, _v_new, _final = chunk_state_pass(k, w, u, g_cum, ci, 1, inputs["initial_state"].double())
    assert_max_rel(h, h_trace, 1e-12, "chunk_state_pass h")

    # the output alone, from the recurrence's states and corrections
    o = chunk_output(q, k, to_chunks(u_trace, ci, size), h_trace, g_cum, 0.5)
    o_trace, _, _ = trace_all(inputs, scale=0.5, l2=True)
    assert_max_rel(from_chunks(o, ci, 40), o_trace, 1e-12, "chunk_output")
    assert_max_rel(stages.o, o_trace, 1e-12, "stages.o")


@pytest.mark.parametrize("gates", ["model", "strong"])
def test_chunk_maps_composed_by_a_tree_are_the_walk(gates):
    """`chunk_affine_maps` and `compose_maps`: one document of 7 chunks (the last partial, so the tree
    carries an odd one up at two levels), its ``(M, E)`` by the tree equal the state pass from the
    identity with ``u = 0`` and from zero (fp64, 1e-12); two segments' maps merged carry the initial
    state to the walk's final state; in fp32 the tree stays within the contract's 1e-5 of fp64."""
    from dsfuse.gdn.chunk_maps import chunk_affine_maps, compose_maps

    layout, heads, size = (1, 100, [0, 100]), (1, 2), 16
    inputs, _, _ = make_inputs(layout, heads, seed=12, gates=gates, dk=DK, dv=DK)  # V = K: M's walk is a state
    stages = chunk_gdn_stages(**inputs, scale=0.5, use_qk_l2norm_in_kernel=True, chunk_size=size)
    ci = stages.chunk_indices
    k, v, beta, g = (to_chunks(x, ci, size) for x in (stages.k, inputs["v"][0].double(),
                                                      inputs["beta"][0].double(), inputs["g"][0].double()))
    g_cum = chunk_local_cumsum(g)  # padding (g = 0) holds the last token's value, as the kernels' chunks do
    assert_max_rel(from_chunks(g_cum, ci, 100), stages.g_cum, 1e-15, "g_cum")
    w, u = wy_representation(ut_transform(k, beta, g_cum), k, v, beta, g_cum)
    hv = k.shape[1]
    eye = torch.eye(DK, dtype=F64).expand(1, hv, DK, DK)
    m_walk = chunk_state_pass(k, w, torch.zeros_like(u), g_cum, ci, 1, eye)[2][0]
    e_walk = chunk_state_pass(k, w, u, g_cum, ci, 1, torch.zeros(1, hv, DK, DK, dtype=F64))[2][0]
    t, b = chunk_affine_maps(k, w, u, g_cum)
    m, e = compose_maps(t, b)
    assert len(ci) == 7
    assert_max_rel(m, m_walk, 1e-12, "M by the tree")
    assert_max_rel(e, e_walk, 1e-12, "E by the tree")

    h0 = inputs["initial_state"][0].double()
    (m1, e1), (m2, e2) = compose_maps(t[:3], b[:3]), compose_maps(t[3:], b[3:])
    final_walk = chunk_state_pass(k, w, u, g_cum, ci, 1, h0[None])[2][0]
    assert_max_rel(m2 @ (m1 @ h0 + e1) + e2, final_walk, 1e-12, "two segments merged")

    m32, e32 = compose_maps(*(x.float() for x in chunk_affine_maps(k.float(), w.float(), u.float(), g_cum.float())))
    assert_rel_rms(m32, m_walk, 1e-5, "M by the tree in fp32")
    assert_rel_rms(e32, e_walk, 1e-5, "E by the tree in fp32")
    assert torch.equal(compose_maps(t[:1], b[:1])[0], t[0]), "one chunk: its own map"
    with pytest.raises(ValueError, match="at least one chunk"):
        compose_maps(t[:0], b[:0])


def _chunked_steps(tokens: int, size: int, beta: torch.Tensor, g: torch.Tensor, *, keys_rank: int | None = None,
                   l2: bool = True, seed: int = 5):
    """One document's chunked stage inputs in float64, one qk head and ``beta.shape[-1]`` value heads of
    K = V = 16: ``(k, w, u, g_cum, h0)`` in chunks; keys in a ``keys_rank``-dimensional subspace if given."""
    gen = torch.Generator().manual_seed(seed)
    hv = beta.shape[-1]
    q, k = (torch.randn(1, tokens, 1, 16, generator=gen, dtype=F64) for _ in range(2))
    if keys_rank:
        k = torch.randn(1, tokens, 1, keys_rank, generator=gen, dtype=F64) @ torch.randn(keys_rank, 16, generator=gen,
                                                                                             dtype=F64)
    v = torch.randn(1, tokens, hv, 16, generator=gen, dtype=F64)
    st = chunk_gdn_stages(q, k, v, g, beta, scale=0.25, use_qk_l2norm_in_kernel=l2, cu_seqlens=[0, tokens],
                          chunk_size=size, compute_dtype=F64)
    ci = st.chunk_indices
    kc, vc, bc, gc = (to_chunks(x, ci, size) for x in (st.k, v[0], beta[0].double(), g[0].double()))
    g_cum = chunk_local_cumsum(gc)
    w, u = wy_representation(ut_transform(kc, bc, g_cum), kc, vc, bc, g_cum)
    return kc, w, u, g_cum, torch.randn(1, hv, 16, 16, generator=gen, dtype=F64), ci


def test_a_chunk_transition_is_at_most_its_decay_with_unit_keys():
    """The warm-up cut's premise (`dsfuse.gdn.chunk_maps.warmup_starts`): with the L2 norm on and
    0 <= beta <= 2, each chunk's transition ``T`` (`chunk_affine_maps`) has spectral norm at most
    ``exp(G_last)``, whatever the keys; with beta above 2 or keys not normalised, not."""
    from dsfuse.gdn.chunk_maps import chunk_affine_maps

    tokens, size = 160, 16
    gen = torch.Generator().manual_seed(2)
    beta = torch.rand(1, tokens, 3, generator=gen, dtype=F64) * 2
    beta[0, ::7] = 2.0  # the edge, and zero
    beta[0, 3::11] = 0.0
    g = -torch.rand(1, tokens, 3, generator=gen, dtype=F64) * torch.tensor([1e-3, 1e-1, 1.0], dtype=F64)

    def excess(**kw):  # the largest ||T|| / exp(G_last) over every chunk and head
        k, w, u, g_cum = _chunked_steps(tokens, size, kw.pop("beta", beta), g, **kw)[:4]
        t, _ = chunk_affine_maps(k, w, u, g_cum)
        return float((torch.linalg.matrix_norm(t, ord=2) / g_cum[..., -1].exp()).max())

    for rank in (None, 3):
        assert excess(keys_rank=rank) <= 1 + 1e-12
    assert excess(beta=beta * 1.5 + 0.1) > 1 + 1e-3  # beta above 2 reverses some direction by more than 1
    assert excess(l2=False) > 1 + 1e-3  # keys of norm about 4: no bound


@pytest.mark.parametrize("keys_rank", [None, 3])
def test_a_warm_up_cut_by_the_bound_misses_the_state_by_at_most_the_bound(keys_rank):
    """`warmup_starts`: each segment's warm-up is the shortest run of chunks before it that decays by
    at most the bound (or the document's start); a float64 walk from zero over it misses the true
    state by at most ``exp(its decay) ||S_w||`` (the state at its start), and from the document's
    start with its initial state not at all. A loose bound (1e-2) so that the cut is visible."""
    from dsfuse.gdn.chunk_maps import warmup_starts

    tokens, size = 640, 16
    gen = torch.Generator().manual_seed(4)
    beta = torch.rand(1, tokens, 3, generator=gen, dtype=F64)
    g = -torch.rand(1, tokens, 3, generator=gen, dtype=F64) * torch.tensor([2e-3, 3e-2, 0.3], dtype=F64)
    k, w, u, g_cum, h0, ci = _chunked_steps(tokens, size, beta, g, keys_rank=keys_rank)
    h = chunk_state_pass(k, w, u, g_cum, ci, 1, h0)[0]  # [NC, HV, K, V]: the true state at each chunk's start
    decay = g_cum[..., -1]
    starts, log_bound = [3, 10, 17, 25, 39], math.log(1e-2)
    first = warmup_starts(decay, starts, log_bound)
    assert first.shape == (len(starts), 3)
    cut = 0
    for i, s in enumerate(starts):
        for j in range(3):
            wj = int(first[i, j])
            run = float(decay[wj:s, j].sum())
            if wj > 0:  # the shortest qualifying run: one chunk fewer decays by more than the bound
                assert run <= log_bound and float(decay[wj + 1:s, j].sum()) > log_bound, (s, j, wj)
            else:
                assert float(decay[1:s, j].sum()) > log_bound, (s, j)  # no shorter run qualifies
            start = h0[0, j] if wj == 0 else torch.zeros_like(h0[0, j])
            sl = slice(wj, s)
            got = chunk_state_pass(k[sl, j:j + 1], w[sl, j:j + 1], u[sl, j:j + 1], g_cum[sl, j:j + 1],
                                   ci[sl], 1, start[None, None])[2][0, 0]
            miss = float((got - h[s, j]).norm())
            if wj == 0:
                assert miss <= 1e-12 * float(h[s, j].norm()), (s, j, miss)
            else:
                cut += 1
                assert miss <= math.exp(run) * float(h[wj, j].norm()) * (1 + 1e-9), (s, j, miss)
                assert miss > 0
    assert cut >= 5  # the slower heads' long runs and the fast head's short ones both occur
    assert (first[:, 2] > 0).all() and (first[:, 0] == 0).any()
    with pytest.raises(ValueError, match="at most 0"):
        warmup_starts(-decay, starts)
    with pytest.raises(ValueError, match="segment starts"):
        warmup_starts(decay, [-1])


# ----------------------------------------------------------------------------- helpers and errors


def test_chunk_indices_offsets_and_documents():
    cu = torch.tensor([0, 1, 46, 46, 176], dtype=torch.int32)
    want = [[0, 0, 1], [1, 1, 46], [3, 46, 110], [3, 110, 174], [3, 174, 176]]
    assert prepare_chunk_indices(cu, 64).tolist() == want
    assert prepare_chunk_indices(cu, 64).dtype == torch.int64
    assert prepare_chunk_offsets(cu, 64).tolist() == [0, 1, 2, 2, 5]
    assert prepare_chunk_indices([0, 0], 64).shape == (0, 3)
    x = torch.arange(180)
    assert [d.tolist() for d in split_by_documents(x, cu)][:3] == [[0], list(range(1, 46)), []]
    assert split_by_documents(x, cu)[3].tolist() == list(range(46, 176))


def test_to_chunks_pads_with_zeros_and_round_trips():
    ci = prepare_chunk_indices([0, 1, 46, 46, 176], 64)
    x = torch.randn(180, 3, 5, dtype=F64) + 1  # nonzero everywhere
    xc = to_chunks(x, ci, 64)
    assert xc.shape == (5, 3, 64, 5)
    assert (xc[0, :, 1:] == 0).all() and (xc[0, :, :1] != 0).all()
    assert (xc[4, :, 2:] == 0).all() and (xc[4, :, :2] != 0).all() and (xc[3] != 0).all()
    back = from_chunks(xc, ci, 180)
    assert torch.equal(back[:176], x[:176]) and (back[176:] == 0).all()


def test_bad_arguments_raise_value_error():
    inputs, _, _ = make_inputs("batch2_T100", (2, 4))
    for fn in (naive_recurrent_gdn, chunk_gdn_reference):
        with pytest.raises(ValueError, match="batch size 1.*batch size 2"):
            fn(**{**inputs, "cu_seqlens": [0, 50, 100]})
        with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
            fn(**{**inputs, "q": inputs["q"][:1], "k": inputs["k"][:1], "cu_seqlens": [0, 60, 50]})
        with pytest.raises(ValueError, match="HV = 4 must be a multiple of the qk heads H = 3"):
            fn(**{**inputs, "q": inputs["q"][:, :, :1].expand(-1, -1, 3, -1),
                  "k": inputs["k"][:, :, :1].expand(-1, -1, 3, -1)})


def test_model_head_dim_128():
    """The model's head dim (K = V = 128), two documents of 70 and 1 tokens, fp64, with gradients."""
    inputs, do, dht = make_inputs((1, 72, [0, 70, 71]), (1, 3), seed=13, dk=128, dv=128)
    kw = {"use_qk_l2norm_in_kernel": True}
    o, final, grads = forward_and_grads(chunk_gdn_reference, inputs, do, dht, F64, **kw)
    want_o, want_final, want = forward_and_grads(naive_recurrent_gdn, inputs, do, dht, F64, **kw)
    assert_max_rel(o, want_o, 1e-10, "o")
    assert_max_rel(final, want_final, 1e-10, "final state")
    for name in want:
        assert_max_rel(grads[name], want[name], 1e-10, f"d{name}")
