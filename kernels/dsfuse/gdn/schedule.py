"""The chunked Gated DeltaNet forward as a sequence of stages, backend-neutral.

A backend supplies its stage launchers (`ForwardStages`); the schedule allocates the
intermediates once per call and strings the stages together in the packed token layout:

1. ``cumsum``: ``g`` ``[T, HV]`` -> chunk-local cumulative gate ``g_cum`` (fp32);
2. ``wy``: the UT transform ``A = (I + L)^-1`` ``[T, HV, BT]`` and the WY representation
   ``w = A (beta exp(G) k)``, ``u = A (beta v)``;
3. ``state``: the sequential pass over each document's chunks: ``h`` (the state at every
   chunk's start) ``[NC, HV, K, V]``, ``v_new = u - w h``, the final state;
4. ``output``: ``o = scale [(q exp(G)) h + tril(q k^T Gamma) v_new]``.

The backward (`BackwardStages`, `backward_calls`) recomputes what the forward
did not keep (``w``, ``u`` from the saved ``A``; ``h``, ``v_new`` by a second state pass) and
runs, in order: ``dv_local`` (the intra-chunk part of ``v_new``'s gradient), the reverse state
pass (``dh``, the total ``dv_new``, ``dh0``), ``dqkwg`` (``dq`` and part of ``dk`` per value
head, ``dw``, the gate terms), the WY backward (the rest of ``dk``, ``dv``, ``dbeta``, ``dg``)
and ``finalize`` (``dq``, ``dk`` summed over each qk head's value heads in head order, then the
L2-norm backward). Per-value-head ``dq``, ``dk`` are fp32; nothing is accumulated atomically.

The chunk table comes from the document bounds on the host (each document chunked from its
own start): the public function reads them from ``cu_seqlens`` once and passes the list. The
device copy of a table is cached per (bounds, device), so a call whose documents were seen
before launches no copy and can be captured in a CUDA Graph.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dsfuse.gdn import split as _split
from dsfuse.gdn.reference import CHUNK_SIZE, packed_cu_seqlens, prepare_chunk_indices, prepare_chunk_offsets
from dsfuse.gdn.split import Segments, segment_maps, split_state_backward, split_state_pass


@dataclass(frozen=True)
class ForwardStages:
    """A backend's launchers of the forward stages (each writes into given outputs).

    A backend's forward table is this or another object with a ``calls`` method of the same
    signature and result (a fused forward that is not these four stages); `forward` runs either."""

    cumsum: Callable  # (g, chunk_indices, g_cum)
    wy: Callable  # (k, v, beta, g_cum, chunk_indices, A, w, u, *, use_qk_l2norm)
    state: Callable  # (k, w, u, g_cum, chunk_indices, chunk_offsets, h0, h, v_new, ht, *, use_qk_l2norm); h, v_new, ht may be None
    output: Callable  # (q, k, v_new, h, g_cum, chunk_indices, scale, o, *, use_qk_l2norm)

    def calls(self, q, k, v, g, beta, **kwargs):
        """`stage_calls` of these stages."""
        return stage_calls(self, q, k, v, g, beta, **kwargs)


@dataclass(frozen=True)
class BackwardStages:
    """A backend's launchers of the backward stages (each writes into given outputs)."""

    w_u: Callable  # (k, v, beta, g_cum, chunk_indices, A, w, u, *, use_qk_l2norm)
    state: Callable  # as ForwardStages.state
    dv_local: Callable  # (q, k, do, g_cum, chunk_indices, scale, dv_local, *, use_qk_l2norm)
    state_backward: Callable  # (q, k, w, do, dv_local, g_cum, chunk_indices, chunk_offsets, dht, dh, dv_new, dh0,
    #                            scale, *, use_qk_l2norm)
    dqkwg: Callable  # (q, k, v_new, h, dh, do, dv_new, g_cum, chunk_indices, scale, dq, dk, dw, dg, *, use_qk_l2norm)
    wy_backward: Callable  # (k, v, beta, A, g_cum, dw, du, dg_in, chunk_indices, dk, dv, dbeta, dg, *, use_qk_l2norm)
    finalize: Callable  # (q, k, dq_hv, dk_hv, dq, dk, *, use_qk_l2norm)


class StageTables(NamedTuple):
    """A backend's forward and backward as stage tables: its ``stages`` call (context parallelism's
    passes run single stages, `dsfuse.gdn.cp_local`)."""

    forward: ForwardStages
    backward: BackwardStages


class ForwardOutputs(NamedTuple):
    """``o`` ``[B, T, HV, V]``, ``final_state`` (or None), and what the backward reads: ``g_cum``
    fp32 ``[B*T, HV]`` and ``A`` fp32 ``[B*T, HV, 64]``."""

    o: torch.Tensor
    final_state: torch.Tensor | None
    g_cum: torch.Tensor
    A: torch.Tensor


