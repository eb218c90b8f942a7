"""The split of long documents inside one GPU (``dsfuse.gdn.split``): segments as extra chunk
offsets; the forward state pass (the ``E`` and ``M`` passes and the fp64 merge) against the float64
reference stages and against the unsplit pass; the backward (the ``D`` pass and the reverse merge)
against the unsplit backward; on every backend with a state pass (Triton's interpreter on the CPU)."""

import pytest
import torch
from dsfuse.gdn import schedule
from dsfuse.gdn.schedule import Gradients
from dsfuse.gdn import split as split_mod
from dsfuse.gdn.split import (RULE, Segments, SplitRule, segment_offsets, split_for, split_state_backward,
                              split_state_pass)
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


def test_each_pass_runs_only_the_segments_whose_results_are_read():
    """`split.pass_rows`: documents of 4, 1, 2 and 3 segments. Every segment's per-chunk outputs are
    written by exactly one pass, forward and in reverse; ``E`` runs where a later segment reads it,
    ``M`` only in the middle, ``D`` where an earlier segment reads it; ``3n - 4`` forward segment
    passes and ``2n - 2`` reverse ones for a document of ``n > 1`` segments, one each for a whole one."""
    segs = Segments.of([0, 4, 5, 7, 10], 1, torch.device("cpu"))
    rows = {name: [tuple(r) for r in t.tolist()] for name, t in segs.rows.items()}
    assert all(t.dtype == torch.int32 and t.shape[1:] == (2,) for t in segs.rows.values())
    assert rows["e"] == [(0, 1), (1, 0), (2, 0), (5, 1), (7, 1), (8, 0)]
    assert rows["m"] == [(1, 0), (2, 0), (8, 0)]
    assert rows["final"] == [(j, 1) for j in (1, 2, 3, 4, 6, 8, 9)]
    assert rows["d"] == [(1, 0), (2, 0), (3, 1), (6, 1), (8, 0), (9, 1)]
    assert rows["final_backward"] == [(j, 1) for j in (0, 1, 2, 4, 5, 7, 8)]
    for passes in (("e", "final"), ("d", "final_backward")):
        writers = sorted(j for name in passes for j, w in rows[name] if w)
        assert writers == list(range(len(segs.docs))), passes
    for doc, n in enumerate((4, 1, 2, 3)):
        runs = {name: sum(segs.docs[j] == doc for j, _ in found) for name, found in rows.items()}
        assert runs["e"] + runs["m"] + runs["final"] == (3 * n - 4 if n > 1 else 1)
        assert runs["d"] + runs["final_backward"] == (2 * n - 2 if n > 1 else 1)


