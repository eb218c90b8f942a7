"""The per-chunk gradients of the fused backward (``dsfuse.gdn.cutedsl.chunk_bwd``, kernel 3 of
``experiments/gdn/notes/fused-backward-design.md``) and the fused backward they complete
(``dsfuse.gdn.cutedsl.backward.fused_backward``: the saving forward, the reverse state chain, the
per-chunk gradients, the finalising sum of the value heads): compilation and refusals on the CPU;
on an H200 every gradient against the float64 reference within the op's contract
(``dsfuse.bench.gdn.TOLERANCES``), with varlen documents (empty, one token, partial chunks), tokens
in no document, grouped value heads, an initial state and a final-state gradient, bitwise run to
run."""

import itertools

import pytest
import torch
from conftest import cutedsl_or_skip
from helpers import assert_rel_rms

LENGTHS = [1, 63, 0, 64, 65, 200]  # an empty and a one-token document among them
TAIL = 7  # tokens in no document
F64 = torch.float64


def test_compiles_the_model_and_refuses_the_rest(tmp_path):
    """The AOT specs (sm_90a, the model's shapes): the design's products on wgmma (12 of ``(C, K or V)``,
    6 of ``(C, C)``), its barriers, the cluster's two barriers and its reads of the value heads' dq
    and dk partials from the peers' shared memory (3 value heads, 4 channels a lane, dq and dk, a
    path for each rank); the two states' tiles by TMA, round(dS') after the reverse chain's flag;
    other sizes and architectures refused by name."""
    import collections
    import re

    from helpers import cute_spec_ptx

    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import chunk_bwd as module

    assert [s.name for s in module.AOT_SPECS] == ["gdn_chunk_backward_bf16_l2", "gdn_chunk_backward_bf16"]
    for spec in module.AOT_SPECS:
        ptx = cute_spec_ptx(spec, "sm_90a", tmp_path)
        shapes = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
        assert shapes == {"m64n64k16": 68, "m64n32k16": 40}, (spec.name, shapes)
        assert len(re.findall(r"bar\.sync", ptx)) == 8, spec.name
        # two cluster barriers, both arrives relaxed: the first after the partials' barrier is
        # initialised (the documented init fence), the last after a CTA-scope fence (it releases no
        # writes); no plain (release) arrive, which ptxas makes a GPU-scope membar
        assert ptx.count("barrier.cluster.arrive") == ptx.count("barrier.cluster.wait") == 2, spec.name
        assert ptx.count("barrier.cluster.arrive.relaxed") == 2, spec.name
        # (the init and its fence by one thread, before the first arrive: other code may sit between)
        assert 0 <= ptx.find("fence.mbarrier_init.release.cluster;") < ptx.find("barrier.cluster.arrive.relaxed"), \
            spec.name
        assert re.search(r"fence\.acq_rel\.cta;\s+barrier\.cluster\.arrive\.relaxed", ptx), spec.name
        # the partials stored: a release restricted to this CTA's shared memory, then one relaxed
        # arrival on each of the 3 CTAs' barriers (this one's too); the wait, then the matching acquire
        assert ptx.count("fence.release.sync_restrict::shared::cta.cluster;") == 1, spec.name
        assert len(re.findall(r"mbarrier\.arrive\.relaxed\.cluster\.shared::cluster\.b64", ptx)) == 3, spec.name
        assert ptx.count("fence.acquire.sync_restrict::shared::cluster.cluster;") == 1, spec.name
        # a lane's four channels of dq and dk: one vector load from each of the 2 other value heads'
        # CTAs (its own from its own shared memory), one 8-byte store, in each of the 3 ranks' paths;
        # dv by 16-byte stores of 8 channels of a row (a quad's words swapped by 4 butterfly
        # shuffles for each two 8-column blocks: 4 stores and 16 shuffles a thread)
        assert len(re.findall(r"ld\.shared::cluster\.v4\.f32", ptx)) == 3 * 2 * 2, spec.name
        assert "ld.shared::cluster.f32" not in ptx, spec.name
        assert len(re.findall(r"st\.global\.(?:v4\.b16|v2\.b32)", ptx)) == 3 * 2, spec.name  # 8 bytes
        assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 4, spec.name
        assert len(re.findall(r"st\.global\.b32", ptx)) == 1, spec.name  # dg's fp32, no dv pairs
        assert len(re.findall(r"shfl\.sync\.bfly", ptx)) >= 16, spec.name
        # round(S) and round(dS') by TMA, two 128 x 64 boxes each, counted on their own barrier; the
        # other rows by 16-byte cp.async: 4 pieces a thread of q, k, v and dO each, 2 of round(A Gamma), 1 of the factors
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes",
                              ptx)) == 4, spec.name
        assert ptx.count("mbarrier.arrive.expect_tx.shared.b64") == 1, spec.name
        # the copies elect their lane (elect.sync over the whole warp): a whole warp must reach them
        # (a first form issued them under one thread's branch and hung)
        elect = ptx.find("elect.sync")
        warp_sync = ptx.rfind("bar.warp.sync", 0, elect)
        assert 0 < warp_sync and warp_sync > ptx.find("fence.mbarrier_init.release.cluster;"), spec.name
        # thread 0 expects the bytes after that warp sync, not right after the initialisations: ptxas
        # issues those once for the warp, and racecheck reports another lane's writes unsynchronised
        assert warp_sync < ptx.find("mbarrier.arrive.expect_tx.shared.b64") < elect, spec.name
        assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == 19, spec.name
        # round(dS') only after its flag (the reverse chain's release, read with acquire semantics, then
        # a proxy fence for the TMA's reads): round(S)'s two boxes before that wait, round(dS')'s after
        loads = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx)]
        wait = ptx.find("ld.acquire.gpu.global.b32")
        assert ptx.count("ld.acquire.gpu.global.b32") == 1 and loads[1] < wait < loads[2], spec.name
        assert re.search(r"ld\.acquire\.gpu\.global\.b32 %r\d+, \[%rd\d+\]; fence\.proxy\.async\.global;", ptx)
        # the next wave's rows into L2: two 128-byte lines of a row of S or dS', q, k, v or dO, one of A
        assert ptx.count("prefetch.global.L2 [") == 2 + 2 + 2 * 4 + 1, spec.name
    with pytest.raises(ValueError, match="compile for"):
        module.compile_chunk_backward(torch.bfloat16, 16, 48, 128, 128, True, "sm_100a")
    with pytest.raises(ValueError, match="cannot compile this"):
        module.compile_chunk_backward(torch.bfloat16, 2, 4, 64, 128, False, "sm_90a")
    assert "at most 8 value heads per qk head" in module.shape_reasons(torch.bfloat16, 1, 16, 128, 128)[0]


