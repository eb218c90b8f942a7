"""The split of long documents inside one GPU (``dsfuse.gdn.split``): segments as extra chunk
offsets; the forward state pass (the ``E`` and ``M`` passes and the fp64 merge) against the float64
reference stages and against the unsplit pass; the backward (the ``D`` pass and the reverse merge)
against the unsplit backward; on every backend with a state pass (Triton's interpreter on the CPU)."""

import pytest
import torch
from dsfuse.gdn import schedule
from dsfuse.gdn.schedule import Gradients
from dsfuse.gdn import split as split_mod
from dsfuse.gdn.split import RULE, Segments, SplitRule, segment_offsets, split_for, split_state_pass
from helpers import assert_bitwise, assert_rel_rms
from test_gdn_stages_state_output import DTYPES, Prepared, assert_tail_zero, make_inputs


def test_segments_follow_the_documents_chunks():
    # documents of 5, 0, 1 and 4 chunks, segments of at most 2 chunks
    bounds, docs = segment_offsets([0, 5, 5, 6, 10], 2)
    assert bounds == [0, 2, 4, 5, 5, 6, 8, 10] and docs == [0, 0, 0, 1, 2, 3, 3]
    assert segment_offsets([0, 5, 5, 6, 10], 64) == ([0, 5, 5, 6, 10], [0, 1, 2, 3])  # none split
    with pytest.raises(ValueError, match="segment_chunks"):
        segment_offsets([0, 3], 0)


def test_the_rule_splits_only_documents_over_its_threshold():
    """A rule cuts a document of more than ``above`` chunks and leaves the others whole (their bits
    then do not depend on the other documents); a call with none over it runs the unsplit passes."""
    rule = SplitRule(2, above=4)  # documents of 5, 0, 1 and 4 chunks: only the first is cut
    assert segment_offsets([0, 5, 5, 6, 10], rule) == ([0, 2, 4, 5, 5, 6, 10], [0, 0, 0, 1, 2, 3])
    assert split_for((0, 64 * 4, 64 * 4 + 1), rule, 64) is None  # 4 chunks and 1: none over 4
    assert split_for((0, 64 * 4 + 1), rule, 64) == (rule, (0, 5))
    with pytest.raises(ValueError, match="segment_chunks"):
        SplitRule(4, above=-1)
    # the rule chunk_gdn applies: 8,192-token segments of documents over 16,384 tokens
    five = (0, 8847, 11796, 22937, 28836, 32768)  # the five-document experiment's documents: none cut
    assert (RULE.segment * 64, RULE.above * 64) == (8192, 16384) and split_for(five, RULE, 64) is None
    assert split_for((0, 16384), RULE, 64) is None  # 256 chunks: not over the threshold
    for tokens, segments in ((16385, 3), (32768, 4), (131072, 16)):
        found = split_for((0, tokens), RULE, 64)
        assert len(segment_offsets(found[1], RULE)[1]) == segments
    # a threshold below the segment: a document over it but within one segment is still whole
    assert split_for((0, 64 * 5), SplitRule(10, above=3), 64) is None
    assert split_for((0, 64 * 11), SplitRule(10, above=3), 64) is not None


def test_segments_are_cached_per_documents_and_segment_size():
    """The device tables of a split are made once per (documents, segment size, device) and reused
    (what lets a split call be captured in a CUDA Graph after a first call)."""
    cpu = torch.device("cpu")
    segs = Segments.of([0, 5, 5, 6, 10], 2, cpu)
    assert Segments.of([0, 5, 5, 6, 10], 2, cpu) is segs
    assert Segments.of([0, 5, 5, 6, 10], 3, cpu) is not segs
    assert segs.offsets.tolist() == [0, 2, 4, 5, 5, 6, 8, 10] and segs.offsets.dtype == torch.int32
    assert segs.firsts.tolist() == [0, 3, 4, 5] and segs.first_docs.tolist() == [0, 1, 2, 3]
    assert segs.lasts.tolist() == [2, 3, 4, 6] and segs.last_docs.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["one_seq_T150", "docs_1_45_0_130_tail4"])
