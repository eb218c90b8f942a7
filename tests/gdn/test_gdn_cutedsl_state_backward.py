"""The reverse state chain of the fused backward (``dsfuse.gdn.cutedsl.state_bwd``, kernel 2 of
``experiments/gdn/notes/fused-backward-design.md``): its compilation and refusals on the CPU, and on
an H200 its ``round(dS')`` per chunk and ``dh0`` against the design's float64 chain
(``test_gdn_fused_backward_algebra.state_backward_in_float64``) with varlen documents (empty, one
token, partial chunks), grouped value heads and a final-state gradient, bitwise run to run and
from packed head views."""

import itertools

import pytest
import torch
from conftest import cutedsl_or_skip
from dsfuse.gdn.reference import prepare_chunk_indices, prepare_chunk_offsets
from helpers import assert_rel_rms

LENGTHS = [1, 63, 0, 64, 65, 200]  # an empty and a one-token document among them
F64 = torch.float64


def test_compiles_the_model_and_refuses_the_rest(tmp_path):
    """The AOT specs (sm_90a, the model's shapes): per chunk the products of the design (``q k^T``, ``k
    round(dS')``, ``round(P)^T dO``, ``round(A Gamma)^T round(dv_new)``, and the state's two updates on
    wgmma; ``q k^T`` twice in the code: the first chunk's before the loop, each next one's in it, beside
    the state's update) and 5 barriers (one before the loop, three a chunk, one before the last flag);
    other sizes, dtypes and architectures refused by name; rows past a chunk's end zero-filled by the
    copies themselves, ``round(dS')`` stored by TMA, and each chunk's flag for the per-chunk kernel
    released once its store has completed."""
    import collections
    import re

    from helpers import cute_spec_ptx

    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import state_bwd as module

    assert [s.name for s in module.AOT_SPECS] == ["gdn_state_backward_bf16_l2", "gdn_state_backward_bf16"]
    for spec in module.AOT_SPECS:
        ptx = cute_spec_ptx(spec, "sm_90a", tmp_path)
        shapes = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
        assert shapes == {"m64n32k16": 2 * 8, "m64n64k16": 16, "m64n128k16": 8}, (spec.name, shapes)
        assert len(re.findall(r"bar\.sync", ptx)) == 5, spec.name
        # Rows are copied with their row test as the cp.async's source size (16 or 0 bytes: a zero
        # fill without a branch or a second store); only the factors' rows, always inside, are fixed.
        sizes = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16, (\w+|%r\d+);", ptx)
        assert len(sizes) == 30 and sum(size.startswith("%r") for size in sizes) == 28, (spec.name, sizes)
        assert not re.search(r"st\.shared\.v4\.b32\s+\[[^]]+\], \{0, 0, 0, 0\}", ptx), spec.name
        # round(dS') by TMA: two 128 x 64 boxes a chunk, its tile's reads waited for in the loop, the
        # writes before exit; no 16-byte global stores left (dh0's fp32 stores are scalar)
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.tile", ptx)) == 2, spec.name
        assert re.findall(r"cp\.async\.bulk\.wait_group(\.read)?\s+(\d);", ptx) == [
            (".read", "0"), ("", "1"), ("", "0")], spec.name
        assert not re.search(r"st\.global\.v4", ptx), spec.name
        # the per-chunk kernel, a programmatic dependent, may start once every CTA has started; chunks'
        # flags released after their round(dS')'s stores completed (four at a time in the loop, while
        # the state's update runs; the document's last ones after dh0 and a barrier), a proxy fence first
        assert ptx.count("griddepcontrol.launch_dependents;") == 1, spec.name
        flags = re.findall(r"cp\.async\.bulk\.wait_group\s+\d;[\s\S]*?fence\.proxy\.async\.global; "
                           r"fence\.acq_rel\.gpu;[\s\S]*?st\.relaxed\.gpu\.global\.b32 \[%rd\d+\], 1;", ptx)
        assert len(flags) == 2 and ptx.count("fence.acq_rel.gpu") == 2, spec.name
    with pytest.raises(ValueError, match="compiles for"):
        module.compile_state_backward(torch.bfloat16, 16, 48, 128, 128, True, "sm_100a")
    reasons = module.shape_reasons(torch.float32, 16, 40, 64, 96)
    assert len(reasons) == 4 and "K = 128, not 64" in reasons[1] and "V = 128, not 96" in reasons[2]
    with pytest.raises(ValueError, match="cannot compile this"):
        module.compile_state_backward(torch.bfloat16, 2, 4, 64, 128, False, "sm_90a")


