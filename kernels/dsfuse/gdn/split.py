"""The exact split of long documents inside one GPU, for the forward's state pass: a first stage of
the design in ``experiments/gdn/notes/long-document-split.md`` (forward only, opt-in through
``segment_chunks`` of `dsfuse.gdn.schedule.stage_calls`; no rule picks it yet, `chunk_gdn` never
does).

Each document's chunks are cut into segments of at most ``segment_chunks`` chunks: more chunk
offsets over the same chunk table, so every other stage is unchanged. Per value head a segment maps
the state at its start to the state at its end as ``S_out = M S_in + E`` (`dsfuse.gdn.cp`'s algebra):

1. ``E``: the state pass over the segments, from the document's initial state for its first segment
   and from zero for the others (their final states);
2. ``M``: the same pass with ``u = 0`` from the identity, a ``[K, K]`` state;
3. the merge in segment order, in fp64, each step rounded once to fp32: ``S_in`` of every segment;
4. the state pass over the segments from ``S_in``: ``h``, ``v_new`` and, from each document's last
   segment, its final state.

Three passes instead of one, each with ``segments x HV`` independent chains. Deterministic: fixed
segments (from the lengths and ``segment_chunks`` alone) and a fixed merge order. Each call copies
its small segment tables to the device, so it cannot be captured in a CUDA Graph yet."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def segment_offsets(offsets: list[int], segment_chunks: int) -> tuple[list[int], list[int]]:
    """``(segment chunk offsets [S + 1], document of each segment [S])`` of documents' chunk offsets
    ``[N + 1]``: each document's chunks in runs of at most ``segment_chunks``, an empty document one
    empty segment (its final state is its initial state)."""
    if segment_chunks < 1:
        raise ValueError(f"segment_chunks: expected a positive number of chunks, got {segment_chunks}")
    bounds, docs = [offsets[0]], []
    for n in range(len(offsets) - 1):
        c0, c1 = offsets[n], offsets[n + 1]
        for start in range(c0, max(c1, c0 + 1), segment_chunks):
            bounds.append(min(start + segment_chunks, c1))
            docs.append(n)
    return bounds, docs


def split_state_pass(state: Callable, k, w, u, g_cum, chunk_indices, offsets: list[int], segment_chunks: int,
                     initial_state, h, v_new, final_state, *, use_qk_l2norm: bool) -> None:
    """A backend's state pass (``ForwardStages.state``) over documents with chunk offsets
    ``offsets`` (python ints), run segment-wise as the module docstring says; writes ``h``,
    ``v_new`` and ``final_state`` (if given) as the unsplit pass does."""
    bounds, docs = segment_offsets(offsets, segment_chunks)
    segments, heads_v, dim_k, dim_v = len(docs), u.shape[1], w.shape[2], u.shape[2]
    dev = u.device
    new = functools.partial(torch.empty, device=dev)
    seg_co = torch.tensor(bounds, dtype=torch.int32, device=dev)
    first = [j == 0 or docs[j] != docs[j - 1] for j in range(segments)]
    doc_of = torch.tensor(docs, dtype=torch.long, device=dev)
    l2 = {"use_qk_l2norm": use_qk_l2norm}

    h0 = torch.zeros(segments, heads_v, dim_k, dim_v, device=dev)
    if initial_state is not None:
        starts = torch.tensor([j for j in range(segments) if first[j]], dtype=torch.long, device=dev)
        h0[starts] = initial_state[doc_of[starts]].float()
    e = new((segments, heads_v, dim_k, dim_v), dtype=torch.float32)
    state(k, w, u, g_cum, chunk_indices, seg_co, h0, h, v_new, e, **l2)

    eye = torch.eye(dim_k, device=dev).expand(segments, heads_v, dim_k, dim_k).contiguous()
    m = new((segments, heads_v, dim_k, dim_k), dtype=torch.float32)
    u0 = torch.zeros(u.shape[0], heads_v, dim_k, dtype=u.dtype, device=dev)
    state(k, w, u0, g_cum, chunk_indices, seg_co, eye, new((h.shape[0], heads_v, dim_k, dim_k), dtype=h.dtype),
          torch.empty_like(u0), m, **l2)

    s_in = h0.clone()
    for j in range(1, segments):  # in segment order; a document's first segment keeps its h0
        if not first[j]:
            carried = e[j - 1].double()
            if not first[j - 1]:
                carried = carried + m[j - 1].double() @ s_in[j - 1].double()
            s_in[j] = carried.float()

    ht = None if final_state is None else new((segments, heads_v, dim_k, dim_v), dtype=torch.float32)
    state(k, w, u, g_cum, chunk_indices, seg_co, s_in, h, v_new, ht, **l2)
    if final_state is not None:
        lasts = [j for j in range(segments) if j + 1 == segments or docs[j + 1] != docs[j]]
        lasts = torch.tensor(lasts, dtype=torch.long, device=dev)
        final_state.copy_(ht[lasts])