@pytest.mark.parametrize("segment_chunks", [1, 2])
def test_split_state_pass_matches_the_reference_and_the_unsplit_pass(segment_chunks, layout, dtype, device,
                                                                     forward_stages):
    """h at every chunk, v_new and the final states within the stage tests' float64 tolerance, close
    to the unsplit pass, the tail of v_new zero, and a second run bitwise equal."""
    inputs = make_inputs(layout, (2, 6), l2=True, with_h0=True, gates="model", dtype=DTYPES[dtype], seed=5)
    p = Prepared(inputs, True, device, DTYPES[dtype])
    offsets = p.chunk_offsets.tolist()

    def run():
        h, v_new, ht = p.state_outputs(final=True)
        split_state_pass(forward_stages.state, p.k, p.w, p.u, p.g_cum, p.chunk_indices, offsets, segment_chunks,
                         p.h0, h, v_new, ht, use_qk_l2norm=True)
        return h, v_new, ht

    h, v_new, ht = run()
    tol = p.tol()
    assert_rel_rms(h, p.ref.h, tol, "h")
    assert_rel_rms(v_new[: p.tail], p.ref.v_new[: p.tail], tol, "v_new")
    assert_rel_rms(ht, p.ref.final_state, tol, "final state")
    assert_tail_zero(v_new, p.tail, "v_new")
    names = ("h", "v_new", "final state")
    for name, a, b in zip(names, (h, v_new, ht), p.run_state(forward_stages)):
        assert_rel_rms(a, b, 2 * tol, f"{name} against the unsplit pass")
    for name, a, b in zip(names, (h, v_new, ht), run()):
        assert_bitwise(a, b, f"{name}: second run")
    assert not torch.equal(ht.cpu(), torch.zeros_like(ht).cpu())


def test_the_schedule_runs_the_split_state_pass(device, forward_stages):
    """`schedule.forward` with ``segment_chunks``: o and the final states close to the unsplit forward's."""
    inputs = make_inputs("docs_1_45_0_130_tail4", (2, 6), l2=True, with_h0=True, gates="model",
                         dtype=torch.float32, seed=9)
    args = {name: inputs[name].to(device) for name in ("q", "k", "v", "g", "beta")}
    kwargs = {"scale": inputs["q"].shape[-1] ** -0.5, "initial_state": inputs["initial_state"].to(device),
              "output_final_state": True, "cu_seqlens": inputs["cu_seqlens"], "use_qk_l2norm": True}
    whole = schedule.forward(forward_stages, **args, **kwargs)
    split = schedule.forward(forward_stages, **args, **kwargs, segment_chunks=1)
    assert_rel_rms(split.o, whole.o, 1e-5, "o")
    assert_rel_rms(split.final_state, whole.final_state, 1e-5, "final state")


