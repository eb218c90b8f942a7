"""The CuTe DSL fused forward (``dsfuse.gdn.cutedsl.fused_fwd``), second step of the planned fused
forward: its per-chunk formulas against the chunked reference (CPU, float64), its compilation for
sm_90a and sm_100a (CPU), and on a GPU its outputs and final states against the float64 reference
with varlen documents (empty, one token, partial chunks), grouped value heads, an initial state and
a tail of tokens in no document, bitwise run to run."""

import itertools

import pytest
import torch
from conftest import cutedsl_or_skip
from dsfuse.gdn.reference import (
    CHUNK_SIZE,
    L2NORM_EPS,
    chunk_gdn_reference,
    decay_matrix,
    l2norm,
    prepare_chunk_indices,
    to_chunks,
    ut_transform,
)
from helpers import assert_rel_rms
from hypothesis import given, settings
from hypothesis import strategies as st

F64 = torch.float64
LENGTHS = [1, 63, 0, 64, 65, 200]  # an empty document among them


def _inputs(t, h, hv, dk, dv, dtype, device, seed=0, l2=True):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device)

    q, k = randn(t, h, dk), randn(t, h, dk)
    if not l2:
        q, k = l2norm(q) * 0.9, l2norm(k) * 0.9  # keep the unnormalised system well conditioned
    v = randn(t, hv, dv)
    g = -torch.rand(t, hv, generator=gen, device=device) * 0.3
    beta = torch.rand(t, hv, generator=gen, device=device)
    n = len(LENGTHS)
    h0 = randn(n, hv, dk, dv) * 0.1
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), h0


def _bounds():
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    return cu


def _exact(x):
    return x


def _to_bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


def _fused_in_float64(q, k, v, g, beta, scale, h0, cu, l2, rnd=_exact, fold=False):
    """The kernels' per-chunk formulas, written with torch in float64 (their arithmetic order aside).
    ``rnd`` is applied where the tensor-core forms round an operand to the input dtype (`_to_bf16`
    emulates it; the identity gives the first form's exact formulas). With the L2 norm, the
    tensor-core form normalises q and k and rounds them; the per-head form (``fold``) keeps them as
    read and multiplies the products' rows and columns (and the decayed ``v_new``) by the scales."""
    group = v.shape[1] // q.shape[1]
    rq = rk = torch.ones_like(q[..., :1])  # the scales the products take (exactly 1: no effect)
    if l2 and fold:
        rq, rk = (((x * x).sum(-1, keepdim=True) + L2NORM_EPS).rsqrt() for x in (q, k))
    elif l2:
        q, k = rnd(l2norm(q)), rnd(l2norm(k))
    q, k, rq, rk = (x.repeat_interleave(group, 1) for x in (q, k, rq, rk))
    ci = prepare_chunk_indices(cu)
    qc, kc, vc, gc, bc, rqc, rkc = (to_chunks(x, ci) for x in (q, k, v, g, beta, rq, rk))
    G = gc.cumsum(-1)  # [NC, HV, C]
    a0 = ut_transform(kc * rkc, bc, torch.zeros_like(G))  # the inverse normalises k itself
    gamma = decay_matrix(G, include_diagonal=True)
    states = list(h0.unbind(0))
    o = torch.zeros_like(v)
    for c, (n, start, end) in enumerate(ci.tolist()):
        s = states[n]  # [HV, K, V]
        s_op = rnd(s)
        e = G[c].exp()[..., None]  # [HV, C, 1]
        x = rnd(bc[c][..., None] * (vc[c] - e * rkc[c] * (kc[c] @ s_op)))
        v_new = rnd(a0[c] * gamma[c]) @ x
        qk = (qc[c] @ kc[c].transpose(-1, -2)) * rqc[c] * rkc[c].transpose(-1, -2)
        intra = rnd(qk * gamma[c]) @ rnd(v_new)
        oc = scale * (e * rqc[c] * (qc[c] @ s_op) + intra)
        o[start:end] = oc[:, : end - start].transpose(0, 1)
        last = G[c][:, -1]
        dec = (last[:, None] - G[c]).exp()[..., None]
        states[n] = last.exp()[:, None, None] * s + kc[c].transpose(-1, -2) @ rnd(dec * rkc[c] * v_new)
    return o, torch.stack(states)


