"""The CuTe DSL backend's forward as `chunk_gdn` runs it: the UT inverse, then the fused per-head kernel.

Two launches per call (`dsfuse.gdn.schedule.forward` runs them; more in stages or pieces, below):
``ut_inverse`` writes, for every chunk, the gated ``A = A0 * Gamma`` (fp32) and the chunk-local
cumulative gate ``g_cum`` (`dsfuse.gdn.cutedsl.ut_inverse`, its gating form; on sm_90a its preparing form, which also writes
``round(A)`` in the input dtype and the rows' factors for the fused kernel); ``fused`` reads them
and walks each (document, value head) chain with the state on chip (``gated``: on sm_90a the role-split
``head_rs`` form of `dsfuse.gdn.cutedsl.fused_fwd_rs` at V = 128 (``head_ws`` of
`dsfuse.gdn.cutedsl.fused_fwd_ws` at other V and on halves of V = 128, `column_parts`), the ``head`` form of
`dsfuse.gdn.cutedsl.fused_fwd_head` elsewhere). Its outputs are `dsfuse.gdn.schedule.ForwardOutputs`:
where the backend's fused backward serves the call (`dsfuse.gdn.cutedsl.backward.serves`), ``A`` is
the buffer that backward reads (the chain kernel saves the states into it); elsewhere ``A`` and
``g_cum`` are what the Triton backward stages read, as the Triton stages make them
(`dsfuse.gdn.cutedsl.TABLE`).

In a CUDA Graph capture the launches overlap where the GPU has room (`stages`, `OVERLAP`): the
inverse of the longest documents first, then their chains on side streams while the inverse of the
others runs, so the longest chain, which sets the forward's time when the value heads are few,
starts early. A call of one document runs its chain in pieces instead (`pieces`), each after its
own chunks' inverse, the next piece's inverse beside it, in eager calls too (on the H200 that took
an eager forward of one document of 32,768 tokens about as low as its CUDA Graph replay:
`experiments/gdn/raw/column-split/20261204-201625-h200-long-forward-probe`). Where the chains are
few and no stage of a capture's plan leads, each value head's chain is walked by two CTAs, each half
of its channels (`chain_parts`, `column_parts`: then on the ``head_ws`` form at 64 channels, not
``head_rs``; eager calls follow the capture's plan, so they compile what a capture launches).
Every chunk is computed as in one pair of launches (the same bits); only the start times and the
CTAs change. An eager call of several documents keeps the one pair (`Overlap.eager`); ``Overlap(0)``
turns the pieces off too.

What the fused kernel does not do, and so this forward does not: split long documents
(`dsfuse.gdn.split`, whose segments need a separate state pass; ``segment_chunks`` is accepted and
has no effect here: each document is one chain) or context parallelism's passes (the backend does not
serve the ``stages`` call; ``auto`` takes the Triton stages for a ``cp_group`` call).
"""

from __future__ import annotations

import collections
import functools
import itertools
from dataclasses import dataclass

import torch

from dsfuse._common import cutedsl as _cd
from dsfuse.gdn import schedule
from dsfuse.gdn.cutedsl import backward as _backward
from dsfuse.gdn.cutedsl import fused_fwd, fused_fwd_head, ut_inverse
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS
from dsfuse.gdn.reference import CHUNK_SIZE, packed_cu_seqlens


def form_of(device: torch.device, dim_v: int) -> str:
    """The per-head form the backend runs on ``device`` for value heads of ``dim_v`` channels: where
    wgmma exists (sm_90a), ``head_rs`` (warpgroups by role, the state kept transposed, every product
    of its chain taking A from registers) at V = 128, ``head_ws`` (the same roles, the state in shared
    memory) at other V; ``head`` (``mma.sync``) elsewhere. ``head_rs`` and ``head_ws`` give the bits of
    ``head_wgmma`` (GPU tests), ``head`` its own (the same contract)."""
    if _cd.arch_of(device) not in fused_fwd.ARCHS["head_ws"]:
        return "head"
    return "head_rs" if dim_v == 128 else "head_ws"