# (segment chunks, layout, dtype): segments of one chunk and of two, one document and several
# (an empty one, one shorter than a chunk), fp32 and bf16
BACKWARD_CASES = [(1, "docs_1_45_0_130_tail4", "fp32"), (2, "one_seq_T150", "fp32"), (1, "docs_1_45_0_130_tail4", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize(("segment_chunks", "layout", "dtype"), BACKWARD_CASES, ids=["-".join(map(str, c)) for c in BACKWARD_CASES])
def test_split_backward_matches_the_unsplit_backward(segment_chunks, layout, dtype, device, forward_stages,
                                                     backward_stages):
    """`schedule.backward` with ``segment_chunks`` (the state recompute and the reverse state pass
    split, ``dS_in = D + M^T dS_out`` merged in reverse segment order): every gradient, the initial
    state's included, with a final-state gradient given, close to the unsplit backward's (the stage
    tests' tolerance: 1e-5 for fp32, 1e-2 for bf16, relative RMS), and a second run bitwise equal."""
    inputs = make_inputs(layout, (2, 6), l2=True, with_h0=True, gates="model", dtype=DTYPES[dtype], seed=11)
    p = Prepared(inputs, True, device, DTYPES[dtype])
    args = {name: inputs[name].to(DTYPES[dtype]).to(device) for name in ("q", "k", "v", "beta")}
    g, h0 = inputs["g"].float().to(device), inputs["initial_state"].to(device)
    kwargs = {"scale": p.scale, "initial_state": h0, "cu_seqlens": inputs["cu_seqlens"], "use_qk_l2norm": True}
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(args["v"].shape, generator=gen).to(DTYPES[dtype]).to(device)
    dht = torch.randn(h0.shape, generator=gen).to(device)

    def run(segments):
        fwd = schedule.forward(forward_stages, args["q"], args["k"], args["v"], g, args["beta"],
                               output_final_state=True, segment_chunks=segments, **kwargs)
        return schedule.backward(backward_stages, args["q"], args["k"], args["v"], args["beta"], fwd.g_cum, fwd.A,
                                 do, dht, segment_chunks=segments, **kwargs)

    def in_documents(grads):  # the tail's tokens (in no document) get no gradient from either
        return [x if name == "dh0" else x[:, : p.tail] for name, x in zip(grads._fields, grads)]

    whole, split = in_documents(run(None)), in_documents(run(segment_chunks))
    tol = p.tol()
    for name, a, b in zip(Gradients._fields, split, whole):
        assert_rel_rms(a, b, tol, f"{name} against the unsplit backward")
    for name, a, b in zip(Gradients._fields, split, in_documents(run(segment_chunks))):
        assert_bitwise(a, b, f"{name}: second run")


def test_split_backward_makes_its_own_maps_when_run_alone(device, forward_stages, backward_stages):
    """Context parallelism runs only the stages ``dh0`` needs (no recompute of h, which leaves the
    segments' maps behind): the split reverse pass then makes ``M`` itself, with the same bits."""
    inputs = make_inputs("one_seq_T150", (2, 6), l2=True, with_h0=True, gates="model", dtype=torch.float32, seed=4)
    args = {name: inputs[name].to(device) for name in ("q", "k", "v", "g", "beta")}
    kwargs = {"scale": inputs["q"].shape[-1] ** -0.5, "initial_state": inputs["initial_state"].to(device),
              "cu_seqlens": inputs["cu_seqlens"], "use_qk_l2norm": True}
    fwd = schedule.forward(forward_stages, **args, output_final_state=True, segment_chunks=1, **kwargs)
    do = torch.randn(args["v"].shape, generator=torch.Generator().manual_seed(5)).to(device)
    common = (backward_stages, args["q"], args["k"], args["v"], args["beta"], fwd.g_cum, fwd.A, do, None)
    calls, grads = schedule.backward_calls(*common, segment_chunks=1, **kwargs)
    for _, launch in calls:
        launch()
    alone, alone_grads = schedule.backward_calls(*common, segment_chunks=1, **kwargs)
    for name, launch in alone:
        if name in schedule.DH0_STAGES:
            launch()
    assert_bitwise(alone_grads.dh0, grads.dh0, "dh0 with the maps made by the reverse pass")


@pytest.mark.gpu
def test_a_split_forward_and_backward_replay_from_a_cuda_graph(forward_stages, backward_stages):
    """After a first eager call (which puts the segment tables on the GPU), a split forward and
    backward captured in a CUDA Graph replay bitwise equal to the eager call; a first call under
    capture is refused by name."""
    dev = torch.device("cuda")
    inputs = make_inputs("docs_1_45_0_130_tail4", (2, 6), l2=True, with_h0=True, gates="model", dtype=torch.bfloat16,
                         seed=8)
    args = [inputs[name].to(torch.float32 if name == "g" else torch.bfloat16).to(dev)  # the data bf16, g fp32
            for name in ("q", "k", "v", "g", "beta")]
    kwargs = {"scale": inputs["q"].shape[-1] ** -0.5, "initial_state": inputs["initial_state"].to(dev),
              "cu_seqlens": inputs["cu_seqlens"], "use_qk_l2norm": True}
    do = torch.randn(args[2].shape, device=dev).to(torch.bfloat16)

    def step(segments):
        fwd = schedule.forward(forward_stages, *args, output_final_state=True, segment_chunks=segments, **kwargs)
        grads = schedule.backward(backward_stages, args[0], args[1], args[2], args[4], fwd.g_cum, fwd.A, do, None,
                                  segment_chunks=segments, **kwargs)
        return (fwd.o, fwd.final_state, *grads)

    eager = step(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(1)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("o", "final_state", *Gradients._fields), captured, eager):
        assert_bitwise(a, b, f"{name}: graph replay against eager")
    with pytest.raises(RuntimeError, match="segments are not on the GPU yet"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step(2)  # cuts the 3-chunk document: segments not made before (3 would cut none: no split)


def _chunk_gdn_case(device, dtype=torch.float32):
    """Documents of 1, 330 (6 chunks) and 130 tokens with an initial state, K = V = 16."""
    from dsfuse.gdn import gdn_gates

    gen = torch.Generator().manual_seed(21)
    t, h, hv, d = 461, 2, 6, 16
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g, beta = gdn_gates(randn(1, t, hv), randn(1, t, hv), torch.rand(hv, generator=gen) * 3, randn(hv))
    x = {"q": randn(1, t, h, d), "k": randn(1, t, h, d), "v": randn(1, t, hv, d), "beta": beta}
    x = {name: a.to(device=device, dtype=dtype) for name, a in x.items()}
    x["g"] = g.float().to(device)
    x["cu_seqlens"] = torch.tensor([0, 1, 331, 461], dtype=torch.int32)
    x["initial_state"] = torch.randn(3, hv, d, d, generator=gen).to(device)
    return x


@pytest.mark.slow
@pytest.mark.serves("stages")  # the backends whose forward has a state pass to split
def test_chunk_gdn_splits_by_the_rule(device, backend, monkeypatch):
    """`chunk_gdn` applies `split.RULE` (here 2-chunk segments of documents over 3 chunks, so the
    6-chunk document is cut and the others stay whole): o, the final states and every gradient close
    to the unsplit call's, the whole documents' o and final states bitwise equal to it, the forward
    bitwise equal with and without autograd, and a second run bitwise equal."""
    from dsfuse.gdn import chunk_gdn

    x = _chunk_gdn_case(device)

    def run(rule, grad):
        monkeypatch.setattr(split_mod, "RULE", rule)
        inputs = {name: a.clone().requires_grad_(grad and a.is_floating_point()) for name, a in x.items()}
        with torch.set_grad_enabled(grad):
            o, ht = chunk_gdn(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend)
        if not grad:
            return o, ht, None
        gen = torch.Generator().manual_seed(8)
        (o * torch.randn(o.shape, generator=gen).to(device)).sum().backward(
            inputs=[inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state")])
        return o.detach(), ht.detach(), [inputs[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")]

    never = SplitRule(10**6)
    rule = SplitRule(2, above=3)
    passes = []  # the split passes the schedule ran, with their rules
    real, real_back = schedule.split_state_pass, schedule.split_state_backward
    monkeypatch.setattr(schedule, "split_state_pass", lambda *a, **k: passes.append(("state", a[7])) or real(*a, **k))
    monkeypatch.setattr(schedule, "split_state_backward",
                        lambda *a, **k: passes.append(("reverse", a[9])) or real_back(*a, **k))
    whole = run(never, True)
    assert passes == []
    split = run(rule, True)
    # the forward's state pass, the backward's recompute of h and its reverse pass
    assert passes == [("state", rule), ("state", rule), ("reverse", rule)]
    assert_rel_rms(split[0], whole[0], 1e-5, "o against the unsplit call")
    assert_rel_rms(split[1], whole[1], 1e-5, "final states against the unsplit call")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), split[2], whole[2]):
        assert_rel_rms(a, b, 1e-5, f"{name} against the unsplit call")
    for doc, (t0, t1) in ((0, (0, 1)), (2, (331, 461))):  # documents under the threshold: unsplit, bit for bit
        assert_bitwise(split[0][:, t0:t1], whole[0][:, t0:t1], f"o of document {doc}")
        assert_bitwise(split[1][doc], whole[1][doc], f"final state of document {doc}")
    no_grad = run(rule, False)
    assert_bitwise(no_grad[0], split[0], "o without autograd")
    assert_bitwise(no_grad[1], split[1], "final states without autograd")
    again = run(rule, True)
    for name, a, b in zip(("o", "final states", *("dq", "dk", "dv", "dg", "dbeta", "dh0")),
                          (again[0], again[1], *again[2]), (split[0], split[1], *split[2])):
        assert_bitwise(a, b, f"{name}: second run")