@pytest.mark.parametrize(("l2", "fold"), [(True, False), (True, True), (False, False)])
def test_the_formulas_match_the_chunked_reference(l2, fold):
    """The ungated inverse times the decays, ``X = beta (v - e^G k S)`` and the rest, the L2 norm's
    scales applied to q and k or to the products (float64, CPU)."""
    t, h, hv, dk, dv = _bounds()[-1] + 5, 2, 4, 32, 16
    q, k, v, g, beta, h0 = (x.to(F64) for x in _inputs(t, h, hv, dk, dv, F64, "cpu", l2=l2))
    cu = _bounds()
    o, ht = _fused_in_float64(q, k, v, g, beta, dk**-0.5, h0, cu, l2, fold=fold)
    o_ref, ht_ref = chunk_gdn_reference(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
                                        output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(o, o_ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("l2", "fold"), [(True, False), (True, True), (False, False)])
def test_the_tensor_core_forms_roundings_keep_the_contract(l2, fold):
    """Where the tensor-core forms round operands to bf16 (emulated in float64 at the GPU test's
    largest shape, bf16 inputs): o (rounded to bf16) and the final states within the op's contract,
    0.005 relative RMS against float64 (with the L2 norm about 0.004 and 0.0024 where q and k are
    normalised and rounded, the tensor-core form; about 0.0033 and 0.0020 where the scales go to the
    products, the per-head form; o's own rounding alone is about 0.0017), the bound the GPU test
    applies to the kernels."""
    from dsfuse.bench.gdn import TOLERANCES

    cu = _bounds()
    t, h, hv, dk, dv = cu[-1] + 7, 16, 48, 128, 128
    q, k, v, g, beta, h0 = _inputs(t, h, hv, dk, dv, torch.bfloat16, "cpu", seed=1, l2=l2)
    q, k, v, g, beta = (x.to(F64) for x in (q, k, v, g, beta))
    o, ht = _fused_in_float64(q, k, v, g, beta, dk**-0.5, h0.to(F64), cu, l2, rnd=_to_bf16, fold=fold)
    o_ref, ht_ref = chunk_gdn_reference(q[None], k[None], v[None], g[None], beta[None], initial_state=h0.to(F64),
                                        output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
    assert_rel_rms(_to_bf16(o), o_ref[0], TOLERANCES["o"], "o")
    assert_rel_rms(ht, ht_ref, TOLERANCES["final_state"], "final state")


def test_refuses_what_it_cannot_compile():
    """The AOT specs (compiled by ``test_gdn_cutedsl_compile.py``) are the model's; other sizes are refused by name."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import fused_fwd as module

    assert [s.name for s in module.AOT_SPECS] == ["gdn_fused_forward_bf16_l2", "gdn_fused_forward_bf16",
                                                  "gdn_fused_forward_tc_bf16_l2", "gdn_fused_forward_tc_bf16",
                                                  "gdn_fused_forward_head_bf16_l2", "gdn_fused_forward_head_bf16",
                                                  "gdn_fused_forward_head_gated_bf16_l2",
                                                  "gdn_fused_forward_head_gated_bf16",
                                                  "gdn_fused_forward_head_wgmma_bf16_l2",
                                                  "gdn_fused_forward_head_wgmma_bf16",
                                                  "gdn_fused_forward_head_wgmma_gated_bf16_l2",
                                                  "gdn_fused_forward_head_wgmma_gated_bf16",
                                                  "gdn_fused_forward_head_ws_gated_bf16_l2",
                                                  "gdn_fused_forward_head_ws_gated_bf16",
                                                  "gdn_fused_forward_head_rs_gated_bf16_l2",
                                                  "gdn_fused_forward_head_rs_gated_bf16",
                                                  "gdn_fused_forward_head_rs_gated_states_bf16_l2",
                                                  "gdn_fused_forward_head_rs_gated_states_bf16",
                                                  "gdn_fused_forward_head_ws_gated_parts2_bf16_l2",
                                                  "gdn_fused_forward_head_ws_gated_parts2_bf16",
                                                  "gdn_fused_forward_head_ws_gated_states_parts2_bf16_l2",
                                                  "gdn_fused_forward_head_ws_gated_states_parts2_bf16"]
    assert [s.archs for s in module.AOT_SPECS][-14:] == [("sm_90a",)] * 14  # wgmma: Hopper's instruction
    with pytest.raises(ValueError, match="saves the states in the forms"):
        module.compile_fused_forward(torch.bfloat16, 16, 48, 128, 128, True, "sm_90a", form="head", gated=True,
                                     save=True)
    with pytest.raises(ValueError, match="reads a gated A in the forms"):
        module.compile_fused_forward(torch.bfloat16, 16, 48, 128, 128, True, "sm_90a", form="tensor_core", gated=True)
    with pytest.raises(ValueError, match="head_ws form reads the preparing inverse's gated A: gated only"):
        module.compile_fused_forward(torch.bfloat16, 16, 48, 128, 128, True, "sm_90a", form="head_ws")
    with pytest.raises(ValueError, match="head_wgmma form compiles for"):
        module.compile_fused_forward(torch.bfloat16, 16, 48, 128, 128, True, "sm_100a", form="head_wgmma")
    assert module.shape_reasons(torch.bfloat16, 16, 48, 128, 128) == []
    reasons = module.shape_reasons(torch.int8, 16, 40, 96, 48)
    assert len(reasons) == 4 and "V = 48" in reasons[3]
    with pytest.raises(ValueError, match="cannot compile this"):
        module.compile_fused_forward(torch.bfloat16, 16, 48, 128, 100, False, "sm_90a")
    assert "tensor_core form" in module.shape_reasons(torch.float32, 16, 48, 128, 128, form="tensor_core")[0]
    assert module.shape_reasons(torch.bfloat16, 16, 48, 128, 128, form="head") == []
    reasons = module.shape_reasons(torch.bfloat16, 16, 48, 32, 160, form="head")
    assert len(reasons) == 2 and "K = 64 or 128, not 32" in reasons[0] and "V = 64 or 128, not 160" in reasons[1]
    assert "V = 64 or 128, not 96" in module.shape_reasons(torch.bfloat16, 4, 4, 128, 96, form="head")[0]
    assert module.shape_reasons(torch.float16, 16, 48, 128, 128, form="head") == []
    assert "fp16 only without the L2 norm" in module.shape_reasons(torch.float16, 16, 48, 128, 128, form="head",
                                                                   use_qk_l2norm=True)[0]
    with pytest.raises(ValueError, match="fp16 only without the L2 norm"):
        module.compile_fused_forward(torch.float16, 16, 48, 128, 128, True, "sm_90a", form="head")
    with pytest.raises(ValueError, match="form is one of"):
        module.shape_reasons(torch.bfloat16, 16, 48, 128, 128, form="tc")


def test_the_wgmma_form_fences_its_writes_before_its_products(tmp_path):
    """The ``head_wgmma`` form's PTX (sm_90a, CPU): per chunk 8 ``q k^T`` wgmma (m64n16), 24 for the
    C x V products (m64n32) and 4 for the state update (m64n64), no ``mma.sync`` or ``ldmatrix``, and
    exactly three ``fence.proxy.async``, each right before a CTA barrier (steps 1, 4 and 5: the
    writes the next products read); the ``head`` form has neither."""
    import collections
    import re

    from helpers import cute_spec_ptx

    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import fused_fwd as module

    specs = {spec.name: spec for spec in module.AOT_SPECS}
    ptx = cute_spec_ptx(specs["gdn_fused_forward_head_wgmma_bf16_l2"], "sm_90a", tmp_path)
    shapes = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    assert shapes == {"m64n16k16": 8, "m64n32k16": 24, "m64n64k16": 4}
    assert "mma.sync" not in ptx and "ldmatrix" not in ptx
    lines = [line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith("//")]
    fences = [i for i, line in enumerate(lines) if line.startswith("fence.proxy.async")]
    assert len(fences) == 3 and all(lines[i + 1].startswith("bar.sync") for i in fences), [lines[i + 1] for i in fences]
    head = cute_spec_ptx(specs["gdn_fused_forward_head_bf16_l2"], "sm_90a", tmp_path)
    assert "fence.proxy.async" not in head and "wgmma" not in head


def test_the_role_split_form_meets_at_named_barriers(tmp_path):
    """The ``head_ws`` form's PTX (sm_90a, CPU), every spec: the same 36 wgmma a chunk as ``head_wgmma``
    (16 by the state team, 20 by the output team, each on two warpgroups: m64n64 for the C x V
    products, m64n32 for q k^T, m64n128 for the state update; on halves of the value channels
    m64n32 and m64n64 for the C x V products and the update), the teams' registers set by
    ``setmaxnreg``, and each team's barriers in the order the protocol needs (module docstring of
    `dsfuse.gdn.cutedsl.fused_fwd_ws`): named barriers only (none is the CTA's), the state team's
    three a chunk, its arrivals (3, 5) with its writes fenced for the tensor cores before them (3
    after its own barrier, 5 after its wait at 6), and it alone waiting at 4 and 6; the output team
    waiting at 3 and 5 and arriving at 4 and 6."""
    import collections
    import re

    from helpers import cute_spec_ptx

    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import fused_fwd as module
    from dsfuse.gdn.cutedsl.fused_fwd_ws import OUTPUT_REGS, STATE_REGS

    def barriers(text):
        return ["fence" if m.group(1) else f"{m.group(2)} {m.group(3)}"
                for m in re.finditer(r"(fence\.proxy\.async)|bar\.(sync|arrive)\s+(\d+)", text)]

    state_chunk = ["sync 4", "fence", "sync 1", "arrive 3", "fence", "sync 1", "fence", "sync 1", "sync 6", "fence",
                   "arrive 5"]
    output_chunk = ["sync 3", "arrive 4", "fence", "sync 2", "sync 5", "arrive 6", "sync 2"]
    specs = [spec for spec in module.AOT_SPECS if "_head_ws" in spec.name]
    assert len(specs) == 6  # whole value heads, and halves (`COLUMN_PARTS`: V = 64 a CTA, n halved)
    for spec in specs:
        ptx = cute_spec_ptx(spec, "sm_90a", tmp_path)
        shapes = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
        want = ({"m64n32k16": 32, "m64n64k16": 4} if "_parts2" in spec.name
                else {"m64n32k16": 8, "m64n64k16": 24, "m64n128k16": 4})
        assert shapes == want, (spec.name, shapes)
        assert len(re.findall(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{STATE_REGS};", ptx)) == 1
        assert len(re.findall(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{OUTPUT_REGS};", ptx)) == 1
        assert re.findall(r"bar\.(?:sync|arrive)\s+\d+,\s*(\d+);", ptx).count("512") == 8  # 4 arrivals, 4 waits
        state, output = ptx.split("setmaxnreg.dec")
        assert barriers(state) == state_chunk, (spec.name, barriers(state))
        assert barriers(output) == output_chunk, (spec.name, barriers(output))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("dims", [(2, 6, 64, 64), (16, 48, 128, 128), (2, 4, 128, 64), (2, 4, 64, 128),
                                  (1, 5, 64, 64), (2, 16, 128, 128)])
def test_the_role_split_form_gives_the_same_bits(dtype, l2, dims):
    """``head_ws`` (with the preparing inverse, as `chunk_gdn` launches it) and ``head_wgmma`` (gated and
    not) on the same inputs (varlen with an empty and a one-token document, an initial state): o and
    the final states bitwise equal, and repeated calls too. The products are split over two
    warpgroups instead of four (the same instructions' sums for every element, an assumption about
    the tensor cores this checks), and the rows' factors and ``round(A)`` are the inverse's, made
    by the same formulas on the same values. Value heads per qk head 1 to 8 (the inverse in one
    pass or two); fp16 without the L2 norm (the forms refuse it with)."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    if dtype == torch.float16 and l2:
        pytest.skip("the per-head forms take fp16 only without the L2 norm (test_refuses_what_it_cannot_compile)")
    from dsfuse.gdn.cutedsl.fused_fwd import fused_forward

    h, hv, dk, dv = dims
    cu = _bounds()
    q, k, v, g, beta, h0 = _inputs(cu[-1] + CHUNK_TAIL, h, hv, dk, dv, dtype, "cuda", seed=5, l2=l2)
    args = {"initial_state": h0, "cu_seqlens": cu, "use_qk_l2norm": l2}
    runs = [fused_forward(q, k, v, g, beta, form=form, gated=gated, **args)[:2]
            for form, gated in (("head_wgmma", False), ("head_wgmma", True), ("head_ws", True), ("head_ws", True))]
    torch.cuda.synchronize()
    (o0, ht0), (o1, ht1), (o2, ht2), (o3, ht3) = runs
    assert not o2.isnan().any() and not ht2.isnan().any()
    assert torch.equal(o2, o3) and torch.equal(ht2, ht3)
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    assert torch.equal(o0, o2) and torch.equal(ht0, ht2)



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("dims", [(16, 48, 128, 128), (2, 4, 64, 128), (2, 16, 128, 128), (1, 5, 128, 128)])
def test_the_transposed_state_form_gives_the_same_bits(dtype, l2, dims):
    """``head_rs`` (the state kept transposed, the state chain's A operands in registers) and
    ``head_ws`` on the same inputs (varlen with an empty and a one-token document, an initial
    state): o and the final states bitwise equal, and a repeated call too. The same products of the
    same rounded values, each operand in the other role: an assumption about the tensor cores'
    sums this checks. V = 128 only (the form's two warpgroups own 64 value channels each)."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    if dtype == torch.float16 and l2:
        pytest.skip("the per-head forms take fp16 only without the L2 norm (test_refuses_what_it_cannot_compile)")
    from dsfuse.gdn.cutedsl.fused_fwd import fused_forward

    h, hv, dk, dv = dims
    cu = _bounds()
    q, k, v, g, beta, h0 = _inputs(cu[-1] + CHUNK_TAIL, h, hv, dk, dv, dtype, "cuda", seed=7, l2=l2)
    args = {"initial_state": h0, "cu_seqlens": cu, "use_qk_l2norm": l2}
    runs = [fused_forward(q, k, v, g, beta, form=form, gated=True, **args)[:2]
            for form in ("head_ws", "head_rs", "head_rs")]
    torch.cuda.synchronize()
    (o0, ht0), (o1, ht1), (o2, ht2) = runs
    assert not o1.isnan().any() and not ht1.isnan().any()
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    assert torch.equal(o0, o1) and torch.equal(ht0, ht1)


def test_the_transposed_state_form_meets_at_named_barriers(tmp_path):
    """The ``head_rs`` form's PTX (sm_90a, CPU), every spec: ``head_ws``'s 36 wgmma a chunk, the state
    team's 16 taking A from registers, and its barriers: one of its own a chunk (the chunk's rows
    landed), the teams' four named barriers as in ``head_ws`` (each arrival after its writes are
    fenced); the output team's unchanged. V other than 128 refused by name."""
    import collections
    import re

    from helpers import cute_spec_ptx

    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import fused_fwd as module

    def barriers(text):
        return ["fence" if m.group(1) else f"{m.group(2)} {m.group(3)}"
                for m in re.finditer(r"(fence\.proxy\.async)|bar\.(sync|arrive)\s+(\d+)", text)]

    specs = [spec for spec in module.AOT_SPECS if "_head_rs" in spec.name]
    assert len(specs) == 4  # with and without the L2 norm, saving the states and not
    stores = {}
    for spec in specs:
        ptx = cute_spec_ptx(spec, "sm_90a", tmp_path)
        shapes = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
        assert shapes == {"m64n32k16": 8, "m64n64k16": 24, "m64n128k16": 4}, (spec.name, shapes)
        assert len(re.findall(r"wgmma\.mma_async[^;]*\{[^}]*\}, \{", ptx)) == 16  # A as registers
        state, output = ptx.split("setmaxnreg.dec")
        assert barriers(state) == ["fence", "sync 1", "sync 4", "fence", "arrive 3", "sync 6", "fence", "arrive 5"]
        assert barriers(output) == ["sync 3", "arrive 4", "fence", "sync 2", "sync 5", "arrive 6", "sync 2"]
        assert "ld.local" not in ptx and "st.local" not in ptx, spec.name  # no stack
        stores[spec.name] = len(re.findall(r"st\.global\.v4\.b32", output))
    for name, count in stores.items():  # saving adds the states' 16-byte stores to the output team's o
        if "_states" in name:
            assert count > stores[name.replace("_states", "")], stores
    with pytest.raises(ValueError, match="head_rs form takes V = 128"):
        module.compile_fused_forward(torch.bfloat16, 2, 4, 64, 64, False, "sm_90a", form="head_rs", gated=True)