def test_segment_rows_run_the_sequences_listed_and_write_where_asked(device, forward_stages, backward_stages):
    """A state pass (forward and reverse) with ``rows``: the sequences listed, in any order, give the
    bits of the pass over every sequence; one whose flag is 0 writes its final state (its initial-state
    gradient) but not its h and v_new (dh and dv_new); a sequence not listed is neither read nor
    written. Documents of 1, 45, 0 and 130 tokens and a tail (bf16); rows (3, writes 0), (1, writes 1).
    And the forward pass with ``u`` None: the bits of a zero ``u`` (a ``[K, K]`` state)."""
    inputs = make_inputs("docs_1_45_0_130_tail4", (2, 6), l2=True, with_h0=True, gates="model", dtype=torch.bfloat16,
                         seed=2)
    p = Prepared(inputs, True, device, torch.bfloat16)
    rows = torch.tensor([[3, 0], [1, 1]], dtype=torch.int32, device=device)
    cu, ci = inputs["cu_seqlens"], p.chunk_indices.cpu()
    chunks_of = {d: (ci[:, 0] == d).nonzero().flatten().tolist() for d in range(4)}
    gen = torch.Generator().manual_seed(6)
    do, dv_local = (torch.randn(p.u.shape, generator=gen).to(p.dtype).to(device) for _ in range(2))
    dht = torch.randn(p.h0.shape, generator=gen).to(device)

    def filled(*tensors):
        return [torch.full_like(t, 7.0) for t in tensors]

    def forward(r):
        h, v_new, ht = filled(*p.state_outputs(final=True))
        forward_stages.state(p.k, p.w, p.u, p.g_cum, p.chunk_indices, p.chunk_offsets, p.h0, h, v_new, ht,
                             use_qk_l2norm=True, rows=r)
        return h, v_new, ht

    def backward(r):
        dh, dv_new, dh0 = filled(*p.state_outputs(final=False)[:2], p.h0)
        backward_stages.state_backward(p.q, p.k, p.w, do, dv_local, p.g_cum, p.chunk_indices, p.chunk_offsets, dht,
                                       dh, dv_new, dh0, p.scale, use_qk_l2norm=True, rows=r)
        return dh, dv_new, dh0

    listed = forward(rows)
    assert_tail_zero(listed[1], p.tail, "v_new")  # the tail row still writes the tokens in no chunk
    for (states, tokens, ends), (r_states, r_tokens, r_ends) in ((forward(None), listed), (backward(None), backward(rows))):
        assert_bitwise(r_ends[[3, 1]], ends[[3, 1]], "final state / dh0 of the listed sequences")
        assert_bitwise(r_ends[[0, 2]], torch.full_like(ends[[0, 2]], 7.0), "the sequences not listed")
        assert_bitwise(r_states[chunks_of[1]], states[chunks_of[1]], "h / dh where the flag is 1")
        assert_bitwise(r_tokens[cu[1]:cu[2]], tokens[cu[1]:cu[2]], "v_new / dv_new where the flag is 1")
        unwritten = chunks_of[0] + chunks_of[3]
        assert_bitwise(r_states[unwritten], torch.full_like(states[unwritten], 7.0), "h / dh elsewhere")
        for a, b in ((cu[0], cu[1]), (cu[3], cu[4])):
            assert_bitwise(r_tokens[a:b], torch.full_like(tokens[a:b], 7.0), "v_new / dv_new elsewhere")

    dk = p.w.shape[-1]
    h0 = torch.randn(p.num_seqs, p.w.shape[1], dk, dk, generator=gen).to(device)
    maps = [torch.empty_like(h0) for _ in range(2)]
    for u, ht in zip((None, torch.zeros_like(p.w)), maps):
        forward_stages.state(p.k, p.w, u, p.g_cum, p.chunk_indices, p.chunk_offsets, h0, None, None, ht,
                             use_qk_l2norm=True)
    assert_bitwise(maps[0], maps[1], "u None against a zero u")
    assert not torch.equal(maps[0].cpu(), h0.cpu())  # the pass moved the state


# (segment chunks, dtype, layout, middle segments): two documents of 3 and 4 chunks with one between
# (segments of one chunk: 3 and 4, so one and two middle ones; of two: 2 each, no middle one; by
# SplitRule(1, above=3): only the second), and documents of 1, 1, 0 and 3 chunks (an empty one)
SPARED_CASES = [(1, "fp32", "docs_130_1_200_tail9", 3), (2, "bf16", "docs_130_1_200_tail9", 0),
                (SplitRule(1, above=3), "bf16", "docs_130_1_200_tail9", 2), (1, "bf16", "docs_1_45_0_130_tail4", 1)]


@pytest.mark.parametrize(("segment_chunks", "dtype", "layout", "middles"), SPARED_CASES,
                         ids=["1-fp32", "2-bf16", "1-above3-bf16", "1-bf16-empty-doc"])