def test_checks_its_arguments_before_any_launch():
    """Wrong shapes, dtypes and layouts refused by name (CPU tensors: no launch)."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.chunk_bwd import launch_chunk_backward

    t, h, hv, d = 70, 1, 2, 128
    q, k = (torch.zeros(t, h, d, dtype=torch.bfloat16) for _ in range(2))
    v, do, dv = (torch.zeros(t, hv, d, dtype=torch.bfloat16) for _ in range(3))
    a_round, factors = torch.zeros(t, hv, 64, dtype=torch.bfloat16), torch.zeros(2 * 8, hv, 64)
    states, dstates = (torch.zeros(2, d, hv, d, dtype=torch.bfloat16) for _ in range(2))
    ci = torch.zeros(2, 3, dtype=torch.int32)
    dq, dk = torch.zeros(t, h, d, dtype=torch.bfloat16), torch.zeros(t, h, d, dtype=torch.bfloat16)
    dg, dbeta = torch.zeros(t, hv), torch.zeros(t, hv, dtype=torch.bfloat16)
    good = {"q": q, "k": k, "v": v, "do": do, "a_round": a_round, "factors": factors, "states": states,
            "dstates": dstates, "chunk_indices": ci, "dq": dq, "dk": dk, "dv": dv, "dg": dg, "dbeta": dbeta,
            "scale": 1.0}
    for bad, match in (({"do": do.half()}, "in one dtype"),
                       ({"dv": dv[:-1]}, "in one dtype"),
                       ({"states": states[:1]}, "states must be"),
                       ({"dstates": dstates.float()}, "dstates must be"),
                       ({"dq": dq.float()}, "in one dtype"),
                       ({"dk": dk[:-1]}, "in one dtype"),
                       ({"dq": dq.transpose(1, 2)}, "in one dtype"),
                       ({"dg": dg.double()}, "dg fp32"),
                       ({"factors": factors[:-1]}, "factors must be"),
                       ({"q": q[..., :64], "k": k[..., :64]}, "K = 128")):
        with pytest.raises(ValueError, match=match):
            launch_chunk_backward(**(good | bad))


def _inputs(h, hv, dtype, l2, seed):
    gen = torch.Generator().manual_seed(seed)
    t, d = sum(LENGTHS) + TAIL, 128
    q, k = torch.randn(t, h, d, generator=gen, dtype=F64), torch.randn(t, h, d, generator=gen, dtype=F64)
    if not l2:
        q, k = (x / x.norm(dim=-1, keepdim=True) * 0.9 for x in (q, k))
    v = torch.randn(t, hv, d, generator=gen, dtype=F64)
    g = -torch.rand(t, hv, generator=gen, dtype=F64) * 0.3
    beta = torch.rand(t, hv, generator=gen, dtype=F64)
    do = torch.randn(t, hv, d, generator=gen, dtype=F64)
    n = len(LENGTHS)
    h0, dht = (torch.randn(n, hv, d, d, generator=gen, dtype=F64) * 0.1 for _ in range(2))
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "g": g.float(), "beta": beta.to(dtype),
            "do": do.to(dtype), "h0": h0.float(), "dht": dht.float()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, l2", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, False)])
@pytest.mark.parametrize("heads", [(2, 4), (1, 3)])
def test_the_fused_backward_matches_the_float64_reference(dtype, l2, heads):
    """dq, dk, dv, dg, dbeta and dh0 against ``chunk_gdn_backward_reference`` in float64 on the same
    rounded inputs: relative RMS per document within the op's contract (dq, dk, dv, dh0 0.008; dg,
    dbeta 0.02); the tail's gradients zero; a second call the same bits."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    from dsfuse.bench.gdn import TOLERANCES
    from dsfuse.gdn.cutedsl.backward import fused_backward
    from dsfuse.gdn.reference_backward import chunk_gdn_backward_reference

    h, hv = heads
    x = _inputs(h, hv, dtype, l2, seed=5)
    cu = [0, *itertools.accumulate(LENGTHS)]
    gpu = {name: t.cuda() for name, t in x.items()}

    def run():
        return fused_backward(gpu["q"], gpu["k"], gpu["v"], gpu["g"], gpu["beta"], gpu["do"],
                              initial_state=gpu["h0"], dht=gpu["dht"], cu_seqlens=cu, use_qk_l2norm=l2)

    got, again = run(), run()
    torch.cuda.synchronize()
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dstates", "states"):
        assert torch.equal(got[name], again[name]), name
    want = chunk_gdn_backward_reference(*(x[name].to(F64)[None] for name in ("q", "k", "v", "g", "beta")),
                                        initial_state=x["h0"].to(F64), cu_seqlens=torch.tensor(cu),
                                        use_qk_l2norm_in_kernel=l2, do=x["do"].to(F64)[None], dht=x["dht"].to(F64))
    names = ("dq", "dk", "dv", "dg", "dbeta")
    for name, ref in zip(names, want[:5]):
        out = got[name].double().cpu()
        assert (out[cu[-1]:] == 0).all(), f"{name}: the tail's gradients"
        for n, (bos, eos) in enumerate(itertools.pairwise(cu)):
            if eos > bos:
                assert_rel_rms(out[bos:eos], ref[0, bos:eos], TOLERANCES[name], f"{name}, document {n}")
    for n in range(len(LENGTHS)):
        assert_rel_rms(got["dh0"][n].double().cpu(), want[5][n], TOLERANCES["dh0"], f"dh0, document {n}")