@pytest.mark.gpu
@pytest.mark.parametrize("form", ["head_ws", "head_rs"])
@pytest.mark.parametrize("dtype, l2", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, False)])
def test_the_saved_states_are_the_chains_own(form, dtype, l2):
    """A prepared form saving its states (varlen with an empty and a one-token document, an initial
    state, grouped value heads): chunk ``j`` of a document holds ``round(S)`` of that document's
    first ``j`` chunks, bit for bit the final state of a run on those chunks alone (the documents cut
    there, packed), rounded; every chunk written; o and the final states the bits of a run that does
    not save; a repeated call the same bits."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prepared forms (wgmma) run on sm_90 only")
    from dsfuse.gdn.cutedsl.fused_fwd import fused_forward

    h, hv, dk, dv = 2, 4, 128, 128
    cu = _bounds()
    q, k, v, g, beta, h0 = _inputs(cu[-1] + CHUNK_TAIL, h, hv, dk, dv, dtype, "cuda", seed=11, l2=l2)
    args = {"initial_state": h0, "use_qk_l2norm": l2, "form": form, "gated": True}
    ci = prepare_chunk_indices(cu).tolist()

    def saved():
        states = torch.full((len(ci), dk, hv, dv), float("nan"), device="cuda", dtype=dtype)
        return fused_forward(q, k, v, g, beta, cu_seqlens=cu, states=states, **args)[:2], states

    (o, ht), states = saved()
    (o_again, ht_again), states_again = saved()
    o_plain, ht_plain, _ = fused_forward(q, k, v, g, beta, cu_seqlens=cu, **args)
    torch.cuda.synchronize()
    assert not states.isnan().any()
    assert torch.equal(states, states_again) and torch.equal(o, o_again) and torch.equal(ht, ht_again)
    assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain)
    compared = 0
    for j in range(max(-(-n // CHUNK_SIZE) for n in LENGTHS)):  # the documents cut after j chunks, packed
        cut = [min(n, j * CHUNK_SIZE) for n in LENGTHS]
        rows = torch.cat([torch.arange(cu[d], cu[d] + cut[d]) for d in range(len(LENGTHS))]).cuda()
        bounds = [0] + list(itertools.accumulate(cut))
        ht_cut = (fused_forward(q[rows], k[rows], v[rows], g[rows], beta[rows], cu_seqlens=bounds, **args)[1]
                  if j else h0)  # no chunk yet: the initial state
        for c, (d, start, _) in enumerate(ci):
            if start - cu[d] == j * CHUNK_SIZE:  # chunk j of document d: the state after its first j chunks
                assert torch.equal(states[c].transpose(0, 1), ht_cut[d].to(dtype)), (j, d)
                compared += 1
    assert compared == len(ci)


def _run_on_gpu(dtype, l2, dims, form):
    """``(o, ht, o_ref, ht_ref, cu)``: the fused forward on strided head views of one packed row (a
    second call bitwise equal, the tail's o zero, nothing left unwritten) and the float64 reference
    on the same rounded inputs."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.fused_fwd import fused_forward

    h, hv, dk, dv = dims
    cu = _bounds()
    t = cu[-1] + 7  # 7 tokens in no document
    q, k, v, g, beta, h0 = _inputs(t, h, hv, dk, dv, dtype, "cuda", seed=1, l2=l2)
    row = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)  # the packed row: strided views
    q, k, v = row[:, : h * dk].view(t, h, dk), row[:, h * dk: 2 * h * dk].view(t, h, dk), row[:, 2 * h * dk:].view(t, hv, dv)
    args = {"initial_state": h0, "cu_seqlens": cu, "use_qk_l2norm": l2, "form": form}
    o, ht, _ = fused_forward(q, k, v, g, beta, **args)
    o2, ht2, _ = fused_forward(q, k, v, g, beta, **args)
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    assert not o.isnan().any() and not ht.isnan().any() and (o[cu[-1]:] == 0).all()
    o_ref, ht_ref = chunk_gdn_reference(*(x.to(F64).cpu()[None] for x in (q, k, v, g, beta)),
                                        initial_state=h0.to(F64).cpu(), output_final_state=True, cu_seqlens=cu,
                                        use_qk_l2norm_in_kernel=l2)
    return o.to(F64).cpu(), ht.to(F64).cpu(), o_ref[0], ht_ref, cu