def test_the_spared_passes_give_the_bits_of_every_segments_passes(segment_chunks, dtype, layout, middles, device,
                                                                  forward_stages, backward_stages, monkeypatch):
    """`split_state_pass` and `split_state_backward` (a launch per pass over `pass_rows`' segments,
    the maps' pass reading no ``u``) give bitwise what the same split with every pass over every
    segment gives (`split.every_segment`, the split before its passes were spared): h, v_new, the
    final states, the middle segments' maps, dh, dv_new and dh0 (documents cut into 2, 3 and 4
    segments, whole ones, an empty one, a tail). And the launches are the ones `pass_rows` names,
    the maps' with ``u`` None (none where no segment is a middle one)."""
    inputs = make_inputs(layout, (2, 6), l2=True, with_h0=True, gates="model", dtype=DTYPES[dtype], seed=7)
    p = Prepared(inputs, True, device, DTYPES[dtype])
    gen = torch.Generator().manual_seed(8)
    do, dv_local = (torch.randn(p.u.shape, generator=gen).to(p.dtype).to(device) for _ in range(2))
    dht = torch.randn(p.h0.shape, generator=gen).to(device)
    offsets = p.chunk_offsets.tolist()
    launched = []

    def state(*args, rows=None, **kwargs):
        launched.append(("state", args[2] is None, rows.tolist()))
        return forward_stages.state(*args, rows=rows, **kwargs)

    def state_backward(*args, rows=None, **kwargs):
        launched.append(("state_backward", False, rows.tolist()))
        return backward_stages.state_backward(*args, rows=rows, **kwargs)

    def run():  # (h, v_new, final states, M, dh, dv_new, dh0) in the documents' tokens
        h, v_new, ht = p.state_outputs(final=True)
        maps = {}
        split_state_pass(state, p.k, p.w, p.u, p.g_cum, p.chunk_indices, offsets, segment_chunks, p.h0, h, v_new,
                         ht, use_qk_l2norm=True, maps=maps)
        dh, dv_new, dh0 = torch.empty_like(h), torch.empty_like(v_new), torch.empty_like(p.h0)
        split_state_backward(state_backward, p.q, p.k, p.w, do, dv_local, p.g_cum, p.chunk_indices, offsets,
                             segment_chunks, maps["m"], dht, dh, dv_new, dh0, p.scale, use_qk_l2norm=True)
        return h, v_new[: p.tail], ht, maps["m"], dh, dv_new[: p.tail], dh0

    split_mod._cache.clear()  # the pass rows are made with the segment tables
    spared = run()
    segs = Segments.of(offsets, segment_chunks, p.u.device)  # the tables the passes used
    expected = [("state", True, segs.rows["m"].tolist())] if segs.rows["m"].numel() else []  # on a side stream on CUDA
    expected += [("state", False, segs.rows["e"].tolist()), ("state", False, segs.rows["final"].tolist()),
                 ("state_backward", False, segs.rows["d"].tolist()),
                 ("state_backward", False, segs.rows["final_backward"].tolist())]
    assert launched == expected
    middle = [j for j, _ in segs.rows["m"].tolist()]
    assert len(middle) == middles
    monkeypatch.setattr(split_mod, "pass_rows", split_mod.every_segment)
    split_mod._cache.clear()
    try:
        every = run()
    finally:
        split_mod._cache.clear()  # no table of every segment's rows left behind
    for name, a, b in zip(("h", "v_new", "final state", "M", "dh", "dv_new", "dh0"), spared, every):
        if name == "M":
            a, b = a[middle], b[middle]  # the only maps the spared split makes
        assert_bitwise(a, b, f"{name} against every segment's passes")


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


# (layout, segment chunks): a middle segment (the map pass on the side stream), none (no map pass:
# nothing on the side stream to join), three
GRAPH_CASES = [("docs_1_45_0_130_tail4", 1), ("docs_130_1_200_tail9", 2), ("docs_130_1_200_tail9", 1)]


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "segments"), GRAPH_CASES, ids=["one-middle", "no-middle", "three-middles"])
def test_a_split_forward_and_backward_replay_from_a_cuda_graph(layout, segments, forward_stages, backward_stages):
    """After a first eager call (which puts the segment tables on the GPU), a split forward and
    backward captured in a CUDA Graph replay bitwise equal to the eager call, with the map pass on
    its side stream or without one; a call under capture whose segments are not on the GPU is
    refused by name."""
    dev = torch.device("cuda")
    inputs = make_inputs(layout, (2, 6), l2=True, with_h0=True, gates="model", dtype=torch.bfloat16, seed=8)
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

    eager = step(segments)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(segments)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("o", "final_state", *Gradients._fields), captured, eager):
        assert_bitwise(a, b, f"{name}: graph replay against eager")
    split_mod._cache.clear()  # the segment tables gone, as before a first call
    with pytest.raises(RuntimeError, match="segments are not on the GPU yet"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step(segments)


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