def test_checks_its_arguments_before_any_launch():
    """Wrong shapes, dtypes and layouts refused by name (CPU tensors: no launch)."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.state_bwd import launch_state_backward

    t, h, hv, d = 70, 1, 2, 128
    q, k = (torch.zeros(t, h, d, dtype=torch.bfloat16) for _ in range(2))
    do = torch.zeros(t, hv, d, dtype=torch.bfloat16)
    a_round, factors = torch.zeros(t, hv, 64, dtype=torch.bfloat16), torch.zeros(2 * 8, hv, 64)
    ci, co, order = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    dht, dh0 = torch.zeros(1, hv, d, d), torch.zeros(1, hv, d, d)
    dstates = torch.zeros(2, d, hv, d, dtype=torch.bfloat16)
    good = dict(q=q, k=k, do=do, a_round=a_round, factors=factors, chunk_indices=ci, chunk_offsets=co, order=order,
                dht=dht, dh0=dh0, dstates=dstates, scale=1.0)
    for bad, match in (({"q": q.float(), "k": k.float()}, "takes torch.bfloat16 or torch.float16"),
                       ({"do": do.half()}, "in one dtype"),
                       ({"dht": dht[:, :1]}, "dht must be fp32"),
                       ({"dh0": dh0.double()}, "dh0 must be fp32"),
                       ({"dstates": dstates[:1]}, "dstates must be"),
                       ({"dstates": dstates.transpose(1, 2)}, "dstates must be"),
                       ({"dstates": torch.zeros(2, d, hv, 2 * d, dtype=torch.bfloat16)[..., ::2]}, "dstates must be"),
                       ({"dstates": torch.zeros(dstates.numel() + 1, dtype=torch.bfloat16)[1:].view(dstates.shape)},
                        "dstates must be"),
                       ({"a_round": a_round[:-1]}, "a_round must be"),
                       ({"order": order.long()}, "order int32"),
                       ({"q": q[..., :64], "k": k[..., :64]}, "K = 128")):
        with pytest.raises(ValueError, match=match):
            launch_state_backward(**(good | bad))


def _inputs(h, hv, dtype, l2, seed):
    """Rounded inputs on the GPU and their float64 copies (the oracle's): q, k (unit norm and shrunk
    without the L2 norm), g, beta, dO, dht."""
    gen = torch.Generator().manual_seed(seed)
    t, d = sum(LENGTHS), 128
    q, k = torch.randn(t, h, d, generator=gen, dtype=F64), torch.randn(t, h, d, generator=gen, dtype=F64)
    if not l2:
        q, k = (x / x.norm(dim=-1, keepdim=True) * 0.9 for x in (q, k))
    g = -torch.rand(t, hv, generator=gen, dtype=F64) * 0.3
    beta = torch.rand(t, hv, generator=gen, dtype=F64)
    do = torch.randn(t, hv, d, generator=gen, dtype=F64)
    dht = torch.randn(len(LENGTHS), hv, d, d, generator=gen, dtype=F64) * 0.1
    gpu = {"q": q.to(dtype).cuda(), "k": k.to(dtype).cuda(), "g": g.float().cuda(), "beta": beta.to(dtype).cuda(),
           "do": do.to(dtype).cuda(), "dht": dht.float().cuda()}
    return gpu, {name: x.double().cpu() for name, x in gpu.items()}


def _run(x, l2, q=None, k=None):
    """``(dstates, dh0)`` of the preparing inverse and the chain on ``x`` (outputs poisoned with NaN)."""
    from dsfuse.gdn.cutedsl.state_bwd import launch_state_backward
    from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse
    from dsfuse.gdn.schedule import document_order

    q = x["q"] if q is None else q
    k = x["k"] if k is None else k
    t, hv, d = x["do"].shape
    cu = [0, *itertools.accumulate(LENGTHS)]
    ci = prepare_chunk_indices(cu).to(device="cuda", dtype=torch.int32).contiguous()
    co = prepare_chunk_offsets(cu).to(device="cuda", dtype=torch.int32).contiguous()
    order = torch.tensor(document_order(cu), device="cuda", dtype=torch.int32)
    a_round = torch.empty(t, hv, 64, device="cuda", dtype=q.dtype)
    factors = torch.empty(ci.shape[0] * len(FACTORS), hv, 64, device="cuda")
    launch_ut_inverse(k, x["beta"], ci, None, use_qk_l2norm=l2, g=x["g"], g_cum=torch.empty_like(x["g"]), q=q,
                      a_round=a_round, factors=factors)
    dstates = torch.full((ci.shape[0], d, hv, d), float("nan"), device="cuda", dtype=q.dtype)
    dh0 = torch.full_like(x["dht"], float("nan"))
    launch_state_backward(q, k, x["do"], a_round, factors, ci, co, order, x["dht"], dh0, dstates, d**-0.5,
                          use_qk_l2norm=l2)
    return dstates, dh0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, l2", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, False)])
@pytest.mark.parametrize("heads", [(2, 4), (1, 3)])
def test_matches_the_float64_chain(dtype, l2, heads):
    """``round(dS')`` of every chunk and ``dh0`` against the design's float64 chain on the same rounded
    inputs: relative RMS per document and value head <= 0.008 (the contract's dh0 tolerance,
    ``dsfuse.bench.gdn.TOLERANCES``); the empty document's dh0 its dht; every output written; a
    second call, and q and k as head views of one packed row, the same bits."""
    cutedsl_or_skip()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    from test_gdn_fused_backward_algebra import state_backward_in_float64

    h, hv = heads
    x, x64 = _inputs(h, hv, dtype, l2, seed=3)
    dstates, dh0 = _run(x, l2)
    again = _run(x, l2)
    t, d = x["q"].shape[0], x["q"].shape[-1]
    row = torch.cat([x["q"].flatten(1), x["k"].flatten(1), torch.zeros(t, 8, device="cuda", dtype=dtype)], 1)
    packed = _run(x, l2, q=row[:, : h * d].view(t, h, d), k=row[:, h * d: 2 * h * d].view(t, h, d))
    torch.cuda.synchronize()
    assert not dstates.isnan().any() and not dh0.isnan().any()
    for a, b in zip((dstates, dh0), again):
        assert torch.equal(a, b)
    for a, b in zip((dstates, dh0), packed):
        assert torch.equal(a, b)

    cu = [0, *itertools.accumulate(LENGTHS)]
    want_ds, want_dh0 = state_backward_in_float64(x64["q"][None], x64["k"][None], x64["g"][None], x64["beta"][None],
                                                  d**-0.5, torch.tensor(cu), l2, x64["do"][None], x64["dht"])
    got_ds = dstates.double().cpu().permute(0, 2, 1, 3)  # [NC, HV, K, V]
    ci = prepare_chunk_indices(cu)
    for n, length in enumerate(LENGTHS):
        chunks = (ci[:, 0] == n).nonzero().flatten()
        for i_hv in range(hv):
            if length == 0:
                assert torch.equal(dh0[n, i_hv], x["dht"][n, i_hv])
                continue
            assert_rel_rms(got_ds[chunks, i_hv], want_ds[chunks, i_hv], 0.008, f"dS', document {n}, head {i_hv}")
            assert_rel_rms(dh0[n, i_hv].double().cpu(), want_dh0[n, i_hv], 0.008, f"dh0, document {n}, head {i_hv}")