DIMS = [(2, 6, 64, 64), (16, 48, 128, 128), (4, 4, 128, 96), (2, 6, 64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("dims", DIMS)
def test_matches_the_float64_reference(dtype, l2, dims):
    """The first form (fp32 arithmetic) against float64: relative RMS per document and value head
    <= 1e-4 for the states and an fp32 o, 6e-3 for a bf16 o (its rounding)."""
    o, ht, o_ref, ht_ref, cu = _run_on_gpu(dtype, l2, dims, "cuda_core")
    o_tol = 6e-3 if dtype == torch.bfloat16 else 1e-4
    for n, (bos, eos) in enumerate(itertools.pairwise(cu)):
        for i_hv in range(dims[1]):
            assert_rel_rms(ht[n, i_hv], ht_ref[n, i_hv], 1e-4, f"final state, document {n}, head {i_hv}")
            if eos > bos:
                assert_rel_rms(o[bos:eos, i_hv], o_ref[bos:eos, i_hv], o_tol, f"o, document {n}, head {i_hv}")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["tensor_core", "head", "head_wgmma", "head_ws", "head_rs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("dims", DIMS)
def test_tensor_core_forms_match_the_float64_reference(form, dtype, l2, dims):
    """The tensor-core forms (operands rounded to the input dtype) against float64 within the op's
    contract: relative RMS of o and of the final states <= 0.005 (``dsfuse.bench.gdn.TOLERANCES``)."""
    from dsfuse.bench.gdn import TOLERANCES

    if form in ("head_wgmma", "head_ws", "head_rs") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    if form == "head_rs" and dims[3] != 128:
        pytest.skip("the head_rs form takes V = 128 (test_the_transposed_state_form_meets_at_named_barriers)")
    if form.startswith("head") and dims[3] not in (64, 128):
        pytest.skip("the per-head form takes V = 64 or 128 (test_refuses_what_it_cannot_compile)")
    if form.startswith("head") and dtype == torch.float16 and l2:
        with pytest.raises(ValueError, match="fp16 only without the L2 norm"):  # refused before any launch
            _run_on_gpu(dtype, l2, dims, form)
        return
    o, ht, o_ref, ht_ref, _ = _run_on_gpu(dtype, l2, dims, form)
    assert_rel_rms(o, o_ref, TOLERANCES["o"], "o")
    assert_rel_rms(ht, ht_ref, TOLERANCES["final_state"], "final state")


def test_the_per_head_form_refuses_rows_it_cannot_copy_in_16_bytes():
    """The per-head form reads q, k, v rows with 16-byte copies: a view whose base or token stride is
    not a multiple of 16 bytes is refused by name before any launch (the other forms take it)."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward
    from dsfuse.gdn.cutedsl.fused_fwd_head import aligned_reasons

    t, h, d = 70, 2, 64
    row = torch.zeros(t, 3 * h * d + 4, dtype=torch.bfloat16)  # 4 extra channels: an 8-byte token stride step
    q, k, v = (row[:, i * h * d:(i + 1) * h * d].view(t, h, d) for i in range(3))
    assert aligned_reasons(q=q, k=k, v=v) and all("16-byte aligned" in r for r in aligned_reasons(q=q))
    shifted = row[:, 4:4 + h * d].view(t, h, d)  # a base 8 bytes past an aligned one
    assert aligned_reasons(q=row[:, : h * d].view(t, h, d).contiguous()) == []
    assert aligned_reasons(s=torch.zeros(t, h + 1, d, dtype=torch.bfloat16)[:, 1:]) == []  # 128-byte head step
    assert len(aligned_reasons(s=shifted)) == 1
    g, beta = torch.zeros(t, h), torch.zeros(t, h, dtype=torch.bfloat16)
    a, o = torch.zeros(t, h, 64), torch.zeros(t, h, d, dtype=torch.bfloat16)
    ci, co, order = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    h0 = torch.zeros(1, h, d, d)
    with pytest.raises(ValueError, match="q needs a 16-byte aligned base"):
        launch_fused_forward(q, k, v, g, beta, a, ci, co, order, h0, h0.clone(), o, 1.0, form="head")
    for bad in (o.float(), o[:-1]):  # o in another dtype or shape than v: refused before the alignment
        with pytest.raises(ValueError, match=r"o must be \[T, HV, V\] in v's dtype"):
            launch_fused_forward(q, k, v, g, beta, a, ci, co, order, h0, h0.clone(), bad, 1.0, form="head")


def _cpu_launch_args():
    """``(t, h, d, (q, k, v, g, beta, a, ci, co, order, h0, o), prepared)``: CPU tensors of a prepared form's
    launch (two chunks, one document), for the checks that refuse before any launch."""
    t, h, d = 70, 2, 64
    q, k, v = (torch.zeros(t, h, d, dtype=torch.bfloat16) for _ in range(3))
    g, beta, a = torch.zeros(t, h), torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, h, 64)
    ci, co, order = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    h0, o = torch.zeros(1, h, d, d), torch.zeros(t, h, d, dtype=torch.bfloat16)
    prepared = {"a_round": torch.zeros(t, h, 64, dtype=torch.bfloat16), "factors": torch.zeros(2 * 8, h, 64)}
    return t, h, d, (q, k, v, g, beta, a, ci, co, order, h0, o), prepared


def test_the_prepared_inputs_are_checked_before_any_launch():
    """The ``head_ws`` form's ``a_round`` and ``factors``: refused by name when missing, given to another
    form, of the wrong shape or dtype, or on another device than v (CPU tensors: no launch)."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward

    t, h, d, (q, k, v, g, beta, a, ci, co, order, h0, o), good = _cpu_launch_args()

    def launch(form="head_ws", g_cum=g, **prepared):
        launch_fused_forward(q, k, v, g, beta, a, ci, co, order, h0, h0.clone(), o, 1.0, form=form, g_cum=g_cum,
                             **prepared)

    with pytest.raises(ValueError, match="with the forms that read them"):
        launch()  # head_ws without them
    with pytest.raises(ValueError, match="with the forms that read them"):
        launch(form="head", **good)
    with pytest.raises(ValueError, match="gated only: pass the preparing inverse's g_cum"):
        launch(g_cum=None, **good)
    for bad, match in (({"a_round": good["a_round"].float()}, "a_round must be contiguous"),
                       ({"a_round": good["a_round"][:-1]}, "a_round must be contiguous"),
                       ({"factors": good["factors"][:-1]}, "factors must be contiguous"),
                       ({"factors": good["factors"].double()}, "factors must be contiguous"),
                       ({"factors": good["factors"].to("meta")}, "factors must be on the inputs' device")):
        with pytest.raises(ValueError, match=match):
            launch(**(good | bad))


def test_the_states_are_checked_before_any_launch():
    """A prepared form's ``states``: refused by name in another shape, dtype or layout, or given to a form
    that does not save them (CPU tensors: no launch)."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward

    t, h, d, (q, k, v, g, beta, a, ci, co, order, h0, o), good = _cpu_launch_args()
    states = torch.zeros(2, d, h, d, dtype=torch.bfloat16)  # [NC, K, HV, V]

    def launch(states, form="head_ws", prepared=good):
        launch_fused_forward(q, k, v, g, beta, a, ci, co, order, h0, h0.clone(), o, 1.0, form=form, g_cum=g,
                             states=states, **prepared)

    for bad in (states[:1], states.float(), states.transpose(1, 2), states.to("meta"),
                torch.zeros(2, h, d, d, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match=r"states must be \[NC, K, HV, V\]"):
            launch(bad)
    strided = torch.zeros(2, d, h, 2 * d, dtype=torch.bfloat16)[..., ::2]  # the right shape, not contiguous
    misaligned = torch.zeros(states.numel() + 1, dtype=torch.bfloat16)[1:].view(states.shape)
    for bad in (strided, misaligned):
        with pytest.raises(ValueError, match="states must be contiguous with a 16-byte aligned base"):
            launch(bad)
    with pytest.raises(ValueError, match="save the states, not 'head'"):
        launch(states, form="head", prepared={})


def test_documents_start_longest_first():
    """The CTAs' document order: by chunk count, longest first, ties in document order (not by tokens:
    65 and 128 tokens are both two chunks)."""
    cutedsl_or_skip()
    from dsfuse.gdn.schedule import document_order

    assert document_order([0, 8847, 11796, 22937, 28836, 32768]) == [2, 0, 3, 4, 1]
    assert document_order([0, 65, 193, 193, 194]) == [0, 1, 3, 2]
    assert document_order([0, 0]) == [0]



BENCH_BOUNDS = [0, 8847, 11796, 22937, 28836, 32768]  # the experiment's five documents: 139, 47, 175, 93, 62 chunks


def test_the_overlap_leads_with_the_longest_documents_where_the_chains_are_latency_bound():
    """`dsfuse.gdn.cutedsl.forward.stages` on the experiment's documents and an H200's 132 SMs: at 32
    value heads (chains bound by the longest one: 516 x 32 chunk steps over 132 SMs are fewer than
    175) the three longest documents lead (their chains on 96 SMs); at 48 (516 x 48 / 132 > 175) none:
    one stage, the inverse then every chain; equal lengths never lead; ``Overlap(0)`` is one stage; a
    lead's chunk rows are its document's, the last stage's the rest (adjacent runs merged)."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.forward import Overlap, stages

    assert stages(BENCH_BOUNDS, 32, 132) == [(0, 1, [(186, 361)]), (1, 2, [(0, 139)]), (2, 3, [(361, 454)]),
                                             (3, 5, [(139, 186), (454, 516)])]
    assert stages(BENCH_BOUNDS, 48, 132) == [(0, 5, [(0, 516)])]
    assert stages(BENCH_BOUNDS, 32, 132, Overlap(0)) == [(0, 5, [(0, 516)])]
    assert stages(BENCH_BOUNDS, 32, 132, Overlap(2, 0.5)) == [(0, 1, [(186, 361)]), (1, 2, [(0, 139)]),
                                                              (2, 5, [(139, 186), (361, 516)])]
    assert stages(BENCH_BOUNDS, 32, 132, Overlap(3, 0.5)) == stages(BENCH_BOUNDS, 32, 132, Overlap(2, 0.5))
    assert stages(BENCH_BOUNDS, 48, 200, Overlap(1)) == [(0, 1, [(186, 361)]), (1, 5, [(0, 186), (361, 516)])]
    assert stages([0, 4097, 8194, 12291], 8, 132) == [(0, 3, [(0, 195)])]  # 65 chunks each
    assert stages([0, 4097, 8194, 8300], 8, 132) == [(0, 1, [(0, 65)]), (1, 2, [(65, 130)]), (2, 3, [(130, 132)])]
    assert stages([0, 5000], 8, 132) == [(0, 1, [(0, 79)])]
    assert not Overlap().eager  # eager calls keep the one pair of launches by default
    for bad in ((-1,), (1, 0.0), (1, 1.5)):
        with pytest.raises(ValueError, match="Overlap"):
            Overlap(*bad)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), min_size=1, max_size=9), heads=st.integers(1, 96),
       sms=st.integers(1, 200), leads=st.integers(0, 4), share=st.sampled_from([0.25, 0.5, 1.0]))