@dataclass(frozen=True)
class Overlap:
    """How `stages` overlaps the inverse with the chains: at most ``leads`` lead stages, and their
    chains (one CTA an SM: value heads x lead documents) on at most ``share`` of the SMs, the rest
    left to the inverse of the later stages. ``Overlap(0)``: one stage, the inverse then the chains.
    ``eager``: overlap in calls outside a CUDA Graph capture too; off by default, because on the H200
    at (16, 32) the overlapped eager call was slower than the plain one (docs/ops/gdn_forward.md,
    step 19; not profiled: likely the host's time for the extra launches and their checks, which an
    eager GPU waits for). The default is the best of those measured at the experiment's shapes on the H200.
    A sole document's chain pieces (`pieces`) are not stages: they run in eager calls too whatever
    ``eager`` says, and ``leads = 0`` (``Overlap(0)``) turns them off with the stages."""

    leads: int = 3
    share: float = 1.0
    eager: bool = False

    def __post_init__(self):
        if self.leads < 0 or not 0 < self.share <= 1:
            raise ValueError(f"Overlap: leads >= 0 and 0 < share <= 1, got {self.leads} and {self.share}")


OVERLAP = Overlap()  # the forward's (read at each call; the outputs' bits do not depend on it)


def stages(bounds: list[int], value_heads: int, sms: int, overlap: Overlap = OVERLAP) -> list[tuple]:
    """The forward's launch stages of documents ``bounds`` (``[N + 1]`` python ints): ``(first, end,
    runs)`` each, the documents ``document_order(bounds)[first:end]`` (longest first) whose chunk rows
    are the runs ``[c0, c1)`` of the chunk table, in launch order (the last stage takes the rest).

    Every stage's inverse runs on the caller's stream in stage order; a lead stage's chains then run
    on a side stream of their own, the last stage's on the caller's stream after its inverse. Lead
    stages are one document each, the longest first: at most ``overlap.leads``, while all leads'
    chains fit ``overlap.share`` of the ``sms`` SMs and each lead is longer (in chunks) than every
    document after the leads (equal lengths gain nothing from an early start). A rule on the lengths,
    the head count and the SM count: the outputs are the same bits under any stages.

    No lead where the chains are bound by throughput rather than by the longest one (all chunks of
    every value head, spread over the SMs, at least the longest document's chunks): an early start
    then only takes SMs from the inverse."""
    chunks = [-(-(end - start) // CHUNK_SIZE) for start, end in itertools.pairwise(bounds)]
    order = schedule.document_order(bounds)
    leads = 0
    while (leads < min(overlap.leads, len(order) - 1) and value_heads * sum(chunks) < sms * chunks[order[0]]
           and (leads + 1) * value_heads <= overlap.share * sms):
        leads += 1
    while leads and chunks[order[leads - 1]] <= chunks[order[leads]]:
        leads -= 1
    rows = [0]
    for n in chunks:
        rows.append(rows[-1] + n)

    def runs(docs):  # the documents' chunk rows, adjacent ones merged
        found = []
        for d in sorted(docs):
            if rows[d] == rows[d + 1]:
                continue
            if found and found[-1][1] == rows[d]:
                found[-1] = (found[-1][0], rows[d + 1])
            else:
                found.append((rows[d], rows[d + 1]))
        return found

    spans = [(i, i + 1) for i in range(leads)] + [(leads, len(order))]
    return [(first, end, runs(order[first:end])) for first, end in spans]


PIECES = (16, 32, 64)
"""A sole document's chain pieces in chunks (`pieces`): the first two, then the last one's size
until the document ends; a document of fewer than ``4 * PIECES[-1]`` chunks stays whole."""


def pieces(chunks: int) -> list[int]:
    """The chunk offsets ``[0, .., chunks]`` at which a sole document's chain is cut (`PIECES`): its
    first piece short, so the chain starts after little of the inverse. A rule on the length: the
    outputs are the same bits either way (each piece starts from the fp32 state the last one ended
    with)."""
    if chunks < 4 * PIECES[-1]:
        return [0, chunks]
    cuts = [0]
    for size in itertools.chain(PIECES, itertools.repeat(PIECES[-1])):
        if cuts[-1] + size >= chunks:
            return cuts + [chunks]
        cuts.append(cuts[-1] + size)


_piece_offsets: collections.OrderedDict = collections.OrderedDict()


def _pieces(chunks: int, device: torch.device) -> tuple[list[int], torch.Tensor | None]:
    """`pieces` and the same offsets on ``device`` (int32), kept as the chunk tables are
    (`dsfuse.gdn.schedule.chunk_table`: the same number of entries, least recently used first out,
    so a CUDA Graph captured after a call with these documents finds them, and one captured first
    is refused with the same clear error). A document left whole needs no offsets: ``None``, no copy."""
    cuts = pieces(chunks)
    if len(cuts) <= 2:
        return cuts, None
    key = (tuple(cuts), str(device))  # the cuts themselves: `PIECES` may change between calls
    if key in _piece_offsets:
        _piece_offsets.move_to_end(key)
        return _piece_offsets[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("gdn: this document's chain pieces are not on the GPU yet, and they cannot be copied "
                           "while a CUDA Graph is captured; call chunk_gdn once with the same cu_seqlens (or B, T) "
                           "before capturing")
    found = _piece_offsets[key] = cuts, torch.tensor(cuts, dtype=torch.int32).to(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the copy done: any stream may read it
    if len(_piece_offsets) > schedule.TABLE_CACHE_SIZE:
        _piece_offsets.popitem(last=False)
    return found


def column_parts(form: str, value_heads: int, dim_v: int, documents: int, sms: int) -> int:
    """How many CTAs walk each value head's chain (`dsfuse.gdn.cutedsl.fused_fwd.COLUMN_PARTS`): two,
    each 64 of its channels on the ``head_ws`` form, where the call's form is ``head_rs`` (V = 128)
    and twice its chains (value heads x documents) fit the SMs at once; else one. The same bits
    either way (GPU tests), so the rule may read the SM count."""
    return 2 if form == "head_rs" and dim_v == 128 and 2 * value_heads * documents <= sms else 1


def chain_parts(form: str, bounds: list[int], value_heads: int, dim_v: int, sms: int) -> int:
    """`column_parts` where no stage of a CUDA Graph capture's plan (`stages` under `OVERLAP`) leads
    (lead stages' chains share the SMs with the inverse instead), else 1. Read from the capture's
    plan in eager calls too, whose own plan may differ (`Overlap.eager`), so that an eager call
    compiles the kernels a capture after it launches."""
    if len(_stages(tuple(bounds), value_heads, sms, OVERLAP)) > 1:
        return 1
    return column_parts(form, value_heads, dim_v, len(bounds) - 1, sms)


@functools.lru_cache(maxsize=64)
def _stages(bounds: tuple, value_heads: int, sms: int, overlap: Overlap) -> list[tuple]:
    """`stages`, remembered for the last document layouts (an eager call's plan is read, not changed)."""
    return stages(list(bounds), value_heads, sms, overlap)


@functools.cache
def _side_streams(device: torch.device, count: int) -> tuple:
    """``count`` side streams for the lead stages' chains, created once per device and count; an eager
    call makes them (`FusedForward.calls`), so that a CUDA Graph captured after it creates none."""
    return tuple(torch.cuda.Stream(device) for _ in range(count))


@functools.cache
def _piece_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of a sole document's chain pieces, at high priority (a piece's CTAs then take
    the SMs before the next inverse's); made once, outside any capture."""
    return torch.cuda.Stream(device, priority=-1)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


ARCHS = ("sm_90a", "sm_100a")  # the targets its kernels are compiled for (CI) and written for (shared memory)


def reasons(q, k, v, g, beta, initial_state=None, use_qk_l2norm: bool = False) -> list[str]:
    """Why the fused forward cannot serve this call (empty when it can): the GPU (`ARCHS`), the
    kernels' head dims and dtypes (`dsfuse.gdn.cutedsl.fused_fwd.shape_reasons`), beta in q's
    dtype, and q, k, v rows the 16-byte copies can read as the kernels see them
    (`dsfuse.gdn.cutedsl.fused_fwd_head.aligned_reasons`)."""
    found = []
    if v.device.type == "cuda" and (arch := _cd.arch_of(v.device)) not in ARCHS:
        found.append(f"the CuTe DSL GDN forward is written for {' and '.join(ARCHS)} (its shared memory), not {arch}")
    if beta.dtype != q.dtype:
        found.append("beta's dtype differs from q's (the fused forward reads it in q's)")
    heads, dim_k = k.shape[-2:]
    heads_v, dim_v = v.shape[-2:]
    form = form_of(v.device, dim_v) if not found and v.device.type == "cuda" else "head_ws"
    found += fused_fwd.shape_reasons(q.dtype, heads, heads_v, dim_k, dim_v, form, use_qk_l2norm)
    found += [f"{name} has channel stride {t.stride(-1)} (the kernels read unit-stride channels)"
              for name, t in (("q", q), ("k", k), ("v", v)) if t.stride(-1) != 1]
    if not found:
        views = {name: _view(t) for name, t in (("q", q), ("k", k), ("v", v))}
        found += fused_fwd_head.aligned_reasons(**{name: x for name, x in views.items() if x is not None and x.numel()})
    return found


def _view(x: torch.Tensor) -> torch.Tensor | None:
    """``[B, T, heads, D]`` as ``[B * T, heads, D]`` without a copy, or None where that takes one
    (`_rows` then copies it into a new, aligned tensor)."""
    try:
        return x.view(-1, *x.shape[2:])
    except RuntimeError:
        return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, heads, D]`` as the kernels read it, ``[B * T, heads, D]`` (a view where the batch
    and token strides allow, else a contiguous copy, as `dsfuse.gdn.schedule.stage_calls` does)."""
    return x.reshape(-1, *x.shape[2:])


@dataclass(frozen=True)
class FusedForward:
    """The backend's forward table (`dsfuse.gdn.schedule.forward` runs its ``calls``)."""

    def calls(self, q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool, cu_seqlens,
              use_qk_l2norm: bool, segment_chunks=None, save: bool = True):
        """``(calls, ForwardOutputs)`` of validated inputs, as `dsfuse.gdn.schedule.stage_calls`
        (``segment_chunks`` has no effect: module docstring). ``save`` False (a forward no backward
        will read): ``ForwardOutputs.A`` is empty (``[0, HV, 64]``) and on sm_90a the fp32 ``A`` is
        not written at all; o and the final state are the same bits either way (the fused kernel
        reads the preparing inverse's ``round(A)``, not ``A``). ``save`` where the fused backward
        serves the call (`dsfuse.gdn.cutedsl.backward.serves`: ``head_rs``, K = 128):
        ``ForwardOutputs.A`` is the buffer it reads (`dsfuse.gdn.cutedsl.backward.saved_views`: the
        preparing inverse's ``round(A)`` and factors, and ``round(S)`` of every chunk, which the
        chain kernel saves), not the fp32 ``A``."""
        batch, tokens, heads_v, dim_v = v.shape
        dim_k = k.shape[-1]
        n = batch * tokens
        q_, k_, v_ = _rows(q), _rows(k), _rows(v)
        g_, beta_ = g.reshape(n, heads_v), beta.reshape(n, heads_v)
        bounds = packed_cu_seqlens(cu_seqlens, batch, tokens)
        table = schedule.chunk_table(bounds, v.device)
        new = functools.partial(torch.empty, device=v.device)
        g_cum = new((n, heads_v), dtype=torch.float32)
        form = form_of(v.device, dim_v)
        fused_saves = save and _backward.serves(v.device, k.shape[-2], heads_v, dim_k, dim_v, v.dtype)  # its reads
        # the head form reads A; the prepared forms read round(A) and the factors; the Triton backward A
        keep_a = (save and not fused_saves) or form not in fused_fwd.PREPARED_FORMS
        a = new((n if keep_a else 0, heads_v, CHUNK_SIZE), dtype=torch.float32)
        o = new((n, heads_v, dim_v), dtype=v.dtype)
        state_shape = (table.num_seqs, heads_v, dim_k, dim_v)
        final_state = new(state_shape, dtype=torch.float32)  # written whether or not it is returned
        h0 = torch.zeros(state_shape, device=v.device, dtype=torch.float32) if initial_state is None else initial_state
        prepared = {}  # the preparing inverse's round(A) and rows' factors, read by a prepared form
        states = None  # round(S) of every chunk, for the fused backward
        if fused_saves:
            saved = new((_backward.saved_rows(n, table.num_seqs, dim_k, dim_v), heads_v, CHUNK_SIZE),
                        dtype=torch.float32)
            a_round, factors, states = _backward.saved_views(saved, n, table.indices.shape[0], dim_k, dim_v, v.dtype)
            prepared = {"a_round": a_round, "factors": factors.view(-1, heads_v, CHUNK_SIZE)}
        elif form in fused_fwd.PREPARED_FORMS:
            prepared = {"a_round": new((n, heads_v, CHUNK_SIZE), dtype=v.dtype),
                        "factors": new((table.indices.shape[0] * len(FACTORS), heads_v, CHUNK_SIZE),
                                       dtype=torch.float32)}

        # The launches below take the kernels' private entry points: `reasons` checked the inputs
        # (the backend's own reasons, asked before this call: shapes, dtypes, strides, 16-byte rows)
        # and every other buffer is made here as the kernels need it, so the public launch
        # functions' checks would only repeat that, for every launch of an eager call.
        if prepared:
            factor_rows = prepared["factors"].view(-1, len(FACTORS), heads_v, CHUNK_SIZE)
            q_in, a_round = q_, prepared["a_round"]
        else:  # not read: the compiled signature's stand-ins (`launch_ut_inverse`)
            q_in, a_round = k_, new((0, heads_v, CHUNK_SIZE), dtype=k.dtype)

        def inverse(c0: int = 0, c1: int | None = None):  # the chunk rows [c0, c1) (their factors' rows)
            rows = table.indices[c0:c1]
            if rows.shape[0] == 0:
                return
            factors = factor_rows[c0:c1].flatten(0, 1) if prepared else a[:0]
            ut_inverse._launch(k_, beta_, g_, rows, a, g_cum, q_in, a_round, factors, use_qk_l2norm, True,
                               bool(prepared), keep_a)

        sms = _sms(v.device)
        capturing = torch.cuda.is_current_stream_capturing()
        overlap = OVERLAP if OVERLAP.eager or capturing else Overlap(0)
        plan = _stages(tuple(bounds), heads_v, sms, overlap) if n else []
        parts = chain_parts(form, bounds, heads_v, dim_v, sms) if v_.stride(1) == dim_v and n else 1

        def chain(offsets, order, h_in, h_out):  # one launch of the chains of documents `order`
            fused_fwd._launch(q_, k_, v_, g_, beta_, a, table.indices, offsets, order, h_in, h_out, o, scale,
                              use_qk_l2norm, "head_ws" if parts > 1 else form, g_cum, prepared.get("a_round"),
                              prepared.get("factors"), states, parts)

        def split_state():  # the states as the chains read and write them (`fused_fwd.COLUMN_PARTS`)
            if parts == 1:
                return h0, final_state
            return (fused_fwd.split_columns(h0, parts),
                    new((table.num_seqs, parts * heads_v, dim_k, dim_v // parts), dtype=torch.float32))

        def join_state(h_out):  # every document's final state: parts > 1 runs one stage of all documents
            if parts > 1:
                fused_fwd.join_columns(h_out, parts, final_state)

        def fused(first: int = 0, end: int | None = None):  # the chains of documents order[first:end]
            if n == 0:  # no tokens: every document is empty, its final state its initial one (no launch)
                final_state.copy_(h0)
                return
            h_in, h_out = split_state()
            chain(table.offsets, table.order[first:end], h_in, h_out)
            join_state(h_out)

        if v.device.type == "cuda" and not capturing and OVERLAP.leads:
            _side_streams(v.device, OVERLAP.leads)  # made outside any capture, for one to come
            _piece_stream(v.device)
        sole = table.num_seqs == 1 and n and OVERLAP.leads and v.device.type == "cuda"
        cuts, cut_offsets = _pieces(table.indices.shape[0], v.device) if sole else ([], None)

        def in_pieces():  # a sole document: each piece's chain after its chunks' inverse (`pieces`)
            main, side = torch.cuda.current_stream(v.device), _piece_stream(v.device)
            h_in, h_out = split_state()
            between = [torch.empty_like(h_out) for _ in range(min(2, len(cuts) - 2))]
            for j, (c0, c1) in enumerate(itertools.pairwise(cuts)):
                inverse(c0, c1)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    chain(cut_offsets[j:j + 2], table.order, h_in if j == 0 else between[(j - 1) % 2],
                          h_out if j == len(cuts) - 2 else between[j % 2])
            main.wait_stream(side)
            join_state(h_out)

        if len(cuts) > 2:  # eagerly too: its host work is the pieces' few launches
            calls = [("ut_inverse and fused, in pieces", in_pieces)]
        elif len(plan) <= 1:
            calls = [("ut_inverse", inverse), ("fused", fused)]
        else:
            sides = _side_streams(v.device, overlap.leads)[:len(plan) - 1]
            calls = [("ut_inverse and fused, overlapped", lambda: _overlapped(plan, sides, inverse, fused, v.device))]
        kept = saved if fused_saves else a if save else a[:0]
        outputs = schedule.ForwardOutputs(o.view(batch, tokens, heads_v, dim_v),
                                          final_state if output_final_state else None, g_cum, kept)
        return calls, outputs


def _overlapped(plan: list[tuple], sides: tuple, inverse, fused, device: torch.device):
    """Run `stages`' plan: each stage's inverse on the current stream, a lead stage's chains on its
    side stream (``sides``, one a lead), which waits for it, the last stage's chains on the current
    stream; the current stream then waits for the side streams (so every buffer is read and written
    before the caller's next work, and a CUDA Graph capture forks and joins)."""
    main = torch.cuda.current_stream(device)
    for (first, end, runs), side in zip(plan, sides + (None,)):
        for c0, c1 in runs:
            inverse(c0, c1)
        if side is None:
            fused(first, end)
            continue
        side.wait_stream(main)
        with torch.cuda.stream(side):
            fused(first, end)
    for side in sides:
        main.wait_stream(side)
