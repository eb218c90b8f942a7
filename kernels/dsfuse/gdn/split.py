"""The exact split of long documents inside one GPU, for the state passes of the forward and the
backward, as designed in ``experiments/gdn/notes/long-document-split.md``. `chunk_gdn` applies
`RULE` (through `dsfuse.gdn.schedule.stage_calls` and `dsfuse.gdn.schedule.backward_calls`, whose
``segment_chunks`` may name another rule, a number of chunks, or None for no split).

A rule (`SplitRule`) reads the documents' lengths alone: a document of more than ``above`` chunks
is cut into segments of ``segment`` chunks, the others stay whole (a call with no document of more
than ``max(above, segment)`` chunks runs the unsplit passes). Segments are more chunk offsets over
the same chunk table, so every other stage is unchanged. Per value head a segment maps the state
at its start to the state at its end as ``S_out = M S_in + E`` (`dsfuse.gdn.cp`'s algebra).

Forward (`split_state_pass`):

1. ``E``: the state pass over every segment but a document's last, from the document's initial
   state for its first segment and from zero for the others (their final states). A first segment
   starts from its true state, so this pass is its final one: it writes its ``h`` and ``v_new``; the
   others write nothing per chunk;
2. ``M``: the same pass with ``u = 0`` from the identity, a ``[K, K]`` state, over the middle
   segments only (`segment_maps`; only the maps written): a first segment's ``E`` already holds its
   initial state, and a last segment's maps feed no later segment. On a GPU it runs beside ``E`` on
   a side stream (`MAPS_BESIDE`), their chains sharing the SMs; elsewhere before it;
3. the merge in segment order, in fp64, each step rounded once to fp32: ``S_in`` of every segment;
4. the state pass over every segment but a split document's first, from ``S_in``: ``h``, ``v_new``
   and, from each document's last segment, its final state.

Backward (`split_state_backward`), mirrored: ``dS_in = D + M^T dS_out`` per segment:

1. ``D``: the reverse state pass over every segment but a document's first, from the final state's
   gradient for its last segment (then its final reverse pass: it writes ``dh`` and ``dv_new``) and
   from zero for the others (their initial-state gradients);
2. the merge in reverse segment order, in fp64, each step rounded once to fp32: ``dS_out`` of every
   segment (a segment's ``dS_out`` is the next one's ``dS_in``);
3. the reverse state pass over every segment but a split document's last, from ``dS_out``: ``dh``,
   ``dv_new`` and, from each document's first segment, its initial state's gradient.

With the true ``S_in`` and ``dS_out`` of every segment, a segment's passes are exactly the
document's, chunk for chunk. A document of ``n > 1`` segments takes ``3n - 4`` segment passes
forward (``n - 1`` for ``E``, ``n - 2`` maps, ``n - 1`` from ``S_in``) and ``2n - 2`` in reverse,
in at most three launches and two, each of independent chains (`pass_rows` lists which segments
each pass runs and which of them write). Deterministic: fixed segments (from the lengths and the rule
alone, not the SM count or grad mode) and a fixed merge order; every segment's outputs are computed
from the same state by the same kernel whichever pass writes them (bitwise what the passes over every
segment give, `every_segment`: checked in the interpreter; on a GPU the passes are compiled variants
of one kernel, checked by the same test's GPU cases). The segment tables are cached on
the device like the chunk table (`Segments.of`), so a call can be captured in a CUDA Graph after a
first call with the same documents."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitRule:
    """Which documents are split, from their lengths alone: one of more than ``above`` chunks is cut
    into runs of ``segment`` chunks (the last one shorter); the others stay whole, so their bits do
    not depend on the other documents of the call."""

    segment: int
    above: int = 0

    def __post_init__(self):
        if self.segment < 1 or self.above < 0:
            raise ValueError(f"segment_chunks: expected a positive number of chunks (and a threshold of at least 0), "
                             f"got {self.segment} (above {self.above})")


# The rule `chunk_gdn` applies: documents of more than 16,384 tokens in segments of 8,192 (the
# constants of experiments/gdn/notes/long-document-split.md, to be measured).
RULE = SplitRule(segment=128, above=256)
BY_RULE = object()  # the default of the schedule's ``segment_chunks``: `RULE`, read at call time


def as_rule(split: int | SplitRule) -> SplitRule:
    """``split`` as a rule: a number of chunks ``n`` cuts every document of more than ``n`` chunks
    into runs of ``n`` (``SplitRule(n)``)."""
    return split if isinstance(split, SplitRule) else SplitRule(split)


def segment_offsets(offsets: list[int], split: int | SplitRule) -> tuple[list[int], list[int]]:
    """``(segment chunk offsets [S + 1], document of each segment [S])`` of documents' chunk offsets
    ``[N + 1]``: each document the rule splits in runs of its ``segment`` chunks, the others (and an
    empty document: its final state is its initial state) one segment each."""
    rule = as_rule(split)
    bounds, docs = [offsets[0]], []
    for n in range(len(offsets) - 1):
        c0, c1 = offsets[n], offsets[n + 1]
        step = rule.segment if c1 - c0 > rule.above else max(c1 - c0, 1)
        for start in range(c0, max(c1, c0 + 1), step):
            bounds.append(min(start + step, c1))
            docs.append(n)
    return bounds, docs


@functools.lru_cache(maxsize=256)
def split_for(bounds: tuple[int, ...], split: int | SplitRule,
              chunk: int) -> tuple[SplitRule, tuple[int, ...]] | None:
    """``(rule, chunk offsets)`` when ``split`` cuts some document of token ``bounds`` (chunks of
    ``chunk`` tokens: one of more than ``max(above, segment)`` chunks), else None: every document
    whole, the unsplit passes. Cached: the offsets are a tuple, shared by every caller."""
    rule = as_rule(split)
    offsets = [0]
    for a, b in itertools.pairwise(bounds):
        offsets.append(offsets[-1] + -(-(b - a) // chunk))
    cut = any(c1 - c0 > max(rule.above, rule.segment) for c0, c1 in itertools.pairwise(offsets))
    return (rule, tuple(offsets)) if cut else None


CACHE_SIZE = 64
_cache: OrderedDict[tuple, Segments] = OrderedDict()


@dataclass(frozen=True)
class Segments:
    """The segments of a call on the device: chunk ``offsets`` ``[S + 1]`` (int32), each segment's
    document (``docs``, python ints), which segments open and close their document (``first``,
    ``last``, python bools), as index tensors the opening segments and their documents (``firsts``,
    ``first_docs``) and the closing ones (``lasts``, ``last_docs``), and the rows of each pass
    (`pass_rows`: int32 ``[P, 2]``, a segment and whether the pass writes its per-chunk outputs)."""

    offsets: torch.Tensor
    docs: list[int]
    first: list[bool]
    last: list[bool]
    firsts: torch.Tensor
    first_docs: torch.Tensor
    lasts: torch.Tensor
    last_docs: torch.Tensor
    rows: dict[str, torch.Tensor]

    @classmethod
    def of(cls, chunk_offsets: list[int], segment_chunks: int | SplitRule, device: torch.device) -> Segments:
        """The segments of documents with chunk offsets ``chunk_offsets``, on ``device``. Cached as
        `dsfuse.gdn.schedule.chunk_table` is (least recently used, ``CACHE_SIZE`` entries; the first
        call copies and waits, later ones copy nothing), so a split call can be captured in a CUDA
        Graph once the same documents were called before; a first call under capture is refused."""
        key = (tuple(chunk_offsets), as_rule(segment_chunks), str(device))
        if (hit := _cache.get(key)) is not None:
            _cache.move_to_end(key)
            return hit
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gdn: these documents' segments are not on the GPU yet, and they cannot be copied "
                               "while a CUDA Graph is captured; make the same call once before capturing")
        bounds, docs = segment_offsets(chunk_offsets, segment_chunks)
        n = len(docs)
        first = [j == 0 or docs[j] != docs[j - 1] for j in range(n)]
        last = [j + 1 == n or docs[j + 1] != docs[j] for j in range(n)]
        opening, closing = [j for j in range(n) if first[j]], [j for j in range(n) if last[j]]

        def on_device(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        rows = {name: on_device(found, torch.int32).view(-1, 2) for name, found in pass_rows(first, last).items()}
        segs = cls(torch.tensor(bounds, dtype=torch.int32, device=device), docs, first, last,
                   on_device(opening), on_device([docs[j] for j in opening]),
                   on_device(closing), on_device([docs[j] for j in closing]), rows)
        if device.type == "cuda":
            _side_stream(device)  # made here, outside any capture, for the split passes to come
            torch.cuda.current_stream(device).synchronize()
        _cache[key] = segs
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
        return segs


def pass_rows(first: list[bool], last: list[bool]) -> dict[str, list[tuple[int, int]]]:
    """``(segment, writes)`` of each pass of the split, from which segments open (``first``) and close
    (``last``) their document. A document's first segment starts from its true initial state and its
    last from the true final-state gradient, so their first pass is their last one:

    * ``"e"``: every segment but a document's last, from the document's initial state (its first) or
      zero; a first segment writes ``h`` and ``v_new`` (its final pass), the others only ``E``;
    * ``"m"``: the middle segments (neither first nor last), the map ``M`` alone (a first segment's
      ``E`` holds its initial state; a last segment's maps feed no later one);
    * ``"final"``: every segment but a split document's first, from the merged initial state;
    * ``"d"``: every segment but a document's first, from the final state's gradient (its last) or
      zero; a last segment writes ``dh`` and ``dv_new`` (its final reverse pass), the others only ``D``;
    * ``"final_backward"``: every segment but a split document's last, from the merged gradient.

    A whole document (first and last) runs only in the final passes. At ``n`` segments a document
    takes ``3n - 4`` forward segment passes and ``2n - 2`` reverse ones."""
    n = len(first)
    mid = [not first[j] and not last[j] for j in range(n)]
    return {
        "e": [(j, int(first[j])) for j in range(n) if not last[j]],
        "m": [(j, 0) for j in range(n) if mid[j]],
        "final": [(j, 1) for j in range(n) if last[j] or not first[j]],
        "d": [(j, int(last[j])) for j in range(n) if not first[j]],
        "final_backward": [(j, 1) for j in range(n) if first[j] or not last[j]],
    }


def every_segment(first: list[bool], last: list[bool]) -> dict[str, list[tuple[int, int]]]:
    """`pass_rows` without sparing: every pass over every segment, only the final passes writing (the
    split as it ran before; the tests' reference and the GPU probe's baseline, put in its place)."""
    every = range(len(first))
    return {"e": [(j, 0) for j in every], "m": [(j, 0) for j in every], "final": [(j, 1) for j in every],
            "d": [(j, 0) for j in every], "final_backward": [(j, 1) for j in every]}


# Whether the forward's map pass runs beside its E pass on a side stream (CUDA only, where some
# segment needs a map), their chains sharing the SMs, rather than before it on the same stream. The
# same bits either way (independent passes).
MAPS_BESIDE = True


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The map pass's side stream, one per device (one of PyTorch's pooled streams, as the CuTe DSL
    forward's side streams are: other work drawing the same one only waits longer). `Segments.of`
    makes it with a device's first segment tables, where a CUDA Graph capture is refused."""
    return torch.cuda.Stream(device)


def segment_maps(state: Callable, k, w, g_cum, chunk_indices, segs: Segments, *, use_qk_l2norm: bool,
                 stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """``M`` fp32 ``[S, HV, K, K]``: each middle segment's linear map of its initial state to its final
    state (`pass_rows` ``"m"``; the other segments' entries are not written), the state pass with
    ``u = 0`` (no zero tensor read) from the identity. ``stream``: the pass launched there, after the
    current stream's work so far (the caller waits for it before reading ``M``)."""
    segments, heads_v, dim_k = len(segs.docs), w.shape[1], w.shape[2]
    dev = w.device
    m = torch.empty(segments, heads_v, dim_k, dim_k, device=dev)
    rows = segs.rows["m"]
    if not rows.shape[0]:
        return m
    eye = torch.eye(dim_k, device=dev).expand(segments, heads_v, dim_k, dim_k).contiguous()
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(dev))
        eye.record_stream(stream)  # allocated on the current stream, read on the side one
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        state(k, w, None, g_cum, chunk_indices, segs.offsets, eye, None, None, m, use_qk_l2norm=use_qk_l2norm,
              rows=rows)
    return m


def split_state_pass(state: Callable, k, w, u, g_cum, chunk_indices, offsets: list[int],
                     segment_chunks: int | SplitRule, initial_state, h, v_new, final_state, *,
                     use_qk_l2norm: bool, maps: dict | None = None) -> None:
    """A backend's state pass (``ForwardStages.state``) over documents with chunk offsets
    ``offsets`` (python ints), run segment-wise as the module docstring says; writes ``h``,
    ``v_new`` and ``final_state`` (if given) as the unsplit pass does. ``maps``: a dict that
    receives the segments' ``M`` under ``"m"`` (the backward's merge reads it)."""
    segs = Segments.of(offsets, segment_chunks, u.device)
    segments, heads_v, dim_k, dim_v = len(segs.docs), u.shape[1], w.shape[2], u.shape[2]
    new = functools.partial(torch.empty, device=u.device)
    l2 = {"use_qk_l2norm": use_qk_l2norm}

    h0 = torch.zeros(segments, heads_v, dim_k, dim_v, device=u.device)
    if initial_state is not None:
        h0[segs.firsts] = initial_state[segs.first_docs].float()
    e = new((segments, heads_v, dim_k, dim_v), dtype=torch.float32)
    beside = MAPS_BESIDE and u.device.type == "cuda" and segs.rows["m"].shape[0]  # a launch to join
    side = _side_stream(u.device) if beside else None
    m = segment_maps(state, k, w, g_cum, chunk_indices, segs, stream=side, **l2)  # beside E, on CUDA
    if segs.rows["e"].shape[0]:  # E; a document's first segment also its h and v_new
        state(k, w, u, g_cum, chunk_indices, segs.offsets, h0, h, v_new, e, rows=segs.rows["e"], **l2)
    if side is not None:
        torch.cuda.current_stream(u.device).wait_stream(side)
    if maps is not None:
        maps["m"] = m

    s_in = h0.clone()
    for j in range(1, segments):  # in segment order; a document's first segment keeps its h0
        if not segs.first[j]:
            carried = e[j - 1].double()
            if not segs.first[j - 1]:
                carried = carried + m[j - 1].double() @ s_in[j - 1].double()
            s_in[j] = carried.float()

    ht = None if final_state is None else new((segments, heads_v, dim_k, dim_v), dtype=torch.float32)
    state(k, w, u, g_cum, chunk_indices, segs.offsets, s_in, h, v_new, ht, rows=segs.rows["final"], **l2)
    if final_state is not None:
        final_state.copy_(ht[segs.lasts])


def split_state_backward(state_backward: Callable, q, k, w, do, dv_local, g_cum, chunk_indices, offsets: list[int],
                         segment_chunks: int | SplitRule, m: torch.Tensor, dht, dh, dv_new, dh0, scale: float, *,
                         use_qk_l2norm: bool) -> None:
    """A backend's reverse state pass (``BackwardStages.state_backward``) over documents with chunk
    offsets ``offsets``, run segment-wise as the module docstring says, with ``m`` the segments'
    maps (`segment_maps`, or the forward split's); writes ``dh``, ``dv_new`` and ``dh0`` (if given)
    as the unsplit pass does."""
    segs = Segments.of(offsets, segment_chunks, dv_new.device)
    segments, heads_v, dim_k, dim_v = len(segs.docs), dv_new.shape[1], w.shape[2], dv_new.shape[2]
    l2 = {"use_qk_l2norm": use_qk_l2norm}

    d_out = torch.zeros(segments, heads_v, dim_k, dim_v, device=dv_new.device)
    if dht is not None:
        d_out[segs.lasts] = dht[segs.last_docs].float()
    d_in = torch.empty_like(d_out)
    if segs.rows["d"].shape[0]:  # D; a document's last segment also its dh and dv_new
        state_backward(q, k, w, do, dv_local, g_cum, chunk_indices, segs.offsets, d_out, dh, dv_new, d_in, scale,
                       rows=segs.rows["d"], **l2)

    for j in range(segments - 2, -1, -1):  # in reverse segment order; a document's last segment keeps its dht
        if not segs.last[j]:
            d_out[j] = d_in[j + 1]
            if not segs.first[j]:  # a first segment's dS_in is the final pass's dh0
                d_in[j] = (d_in[j].double() + m[j].double().transpose(-1, -2) @ d_out[j].double()).float()

    seg_dh0 = None if dh0 is None else torch.empty_like(d_out)
    state_backward(q, k, w, do, dv_local, g_cum, chunk_indices, segs.offsets, d_out, dh, dv_new, seg_dh0, scale,
                   rows=segs.rows["final_backward"], **l2)
    if dh0 is not None:
        dh0.copy_(seg_dh0[segs.firsts])