def test_the_stages_cover_every_document_and_chunk_once(lengths, heads, sms, leads, share):
    """Any documents, heads and SMs: the stages take `document_order` in consecutive pieces, every
    document in one stage and every chunk row in one run of its document's stage; at most ``leads``
    lead stages of one document each, their chains within ``share`` of the SMs, each lead longer than
    every document of the last stage."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.forward import Overlap, stages
    from dsfuse.gdn.schedule import document_order

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    chunks = [-(-n // 64) for n in lengths]
    rows = [sum(chunks[:d]) for d in range(len(chunks) + 1)]
    order = document_order(bounds)
    plan = stages(bounds, heads, sms, Overlap(leads, share))
    assert [first for first, _, _ in plan] == list(range(len(plan))) and plan[-1][1] == len(order)
    assert len(plan) - 1 <= leads and (len(plan) - 1) * heads <= share * sms
    if len(plan) > 1:  # leads only where the chains are latency-bound
        assert heads * sum(chunks) < sms * max(chunks)
    rest = max((chunks[d] for d in order[plan[-1][0]:]), default=0)
    assert all(chunks[order[first]] > rest for first, _, _ in plan[:-1])
    covered = []
    for first, end, runs in plan:
        mine = {c for d in order[first:end] for c in range(rows[d], rows[d + 1])}
        got = [c for c0, c1 in runs for c in range(c0, c1)]
        assert sorted(got) == sorted(mine) and len(set(got)) == len(got)
        assert all(c1 > c0 for c0, c1 in runs) and all(a[1] < b[0] for a, b in itertools.pairwise(runs))
        covered += got
    assert sorted(covered) == list(range(rows[-1]))


@pytest.mark.gpu
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("heads", [(16, 32), (16, 48), (2, 4)])
def test_the_overlapped_forward_gives_the_same_bits(l2, heads, monkeypatch):
    """`chunk_gdn` on the CuTe DSL backend, the experiment's five documents scaled to 8,192 tokens
    with an initial state: o and the final states bitwise under every overlap of its launches
    (``Overlap(0)``: the inverse, then every chain; the default overlaps in the capture only, the
    others eagerly too), eager and replayed from a CUDA Graph (the side streams forked and joined in
    the capture), outputs poisoned with NaN before each replay. The
    stages are planned for 1,000 SMs, so that the rule leads at every head count here (and each
    value head's chain kept whole, which the stages need: `test_halved_chains_and_pieces_give_the_same_bits`)."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prepared forms (wgmma) run on sm_90 only")
    from dsfuse.gdn import chunk_gdn
    from dsfuse.gdn.cutedsl import forward

    monkeypatch.setattr(forward, "_sms", lambda device: 1000)
    monkeypatch.setattr(forward, "column_parts", lambda *args: 1)
    h, hv = heads
    cu = [b // 4 for b in BENCH_BOUNDS[:-1]] + [8192]
    q, k, v, g, beta, _ = _inputs(cu[-1], h, hv, 128, 128, torch.bfloat16, "cuda", seed=3, l2=l2)
    h0 = torch.randn(len(cu) - 1, hv, 128, 128, device="cuda") * 0.1
    cu_t = torch.tensor(cu, dtype=torch.int32)  # on the host: read while a CUDA Graph is captured

    def run():
        return chunk_gdn(q[None], k[None], v[None], g[None], beta[None], initial_state=h0, output_final_state=True,
                         cu_seqlens=cu_t, use_qk_l2norm_in_kernel=l2, backend="cutedsl")

    results = {}
    for overlap in (forward.Overlap(0), forward.Overlap(), forward.Overlap(eager=True), forward.Overlap(1, eager=True),
                    forward.Overlap(2, 0.5, eager=True)):
        monkeypatch.setattr(forward, "OVERLAP", overlap)
        results[overlap] = [x.clone() for x in run()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = run()
        for x in static:
            x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(static, results[overlap])), f"{overlap}: graph replay"
    plain = results[forward.Overlap(0)]
    assert not any(x.isnan().any() for x in plain)
    for overlap, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), f"{overlap} changed the bits"
    assert len(forward.stages(cu, hv, 1000, forward.Overlap(1))) > 1  # an overlap ran in every case


def test_the_halves_layout_is_the_views_of_v_and_o():
    """`dsfuse.gdn.cutedsl.fused_fwd.split_columns` puts channels ``[64 p, 64 p + 64)`` of head ``hv``
    at head ``2 hv + p``, as ``[T, HV, 128]`` viewed as ``[T, 2 HV, 64]`` does for v and o (so a
    state and the rows its chain reads agree); `join_columns` gives the states back exactly; the
    halves are refused where the form or V cannot take them."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import fused_fwd

    h = torch.randn(3, 4, 8, 128)
    split = fused_fwd.split_columns(h, 2)
    assert split.shape == (3, 8, 8, 64) and split.is_contiguous()
    for hv, p in itertools.product(range(4), range(2)):
        assert torch.equal(split[:, 2 * hv + p], h[:, hv, :, 64 * p:64 * p + 64])
    # the same as each of the state's K rows read as v's and o's are: [.., HV, 128] viewed as [.., 2 HV, 64]
    as_rows = h.permute(0, 2, 1, 3).reshape(3, 8, 4 * 128).view(3, 8, 8, 64).permute(0, 2, 1, 3)
    assert torch.equal(split, as_rows)
    out = torch.full_like(h, float("nan"))
    assert torch.equal(fused_fwd.join_columns(split, 2, out), h) and torch.equal(out, h)
    assert fused_fwd.shape_reasons(torch.bfloat16, 16, 48, 128, 128, "head_ws", True, 2) == []
    assert "walks whole value heads" in fused_fwd.shape_reasons(torch.bfloat16, 16, 48, 128, 128, "head_rs", True, 2)[0]
    assert "not 32" in " ".join(fused_fwd.shape_reasons(torch.bfloat16, 16, 48, 128, 64, "head_ws", True, 2))
    with pytest.raises(ValueError, match="column parts"):
        fused_fwd.shape_reasons(torch.bfloat16, 16, 48, 128, 128, "head_ws", True, 4)


def test_the_halves_follow_a_captures_plan_and_the_pieces_their_cuts(monkeypatch):
    """`chain_parts` reads the plan a CUDA Graph capture would run (`OVERLAP`), not the eager call's,
    so that an eager call compiles what a later capture launches: two documents whose capture leads
    with a stage walk whole chains, under ``Overlap(0)`` halves; a sole document halves. The pieces'
    offsets are kept by their cuts: a changed `PIECES` gives its own (on the CPU: no capture)."""
    cutedsl_or_skip()
    import collections

    from dsfuse.gdn.cutedsl import forward

    two = [0, 9000, 16000]
    monkeypatch.setattr(forward, "OVERLAP", forward.Overlap())
    assert len(forward.stages(two, 32, 132)) == 2
    assert forward.chain_parts("head_rs", two, 32, 128, 132) == 1
    assert forward.chain_parts("head_rs", [0, 32768], 48, 128, 132) == 2
    assert forward.chain_parts("head_rs", [0, 32768], 48, 64, 132) == 1  # V = 64: head_ws already
    monkeypatch.setattr(forward, "OVERLAP", forward.Overlap(0))
    assert forward.chain_parts("head_rs", two, 32, 128, 132) == 2
    monkeypatch.setattr(forward, "_piece_offsets", collections.OrderedDict())
    cpu = torch.device("cpu")
    assert forward._pieces(257, cpu)[0] == [0, 16, 48, 112, 176, 240, 257]
    monkeypatch.setattr(forward, "PIECES", (16, 200, 64))
    cuts, offsets = forward._pieces(257, cpu)
    assert cuts == [0, 16, 216, 257] and offsets.tolist() == cuts
    monkeypatch.setattr(forward, "PIECES", (16, 32, 64))
    assert forward._pieces(257, cpu)[1].tolist() == [0, 16, 48, 112, 176, 240, 257]


def test_a_sole_documents_pieces_and_halves_follow_their_rules():
    """`dsfuse.gdn.cutedsl.forward.pieces`: a document of fewer than four of the last piece's chunks
    whole; longer, pieces of 16, 32, then 64 chunks to its end (a short last one). `column_parts`:
    halves on ``head_rs`` at V = 128 where twice the chains fit the SMs, else whole chains."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.forward import column_parts, pieces

    assert pieces(0) == [0, 0] and pieces(255) == [0, 255]
    assert pieces(256) == [0, 16, 48, 112, 176, 240, 256]
    assert pieces(512) == [0, 16, 48] + list(range(112, 512, 64)) + [512]
    for chunks in (256, 257, 300, 2048):
        cuts = pieces(chunks)
        sizes = [b - a for a, b in itertools.pairwise(cuts)]
        assert cuts[0] == 0 and cuts[-1] == chunks and all(n > 0 for n in sizes)
        assert sizes[:2] == [16, 32] and all(n == 64 for n in sizes[2:-1]) and sizes[-1] <= 64
    assert column_parts("head_rs", 48, 128, 1, 132) == 2 and column_parts("head_rs", 32, 128, 2, 132) == 2
    assert column_parts("head_rs", 48, 128, 2, 132) == 1 and column_parts("head_rs", 48, 128, 1, 95) == 1
    assert column_parts("head_ws", 48, 64, 1, 132) == 1 and column_parts("head", 4, 128, 1, 132) == 1


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "lengths"), [((16, 48), [16421]), ((16, 32), [16421]), ((2, 4), [16421]),
                                                ((16, 32), [9000, 7000]), ((2, 4), [9000, 7000])])