class Gradients(NamedTuple):
    """``dq``, ``dk`` ``[B, T, H, K]``, ``dv`` ``[B, T, HV, V]`` (input dtype), ``dg`` fp32 and
    ``dbeta`` (beta's dtype) ``[B, T, HV]``, ``dh0`` fp32 ``[N, HV, K, V]`` (or None)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None


@dataclass(frozen=True)
class ChunkTable:
    """The chunks of a packed batch: int32 ``indices`` ``[NC, 3]`` (sequence, start, end),
    ``offsets`` ``[N + 1]`` (each sequence's first chunk), ``order`` ``[N]`` (the sequences
    longest first, `document_order`) and ``finished`` ``[NC]`` (the chunks in the order a reverse
    chain finishes them, `reverse_chain_order`), on the tensors' device."""

    indices: torch.Tensor
    offsets: torch.Tensor
    num_seqs: int
    order: torch.Tensor
    finished: torch.Tensor


def document_order(bounds: list[int]) -> list[int]:
    """The documents longest first (by chunk count; ties in document order): the order a kernel that
    walks one document per CTA starts them in, so the longest chains do not start last. A rule on
    the document lengths alone; each document's results do not depend on it."""
    chunks = [-(-(end - start) // CHUNK_SIZE) for start, end in zip(bounds, bounds[1:])]
    return sorted(range(len(chunks)), key=lambda n: (-chunks[n], n))


def reverse_chain_order(bounds: list[int]) -> list[int]:
    """The chunks in about the order in which chains that walk each document from its last chunk to
    its first, all at once, finish them: by their place from their document's end, then in
    `document_order`. Timing only (which chunks a later kernel takes up first), never a value."""
    chunks = torch.tensor([-(-(end - start) // CHUNK_SIZE) for start, end in zip(bounds, bounds[1:])],
                          dtype=torch.long)
    rank = torch.empty_like(chunks)
    rank[torch.tensor(document_order(bounds), dtype=torch.long)] = torch.arange(len(chunks))
    doc = torch.repeat_interleave(torch.arange(len(chunks)), chunks)  # each chunk's document
    place = torch.cumsum(chunks, 0)[doc] - 1 - torch.arange(len(doc))  # from the document's end
    return torch.argsort(place * max(len(chunks), 1) + rank[doc]).tolist()  # distinct keys


TABLE_CACHE_SIZE = 64
_tables: OrderedDict[tuple, ChunkTable] = OrderedDict()


def chunk_table(bounds: list[int], device: torch.device) -> ChunkTable:
    """Documents ``bounds`` (``[N + 1]`` python ints) chunked by ``CHUNK_SIZE``, on ``device``.

    Cached (least recently used, ``TABLE_CACHE_SIZE`` entries): the first call with given bounds
    copies the table to the device and waits for the copy (so any stream may read it later);
    later calls reuse it without a copy. A table first needed while a CUDA Graph is being
    captured cannot be copied: ``RuntimeError`` (call once with the same documents before the
    capture)."""
    key = (tuple(bounds), str(device))
    table = _tables.get(key)
    if table is not None:
        _tables.move_to_end(key)
        return table
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("gdn: these documents' chunk table is not on the GPU yet, and it cannot be copied while "
                           "a CUDA Graph is captured; call chunk_gdn once with the same cu_seqlens (or B, T) before "
                           "capturing")
    indices = prepare_chunk_indices(bounds, CHUNK_SIZE).to(device=device, dtype=torch.int32)
    offsets = prepare_chunk_offsets(bounds, CHUNK_SIZE).to(device=device, dtype=torch.int32)
    order = torch.tensor(document_order(bounds), dtype=torch.int32).to(device)
    finished = torch.tensor(reverse_chain_order(bounds), dtype=torch.int32).to(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    table = _tables[key] = ChunkTable(indices, offsets, len(bounds) - 1, order, finished)
    if len(_tables) > TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return table


def _split_of(bounds: list[int], segment_chunks):
    """``(rule, chunk offsets)`` of the split a call runs, or None (`dsfuse.gdn.split.split_for`)."""
    if segment_chunks is None:
        return None
    rule = _split.RULE if segment_chunks is _split.BY_RULE else segment_chunks
    return _split.split_for(tuple(bounds), rule, CHUNK_SIZE)


def stage_calls(stages: ForwardStages, q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool,
                cu_seqlens, use_qk_l2norm: bool, segment_chunks=_split.BY_RULE, save: bool = True):
    """The forward of validated inputs as ``(calls, ForwardOutputs)``: ``calls`` lists
    ``(stage name, zero-argument launch)`` in order over buffers allocated here, once; running
    them fills the outputs. ``cu_seqlens``: the document bounds (python ints) or None (``B``
    sequences of ``T``). Experiments time the calls one by one; `forward` runs them.
    ``segment_chunks``: how the state pass splits long documents (`dsfuse.gdn.split`): by default
    `dsfuse.gdn.split.RULE` (read at each call: the backward reads it again, so it must not change
    between a forward and its backward), or another `SplitRule`, a number of chunks ``n`` (documents
    of more than ``n`` chunks cut into runs of ``n``; with none that long, no split), or None (no
    split). ``save``: whether a backward will read ``g_cum`` and ``A``; without it ``ForwardOutputs.A``
    is empty (``[0, HV, 64]``), and a forward table need not write it (the stages need ``A`` for
    ``w`` and ``u`` and make it all the same)."""
    batch, tokens, heads_v, dim_v = v.shape
    dim_k = k.shape[-1]
    n = batch * tokens
    q_, k_, v_ = (t.reshape(n, *t.shape[2:]) for t in (q, k, v))  # views for the layouts the API accepts
    g_, beta_ = g.reshape(n, heads_v), beta.reshape(n, heads_v)
    bounds = packed_cu_seqlens(cu_seqlens, batch, tokens)
    table = chunk_table(bounds, v.device)
    chunks = table.indices.shape[0]
    new = functools.partial(torch.empty, device=v.device)
    g_cum = new((n, heads_v), dtype=torch.float32)
    a = new((n, heads_v, CHUNK_SIZE), dtype=torch.float32)
    w, u = new((n, heads_v, dim_k), dtype=k.dtype), new((n, heads_v, dim_v), dtype=v.dtype)
    h = new((chunks, heads_v, dim_k, dim_v), dtype=v.dtype)
    v_new, o = new((n, heads_v, dim_v), dtype=v.dtype), new((n, heads_v, dim_v), dtype=v.dtype)
    final_state = new((table.num_seqs, heads_v, dim_k, dim_v), dtype=torch.float32) if output_final_state else None
    l2 = dict(use_qk_l2norm=use_qk_l2norm)
    state_args = (k_, w, u, g_cum, table.indices)
    split = _split_of(bounds, segment_chunks)
    if split is None:
        def state():
            stages.state(*state_args, table.offsets, initial_state, h, v_new, final_state, **l2)
    else:
        rule, offsets = split

        def state():
            split_state_pass(stages.state, *state_args, offsets, rule, initial_state, h, v_new, final_state, **l2)
    calls = [
        ("cumsum", lambda: stages.cumsum(g_, table.indices, g_cum)),
        ("wy", lambda: stages.wy(k_, v_, beta_, g_cum, table.indices, a, w, u, **l2)),
        ("state", state),
        ("output", lambda: stages.output(q_, k_, v_new, h, g_cum, table.indices, scale, o, **l2)),
    ]
    return calls, ForwardOutputs(o.view(batch, tokens, heads_v, dim_v), final_state, g_cum, a if save else a[:0])


def forward(stages, q, k, v, g, beta, **kwargs) -> ForwardOutputs:
    """The forward of validated inputs ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``
    by a backend's forward table (`ForwardStages` or another with its ``calls``; keyword arguments as
    `stage_calls`)."""
    calls, outputs = stages.calls(q, k, v, g, beta, **kwargs)
    for _, launch in calls:
        launch()
    return outputs


# The backward stages the initial state's gradient ``dh0`` depends on (context parallelism runs only
# these to pass a share's incoming-state gradient back; ``recompute h`` is not among them).
DH0_STAGES = ("recompute w, u", "dv_local", "state backward")


def backward_calls(stages: BackwardStages, q, k, v, beta, g_cum, A, do, dht, *, scale: float, initial_state,
                   cu_seqlens, use_qk_l2norm: bool, dq=None, dk=None, dv=None, segment_chunks=_split.BY_RULE):
    """The backward of a forward's inputs as ``(calls, Gradients)`` (see `stage_calls`).

    ``g_cum``, ``A``: the forward's (`ForwardOutputs`); ``do`` ``[B, T, HV, V]`` (unit
    channel stride); ``dht`` fp32 ``[N, HV, K, V]`` or None (the final state's gradient);
    ``dh0`` is computed when ``initial_state`` is given. ``dq``, ``dk``, ``dv`` may be given
    (e.g. head views of one packed gradient row) and are then written in place.
    ``segment_chunks``: how both state passes split long documents, as `stage_calls` (the
    forward's, so the recomputed h has its bits)."""
    batch, tokens, heads_v, dim_v = v.shape
    heads, dim_k = k.shape[2], k.shape[3]
    n = batch * tokens
    q_, k_, v_, do_ = (t.reshape(n, *t.shape[2:]) for t in (q, k, v, do))
    beta_ = beta.reshape(n, heads_v)
    bounds = packed_cu_seqlens(cu_seqlens, batch, tokens)
    table = chunk_table(bounds, v.device)
    chunks = table.indices.shape[0]
    new = functools.partial(torch.empty, device=v.device)
    w, u = new((n, heads_v, dim_k), dtype=k.dtype), new((n, heads_v, dim_v), dtype=v.dtype)
    h, dh = (new((chunks, heads_v, dim_k, dim_v), dtype=v.dtype) for _ in range(2))
    v_new, dv_local, dv_new = (new((n, heads_v, dim_v), dtype=v.dtype) for _ in range(3))
    dq_hv, dk_hv = (new((n, heads_v, dim_k), dtype=torch.float32) for _ in range(2))
    dw = new((n, heads_v, dim_k), dtype=k.dtype)
    dg_cum, dg = new((n, heads_v), dtype=torch.float32), new((batch, tokens, heads_v), dtype=torch.float32)
    dbeta = new((batch, tokens, heads_v), dtype=beta.dtype)
    dq = new((batch, tokens, heads, dim_k), dtype=q.dtype) if dq is None else dq
    dk = new((batch, tokens, heads, dim_k), dtype=k.dtype) if dk is None else dk
    dv = new((batch, tokens, heads_v, dim_v), dtype=v.dtype) if dv is None else dv
    dh0 = None if initial_state is None else new(initial_state.shape, dtype=torch.float32)
    dq_, dk_, dv_ = dq.view(n, heads, dim_k), dk.view(n, heads, dim_k), dv.view(n, heads_v, dim_v)
    dg_, dbeta_ = dg.view(n, heads_v), dbeta.view(n, heads_v)
    ci, co = table.indices, table.offsets
    l2 = dict(use_qk_l2norm=use_qk_l2norm)
    split = _split_of(bounds, segment_chunks)
    if split is None:
        def recompute_h():
            stages.state(k_, w, u, g_cum, ci, co, initial_state, h, v_new, None, **l2)

        def state_backward():
            stages.state_backward(q_, k_, w, do_, dv_local, g_cum, ci, co, dht, dh, dv_new, dh0, scale, **l2)
    else:
        rule, offsets = split
        maps = {}  # the segments' M from the recompute of h, for the reverse merge

        def recompute_h():
            split_state_pass(stages.state, k_, w, u, g_cum, ci, offsets, rule, initial_state, h, v_new, None,
                             maps=maps, **l2)

        def state_backward():  # M from the recompute of h; made here when that did not run (DH0_STAGES only)
            if "m" not in maps:
                maps["m"] = segment_maps(stages.state, k_, w, g_cum, ci, Segments.of(offsets, rule, v.device), **l2)
            split_state_backward(stages.state_backward, q_, k_, w, do_, dv_local, g_cum, ci, offsets, rule,
                                 maps["m"], dht, dh, dv_new, dh0, scale, **l2)
    calls = [
        ("recompute w, u", lambda: stages.w_u(k_, v_, beta_, g_cum, ci, A, w, u, **l2)),
        ("recompute h", recompute_h),
        ("dv_local", lambda: stages.dv_local(q_, k_, do_, g_cum, ci, scale, dv_local, **l2)),
        ("state backward", state_backward),
        ("dqkwg", lambda: stages.dqkwg(q_, k_, v_new, h, dh, do_, dv_new, g_cum, ci, scale, dq_hv, dk_hv, dw,
                                       dg_cum, **l2)),
        ("wy backward", lambda: stages.wy_backward(k_, v_, beta_, A, g_cum, dw, dv_new, dg_cum, ci, dk_hv, dv_,
                                                   dbeta_, dg_, **l2)),
        ("finalize", lambda: stages.finalize(q_, k_, dq_hv, dk_hv, dq_, dk_, **l2)),
    ]
    return calls, Gradients(dq, dk, dv, dg, dbeta, dh0)


def backward(stages, *args, **kwargs) -> Gradients:
    """The gradients of a forward (arguments as `backward_calls`) by a backend's backward table:
    `BackwardStages`, or another object with a ``calls`` method of `backward_calls`' signature and
    result (a fused backward that is not these stages)."""
    calls, grads = (stages.calls(*args, **kwargs) if hasattr(stages, "calls")
                    else backward_calls(stages, *args, **kwargs))
    for _, launch in calls:
        launch()
    return grads