@pytest.mark.parametrize("lengths", [[1], [4000], [3000, 64, 700, 1, 0, 130], [64, 64, 64]])
def test_the_chunks_in_the_order_the_reverse_chain_finishes_them(lengths):
    """`reverse_chain_order` (the per-chunk kernel's start order): every chunk once; each document's
    chunks last to first; a chunk at place s from its document's end before any at place s + 1, ties
    in `document_order` (CPU)."""
    from dsfuse.gdn.reference import prepare_chunk_indices
    from dsfuse.gdn.schedule import document_order, reverse_chain_order

    bounds = [0, *itertools.accumulate(lengths)]
    order = reverse_chain_order(bounds)
    table = prepare_chunk_indices(bounds, 64).tolist()
    assert sorted(order) == list(range(len(table)))
    doc_of = [row[0] for row in table]
    last = {n: max(c for c in range(len(table)) if doc_of[c] == n) for n in set(doc_of)}
    rank = {n: i for i, n in enumerate(document_order(bounds))}
    keys = [(last[doc_of[c]] - c, rank[doc_of[c]]) for c in order]
    assert keys == sorted(keys)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[4000], [4096, 64, 700, 1, 0, 130, 100, 4097]])
def test_the_overlapped_kernels_give_the_serial_bits(lengths):
    """The per-chunk kernel launched as a programmatic dependent of the reverse chain, each CTA waiting
    for its chunk's flag (as `chunk_gdn` runs them), gives the bits of the two kernels one after the
    other, five times over: one long document (most of its CTAs wait) and documents of other lengths
    (63, 64, 65, 11, 3, 2 and 1 chunks: a document's last batch of the chain's flags, four at a time,
    holds one, two, three or four of them). Every
    result is kept, so no run's round(dS') lands where an earlier run left the right values."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    from dsfuse.gdn.cutedsl.backward import fused_backward

    gen = torch.Generator().manual_seed(11)
    t, h, hv, d = sum(lengths), 2, 6, 128
    x = {"q": torch.randn(t, h, d, generator=gen), "k": torch.randn(t, h, d, generator=gen),
         "v": torch.randn(t, hv, d, generator=gen), "g": -torch.rand(t, hv, generator=gen) * 0.3,
         "beta": torch.rand(t, hv, generator=gen), "do": torch.randn(t, hv, d, generator=gen)}
    x = {name: (v if name == "g" else v.bfloat16()).cuda() for name, v in x.items()}
    dht = torch.randn(len(lengths), hv, d, d, generator=gen).cuda() * 0.1
    cu = [0, *itertools.accumulate(lengths)]

    def run(overlap):
        return fused_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=dht, cu_seqlens=cu,
                              use_qk_l2norm=True, overlap=overlap)

    serial = run(False)
    kept = []
    for _ in range(5):
        kept.append(run(True))
        for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dstates"):
            assert torch.equal(kept[-1][name], serial[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, docs", [(1, 1), (392 + TAIL, 6), (32768, 5), (65, 2)])
def test_the_saved_buffer_holds_its_three_parts_apart(tokens, docs, dtype):
    """`saved_views` of a buffer of `saved_rows`: ``round(A Gamma)``, the factors and the states in bounds,
    16-byte aligned, not overlapping, for the most chunks the documents can have (CPU)."""
    from dsfuse.gdn.cutedsl.backward import saved_rows, saved_views

    hv, d = 3, 128
    chunks = -(-tokens // 64) + docs
    saved = torch.zeros(saved_rows(tokens, docs, d, d), hv, 64)
    parts = saved_views(saved, tokens, chunks, d, d, dtype)
    assert [tuple(p.shape) for p in parts] == [(tokens, hv, 64), (chunks * 8, hv, 64), (chunks, d, hv, d)]
    assert [p.dtype for p in parts] == [dtype, torch.float32, dtype]
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in parts)
    base, end = saved.data_ptr(), saved.data_ptr() + saved.numel() * 4
    assert all(p.is_contiguous() and p.data_ptr() % 16 == 0 for p in parts)
    assert spans[0][0] >= base and spans[-1][1] <= end
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, l2", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, False)])
def test_chunk_gdn_runs_the_fused_backward(dtype, l2):
    """``chunk_gdn(backend="cutedsl")`` at K = V = 128 keeps the fused backward's buffer (its shape the
    traced forward's, `_forward_fake`) and its gradients are the bits of `fused_backward` on the same
    inputs (not the Triton stages'), also from a dO whose rows are misaligned for 16-byte loads; a forward
    without grad keeps nothing."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    from dsfuse.gdn import chunk_gdn
    from dsfuse.gdn.api import _forward_fake, forward_ops
    from dsfuse.gdn.cutedsl.backward import fused_backward

    x = {name: t.cuda() for name, t in _inputs(2, 4, dtype, l2, seed=9).items()}
    cu = [0, *itertools.accumulate(LENGTHS)]
    t = sum(LENGTHS)
    leaves = {name: x[name][:t][None].clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")}
    h0 = x["h0"].clone().requires_grad_()
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    o, ht = chunk_gdn(**leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu_t,
                      use_qk_l2norm_in_kernel=l2, backend="cutedsl")
    torch.autograd.backward((o, ht), (x["do"][:t][None], x["dht"]))
    want = fused_backward(*(x[name][:t] for name in ("q", "k", "v", "g", "beta", "do")), initial_state=x["h0"],
                          dht=x["dht"], cu_seqlens=cu, use_qk_l2norm=l2)
    assert torch.equal(o[0], want["o"]) and torch.equal(ht, want["final_state"])
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(leaves[name].grad[0], want[f"d{name}"]), name
    assert torch.equal(h0.grad, want["dh0"])

    # a dO whose rows the kernel's 16-byte loads cannot read (one element off) is copied: the same bits
    do = x["do"][:t][None]
    shifted = torch.empty(do.numel() + 1, dtype=do.dtype, device="cuda")[1:].view_as(do).copy_(do)
    again = {name: leaves[name].detach().clone().requires_grad_() for name in leaves}
    h0_again = x["h0"].clone().requires_grad_()
    o2, ht2 = chunk_gdn(**again, initial_state=h0_again, output_final_state=True, cu_seqlens=cu_t,
                        use_qk_l2norm_in_kernel=l2, backend="cutedsl")
    torch.autograd.backward((o2, ht2), (shifted, x["dht"]))
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(again[name].grad[0], want[f"d{name}"]), f"misaligned dO: d{name}"
    assert torch.equal(h0_again.grad, want["dh0"])

    args = (*(leaves[name].detach() for name in ("q", "k", "v", "g", "beta")), x["h0"], cu_t.cpu().long(),
            128**-0.5, True, l2)
    for save in (True, False):
        real = forward_ops["cutedsl"](*args, save)
        fake = _forward_fake("cutedsl", *args, save)
        assert [tuple(r.shape) for r in real] == [tuple(f.shape) for f in fake], save
    assert real[3].shape[0] == 0  # no backward: nothing kept