def test_halved_chains_and_pieces_give_the_same_bits(heads, lengths, monkeypatch):
    """`chunk_gdn` on the CuTe DSL backend, bf16, L2 norm, an initial state: each value head's chain
    walked by two CTAs of 64 channels (`column_parts`, the rule at 132 SMs) and a sole document's
    chain in pieces after their chunks' inverse (`pieces`; 16,421 tokens: 257 chunks, the last one
    partial; also cut in two and in three pieces), each alone and both, against whole chains in one
    launch: o, the final states and every gradient, dh0 included (the backward reads the states the
    halves save), bitwise, eagerly with autograd, each variant's chain launches counted (so a path
    that did not run cannot pass); then the forward alone captured in CUDA Graphs, with the default
    overlap (pieces for a sole document, stages for several) and with ``Overlap(0)`` (one launch,
    halves alone), with and without the halves, each capture's chain launches counted, each
    replayed with its outputs poisoned with NaN."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prepared forms (wgmma) run on sm_90 only")
    import collections

    from dsfuse.gdn import chunk_gdn
    from dsfuse.gdn.cutedsl import forward, fused_fwd

    monkeypatch.setattr(forward, "_sms", lambda device: 132)
    h, hv = heads
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q, k, v, g, beta, _ = _inputs(cu[-1], h, hv, 128, 128, torch.bfloat16, "cuda", seed=5)
    gen = torch.Generator(device="cuda").manual_seed(6)
    h0 = torch.randn(len(lengths), hv, 128, 128, generator=gen, device="cuda") * 0.1
    do = torch.randn(1, cu[-1], hv, 128, generator=gen, device="cuda").to(torch.bfloat16)
    dht = torch.randn(len(lengths), hv, 128, 128, generator=gen, device="cuda") * 0.1
    cu_t = torch.tensor(cu, dtype=torch.int32)  # on the host: read while a CUDA Graph is captured
    launches = []  # the parts of each chain launch
    launch = fused_fwd._launch

    def counted(*args, **kwargs):
        launches.append(args[19] if len(args) > 19 else kwargs.get("parts", 1))
        return launch(*args, **kwargs)

    monkeypatch.setattr(fused_fwd, "_launch", counted)

    def forward_pass(*inputs, initial_state=h0):
        return chunk_gdn(*(x[None] for x in inputs), initial_state=initial_state, output_final_state=True,
                         cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True, backend="cutedsl")

    def step():
        inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = forward_pass(*inputs[:-1], initial_state=inputs[-1])
        torch.autograd.backward((o, ht), (do, dht))
        return [o.detach(), ht.detach()] + [x.grad for x in inputs]

    whole = lambda *args: 1  # noqa: E731
    rule, sole, chunks = forward.column_parts, len(lengths) == 1, -(-cu[-1] // 64)
    halved = rule("head_rs", hv, 128, len(lengths), 132) == 2
    assert halved or sole, "every case here takes the halves, the pieces or both"
    variants = [("plain", False, False, None), ("halves", True, False, None), ("pieces", False, True, None),
                ("both", True, True, None)]
    if sole:
        variants += [("two pieces", False, True, (200, 64)), ("three pieces", True, True, (16, 200, 64))]
    runs = {}
    for name, use_halves, eager, cut in variants:
        overlap = forward.Overlap(eager=True) if eager else forward.Overlap(0)
        monkeypatch.setattr(forward, "column_parts", rule if use_halves else whole)
        monkeypatch.setattr(forward, "OVERLAP", overlap)
        monkeypatch.setattr(forward, "PIECES", cut or (16, 32, 64))
        monkeypatch.setattr(forward, "_piece_offsets", collections.OrderedDict())
        stages = 1 if sole else len(forward.stages(cu, hv, 132, overlap))
        count = len(forward.pieces(chunks)) - 1 if sole and eager else stages
        parts = 2 if use_halves and halved and stages == 1 else 1
        assert count == {"pieces": 6, "two pieces": 2, "three pieces": 3}.get(name, count) or not sole
        launches.clear()
        runs[name] = step()
        assert launches == [parts] * count, f"{name}: chain launches (their parts) {launches}, not {count} x {parts}"
    plain = runs.pop("plain")
    assert not any(x.isnan().any() for x in plain)
    for name, got in runs.items():
        differ = [i for i, (a, b) in enumerate(zip(got, plain)) if not torch.equal(a, b)]
        assert not differ, f"{name}: outputs {differ} (o, ht, dq, dk, dv, dg, dbeta, dh0) changed"
    monkeypatch.setattr(forward, "PIECES", (16, 32, 64))
    for overlap, use_halves in itertools.product((forward.Overlap(), forward.Overlap(0)), (True, False)):
        monkeypatch.setattr(forward, "OVERLAP", overlap)
        monkeypatch.setattr(forward, "column_parts", rule if use_halves else whole)
        forward_pass(q, k, v, g, beta)  # eager: compiles what the capture launches, the pieces' offsets on the GPU
        stages = 1 if sole else len(forward.stages(cu, hv, 132, overlap))
        count = len(forward.pieces(chunks)) - 1 if sole and overlap.leads else stages
        parts = 2 if use_halves and halved and stages == 1 else 1
        launches.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = forward_pass(q, k, v, g, beta)
        what = f"captured with {overlap}, halves {use_halves}"
        assert launches == [parts] * count, f"{what}: chain launches (their parts) {launches}, not {count} x {parts}"
        for x in static:
            x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(static, plain[:2])), f"{what}: graph replay"


CHUNK_TAIL = 64 + 7


def _check_factors(factors, g_cum, q, k, beta, ci, l2):
    """The preparing inverse's rows' factors (`dsfuse.gdn.cutedsl.ut_inverse.FACTORS`) of every chunk
    and value head against their formulas in float64 on the same values: G (bitwise ``g_cum``, flat
    at the last real row's past the chunk's end), beta (bitwise, 0 past the end), the L2 norm's
    scales (1 without it; of zero rows past the end), ``exp(G) rstd``, ``exp(G_last - G) rstd_k``
    (relative 1e-5: fp32 ``exp`` and products), a row of zeros."""
    from dsfuse.gdn.cutedsl.ut_inverse import FACTORS

    hv = beta.shape[1]
    group = hv // q.shape[1]
    f = factors.view(-1, len(FACTORS), hv, 64).to(F64)
    for c, (_, bos, eos) in enumerate(ci.tolist()):
        n = eos - bos
        G = g_cum[bos:eos].to(F64)  # [n, HV]
        G = torch.cat([G, G[-1:].expand(64 - n, hv)]).T  # [HV, 64], flat past the end
        b = torch.zeros(hv, 64, dtype=F64)
        b[:, :n] = beta[bos:eos].T.to(F64)
        rstd = torch.ones(2, hv, 64, dtype=F64)
        if l2:
            for i, x in enumerate((q, k)):
                rows = torch.zeros(64, x.shape[1], x.shape[2], dtype=F64)
                rows[:n] = x[bos:eos].to(F64)
                rstd[i] = (rows.square().sum(-1) + L2NORM_EPS).rsqrt().T.repeat_interleave(group, 0)
        want = torch.stack([G, b, G.exp() * rstd[0], G.exp() * rstd[1], (G[:, -1:] - G).exp() * rstd[1],
                            rstd[0], rstd[1], torch.zeros_like(G)])
        got = f[c]
        assert torch.equal(got[0], G) and torch.equal(got[1], b), f"chunk {c}: G or beta"
        torch.testing.assert_close(got[2:], want[2:], rtol=1e-5, atol=0, msg=f"chunk {c}: factors")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["head", "head_wgmma", "head_ws"])
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("dims", [(2, 6, 64, 64), (16, 48, 128, 128)])
def test_the_gated_launch_changes_nothing_else(form, l2, dims):
    """`chunk_gdn`'s pair of launches (the gating UT inverse, then the kernel reading its ``g_cum`` and
    gated ``a``): o and the final states bitwise those of the ungated pair (for ``head_ws``, gated
    only, with the preparing inverse: ``head_wgmma``'s ungated pair); ``g_cum`` the chunk-local
    cumulative gate and ``a`` the gated ``A0 * Gamma`` on every chunk's rows (float64 of the same A0
    and g, to fp32 rounding), close to the Triton UT transform's gated A, and left as the inverse
    wrote them by the kernel; rows in no document left as they were (NaN here: more than a chunk of
    them, so a write past a partial chunk's rows shows). The preparing inverse's ``round(A)`` is
    ``a`` rounded, bit for bit, and its rows' factors the formulas of `_check_factors`."""
    cutedsl_or_skip()
    if form in ("head_wgmma", "head_ws") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward
    from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse
    from dsfuse.gdn.reference import prepare_chunk_offsets
    from dsfuse.gdn.schedule import document_order
    from dsfuse.gdn.triton.wy import launch_ut

    h, hv, dk, dv = dims
    cu = _bounds()
    t = cu[-1] + CHUNK_TAIL  # tokens in no document: more than a chunk, so a write past a chunk's rows lands there
    q, k, v, g, beta, h0 = _inputs(t, h, hv, dk, dv, torch.bfloat16, "cuda", seed=3, l2=l2)
    dev = "cuda"
    ci = prepare_chunk_indices(cu).to(device=dev, dtype=torch.int32).contiguous()
    co = prepare_chunk_offsets(cu).to(device=dev, dtype=torch.int32).contiguous()
    order = torch.tensor(document_order(cu), device=dev, dtype=torch.int32)
    runs = []
    for gate in (False, True):
        kernel_form = "head_wgmma" if form == "head_ws" and not gate else form
        a = torch.full((t, hv, 64), float("nan"), device=dev)
        g_cum = torch.full_like(g, float("nan")) if gate else None
        prepared = {}
        if kernel_form == "head_ws":
            prepared = {"a_round": torch.full_like(a, float("nan"), dtype=k.dtype),
                        "factors": torch.full((ci.shape[0] * len(FACTORS), hv, 64), float("nan"), device=dev)}
        launch_ut_inverse(k, beta, ci, a, use_qk_l2norm=l2, g=g if gate else None, g_cum=g_cum,
                          q=q if prepared else None, **prepared)
        a_before = a.clone()
        prepared_before = {name: x.clone() for name, x in prepared.items()}
        ht, o = torch.full_like(h0, float("nan")), torch.full_like(v, float("nan"))
        launch_fused_forward(q, k, v, g, beta, a, ci, co, order, h0, ht, o, dk**-0.5, use_qk_l2norm=l2,
                             form=kernel_form, g_cum=g_cum, **prepared)
        runs.append((o, ht, a, a_before, g_cum))
    torch.cuda.synchronize()
    if prepared:
        a_round = prepared["a_round"]
        assert a_round[cu[-1]:].isnan().all()  # rows in no document: untouched
        assert torch.equal(a_round[: cu[-1]], runs[1][2][: cu[-1]].to(k.dtype))
        _check_factors(prepared["factors"].cpu(), g_cum.cpu(), q.cpu(), k.cpu(), beta.cpu(), ci.cpu(), l2)
        for name, x in prepared.items():  # the kernel only reads them
            assert torch.equal(x.nan_to_num(7.0), prepared_before[name].nan_to_num(7.0)), name
        # keeping no A (a forward without a backward): the same round(A), factors and g_cum
        again = {name: torch.full_like(x, float("nan")) for name, x in prepared.items()}
        g_again = torch.full_like(g, float("nan"))
        assert launch_ut_inverse(k, beta, ci, None, use_qk_l2norm=l2, g=g, g_cum=g_again, q=q, **again) is None
        torch.cuda.synchronize()
        for name, x in prepared.items():
            assert torch.equal(again[name].nan_to_num(7.0), x.nan_to_num(7.0)), name
        assert torch.equal(g_again.nan_to_num(7.0), runs[1][4].nan_to_num(7.0))
    (o1, ht1, a0, a0_before, _), (o2, ht2, a2, a2_before, g_cum) = runs
    assert torch.equal(o1[: cu[-1]], o2[: cu[-1]]) and torch.equal(ht1, ht2)
    for a, before in ((a0, a0_before), (a2, a2_before)):  # the kernel only reads a (head_ws: does not read it)
        assert torch.equal(a.nan_to_num(7.0), before.nan_to_num(7.0))
    assert g_cum[cu[-1]:].isnan().all() and a2[cu[-1]:].isnan().all()  # rows in no document: untouched
    g_ref = torch.full((t, hv), float("nan"), dtype=F64)
    a_ref = torch.full((t, hv, 64), float("nan"), dtype=F64)
    g64, a064 = g.to(F64).cpu(), a0.to(F64).cpu()
    for _, bos, eos in ci.tolist():
        g_ref[bos:eos] = g64[bos:eos].cumsum(0)
        n = eos - bos
        gamma = (g_ref[bos:eos, None, :] - g_ref[None, bos:eos, :]).permute(2, 0, 1).exp().tril()  # [HV, i, j]
        a_ref[bos:eos, :, :n] = (a064[bos:eos, :, :n].permute(1, 0, 2) * gamma).permute(1, 0, 2)
        a_ref[bos:eos, :, n:] = 0.0
    got_g, got_a = g_cum[: cu[-1]].to(F64).cpu(), a2[: cu[-1]].to(F64).cpu()
    torch.testing.assert_close(got_g, g_ref[: cu[-1]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_a, a_ref[: cu[-1]], rtol=1e-4, atol=1e-5)
    a_triton = torch.full_like(a0, float("nan"))
    launch_ut(k, beta, g_cum, ci, a_triton, hv, use_qk_l2norm=l2)
    assert_rel_rms(got_a, a_triton[: cu[-1]].to(F64).cpu(), 1e-3, "gated A against the Triton UT transform")


def test_the_served_form_is_head_rs_on_hopper_at_v_128(monkeypatch):
    """`dsfuse.gdn.cutedsl.forward.form_of`: ``head_rs`` on sm_90a at V = 128 (its two warpgroups of 64
    value channels), ``head_ws`` there at other V, ``head`` where wgmma does not exist (the GPU's arch
    stood in for on the CPU); both sm_90a forms read the preparing inverse's outputs."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import forward, fused_fwd

    arch = {"now": "sm_90a"}
    monkeypatch.setattr(forward._cd, "arch_of", lambda device: arch["now"])
    cuda = torch.device("cuda")
    assert (forward.form_of(cuda, 128), forward.form_of(cuda, 64)) == ("head_rs", "head_ws")
    assert {forward.form_of(cuda, 128), forward.form_of(cuda, 64)} <= set(fused_fwd.PREPARED_FORMS)
    arch["now"] = "sm_100a"
    assert (forward.form_of(cuda, 128), forward.form_of(cuda, 64)) == ("head", "head")


def test_the_backends_reasons_name_what_the_kernels_cannot_take():
    """`dsfuse.gdn.cutedsl.forward.reasons` (CPU tensors: the GPU's arch aside): the model's call
    served, packed head views of one row served, and each thing the kernels cannot take refused by
    name, with q, k, v seen as the kernels see them ([B * T, heads, D], a copy where no view is)."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.forward import reasons

    def call(b=1, t=70, h=2, hv=4, dk=128, dv=128, dtype=torch.bfloat16, **change):
        x = dict(q=torch.zeros(b, t, h, dk, dtype=dtype), k=torch.zeros(b, t, h, dk, dtype=dtype),
                 v=torch.zeros(b, t, hv, dv, dtype=dtype), g=torch.zeros(b, t, hv),
                 beta=torch.zeros(b, t, hv, dtype=dtype))
        x.update({n: f(x[n]) for n, f in change.items() if n != "l2"})
        return reasons(x["q"], x["k"], x["v"], x["g"], x["beta"], None, change.get("l2", True))

    assert call() == [] and call(b=2) == [] and call(dk=64, dv=64) == []
    row = torch.zeros(1, 70, (2 * 2 + 4) * 128, dtype=torch.bfloat16)
    q, k, v = row.split([256, 256, 512], -1)
    assert call(q=lambda _: q.view(1, 70, 2, 128), k=lambda _: k.view(1, 70, 2, 128),
                v=lambda _: v.view(1, 70, 4, 128)) == []
    assert any("beta's dtype" in r for r in call(beta=lambda b: b.float()))
    assert any("inputs, not torch.float32" in r for r in call(dtype=torch.float32))  # the per-head forms: bf16 / fp16
    assert any("fp16 only without the L2 norm" in r for r in call(dtype=torch.float16))
    assert call(dtype=torch.float16, l2=False) == []
    assert any("K = 64 or 128, not 32" in r for r in call(dk=32))
    assert any("channel stride" in r for r in call(q=lambda x: torch.zeros(1, 70, 2, 256, dtype=x.dtype)[..., ::2]))
    shifted = torch.zeros(1, 70, 2 * 128 + 4, dtype=torch.bfloat16)[:, :, 4:].view(1, 70, 2, 128)  # 8-byte offset
    assert any("q needs a 16-byte aligned base" in r for r in call(q=lambda _: shifted))
    # T = 1 with B > 1: the kernels see the batch stride as the token stride
    odd = torch.zeros(3, 1, 2 * 128 + 4, dtype=torch.bfloat16)[:, :, : 2 * 128].view(3, 1, 2, 128)
    assert any("q needs" in r for r in call(b=3, t=1, q=lambda _: odd))


def test_the_backends_reasons_are_asked_once_for_the_same_tensors(monkeypatch):
    """The table's own reasons (`dsfuse.gdn.cutedsl._forward_reasons`, which an eager call asks twice):
    the second ask with the same tensors is answered without asking `forward.reasons` again, and the
    same answer; a tensor at another address, or another flag, is asked anew (a refusal names the
    tensor's own address, not a remembered one)."""
    cutedsl_or_skip()
    import dsfuse.gdn.cutedsl as table
    from dsfuse.gdn.cutedsl import forward

    asked = []
    real = forward.reasons
    monkeypatch.setattr(forward, "reasons", lambda *a: asked.append(a) or real(*a))
    monkeypatch.setattr(table, "_REASONS", type(table._REASONS)())

    def inputs(q=None):
        x = [torch.zeros(1, 70, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 70, 2, 128, dtype=torch.bfloat16),
             torch.zeros(1, 70, 4, 128, dtype=torch.bfloat16), torch.zeros(1, 70, 4),
             torch.zeros(1, 70, 4, dtype=torch.bfloat16)]
        return [q if q is not None else x[0], *x[1:]]

    args = (*inputs(), None, True)
    assert table._forward_reasons(*args) == [] and table._forward_reasons(*args) == [] and len(asked) == 1
    assert table._forward_reasons(*args[:-1], False) == [] and len(asked) == 2
    for offset in (4, 12):  # 8 and 24 bytes off a 16-byte boundary: two addresses, each named
        q = torch.zeros(1, 70, 2 * 128 + offset, dtype=torch.bfloat16)[:, :, offset:].view(1, 70, 2, 128)
        found = table._forward_reasons(*inputs(q), None, True)
        assert any(f"address {q.data_ptr()}" in r for r in found), found
    assert len(asked) == 4
    for _ in range(3 * table._REASONS_KEPT):  # a bounded memory
        table._forward_reasons(*inputs(), None, True)
    assert len(table._REASONS) <= table._REASONS_KEPT
