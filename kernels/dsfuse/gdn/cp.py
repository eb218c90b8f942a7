"""Context parallelism for Gated DeltaNet: one packed row of documents split over the ranks of a
``torch.distributed`` process group, the state carried across ranks exactly and deterministically.

The split (`cp_shards`): rank ``r`` of ``W`` holds tokens ``[floor(r T / W), floor((r + 1) T / W))``
of the global row; a document may start before its share (``from_prev``), continue after it
(``to_next``) or both (the rank *spans* it: one document covers the whole share).

Per value head the recurrence is affine in the state: a segment of a document maps the state at
its start ``S_in`` to the state at its end as ``S_out = M S_in + E`` with ``E`` the segment's final
state from a zero start (or from the document's initial state when the document starts in the
segment) and ``M`` (``K x K``) the product of the tokens' transitions ``exp(g_t) (I - beta_t k_t k_t^T)``,
which is the final state of the same recurrence with ``v = 0`` from ``S_in = I``.

Forward, on every rank at once:

1. if ``to_next``: ``E`` of the share's last segment (a forward over that segment alone, so the next
   rank waits for that segment only; from the share's own forward when the segment is the whole
   share and nothing comes in) and, when the rank spans its document, ``M`` (a forward with ``v = 0``
   from the identity);
2. ``all_gather`` of ``E`` (and of ``M`` when any rank spans): ``HV K V`` (and ``HV K K``) fp32 per rank;
3. if ``from_prev``: the incoming state by the merge in rank order, ``S = E_s``, then
   ``S = M_j S + E_j`` for the spanned ranks ``j = s + 1 .. r - 1`` (``s``: where the document starts),
   each step computed in fp64 and rounded once to the state's dtype (fp32; fp64 for fp64 inputs);
4. the local forward of the share from the incoming state (the row's own kernels, unchanged);
5. with ``output_final_state``: each document's final state, held by the rank where it ends, is
   summed over the ranks (``all_reduce``; one nonzero term per element, so exact) so every rank
   returns all ``N`` rows.

Backward, mirrored: the gradient of a share's incoming state is affine in the gradient of its
outgoing state, ``dS_in = D + M^T dS_out`` (``D``: the part from the share's own outputs; for a
rank whose first document ends in its share ``D`` is all of it). Each ``from_prev`` rank computes
``D`` (the reverse state pass over its first segment only), ``D`` is all-gathered, and every
``to_next`` rank folds ``dS_out = D_e``, ``dS_out = D_j + M_j^T dS_out`` back from the rank ``e``
where its document ends, in rank order; then the local backward runs once with that ``dS_out``
as the gradient of its last segment's final state. (For a spanning rank this one backward gives
the gradients through ``E`` and ``M`` both: its forward's final state is ``M S_in + E``.) With
``output_final_state`` the final states' gradients are first all-gathered and summed in rank
order (the sum over the ranks' losses of a replicated output).

Determinism: for a given world size every sum has a fixed order and no collective reduces in
floating point except the exact one of step 5. A different world size chunks the documents
differently (each segment is chunked from the share's start) and merges in another order: the
results then differ within fp32 rounding.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CPShard", "cp_shards", "cp_shard", "count_exchanged_bytes"]


@dataclass(frozen=True)
class CPShard:
    """One rank's part of a packed row of documents (`cp_shards`).

    ``start``, ``end``: its global token range; ``cu_seqlens``: int64 CPU ``[n + 1]``, the local
    document offsets (``0`` to ``end - start``); ``docs``: the global indices of its ``n``
    documents, in order (a document of no tokens belongs to the rank whose share holds its
    offset, the last rank for offset ``T``); ``from_prev``: its first document started on an
    earlier rank; ``to_next``: its last document continues on a later rank."""

    rank: int
    world_size: int
    start: int
    end: int
    cu_seqlens: torch.Tensor = field(repr=False)
    docs: range
    from_prev: bool
    to_next: bool

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def spans(self) -> bool:
        """One document covers the whole share and crosses both of its edges."""
        return self.from_prev and self.to_next and len(self.docs) == 1

    @property
    def bounds(self) -> list[int]:
        return self.cu_seqlens.tolist()


def _global_bounds(cu_seqlens) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError("cu_seqlens: expected an int32 or int64 tensor [N + 1] (the global document offsets)")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0, got {bounds}")
    return bounds


def _shards(bounds: list[int], world_size: int) -> list[CPShard]:
    total, n = bounds[-1], len(bounds) - 1
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if total < world_size:
        raise ValueError(f"context parallelism: T = {total} tokens cannot give each of {world_size} ranks a token")
    shards = []
    for rank in range(world_size):
        start, end = rank * total // world_size, (rank + 1) * total // world_size
        last = rank == world_size - 1
        # documents with a token in [start, end), and empty ones whose offset lies there (or at T, last rank)
        docs = [d for d in range(n)
                if (bounds[d] < end and bounds[d + 1] > start)
                or (bounds[d] == bounds[d + 1] and (start <= bounds[d] < end or (last and bounds[d] == end)))]
        local = [0] + [min(bounds[d + 1], end) - start for d in docs]
        shards.append(CPShard(rank, world_size, start, end, torch.tensor(local, dtype=torch.int64),
                              range(docs[0], docs[-1] + 1), bounds[docs[0]] < start, bounds[docs[-1] + 1] > end))
    return shards


def cp_shards(cu_seqlens: torch.Tensor, world_size: int) -> list[CPShard]:
    """The split of a packed row of documents over ``world_size`` ranks, one `CPShard` per rank.

    ``cu_seqlens``: the global document offsets (int32/int64 ``[N + 1]``, non-decreasing from 0 to
    ``T``, any device; read on the host). Rank ``r`` holds tokens ``floor(r T / W)`` to
    ``floor((r + 1) T / W)``: slice the row (``q``, ``k``, ``v``, ``g``, ``beta``) as
    ``x[:, shard.start:shard.end]`` and pass the *global* ``cu_seqlens`` with ``cp_group`` to
    `dsfuse.gdn.chunk_gdn`; ``shard.cu_seqlens`` are the local offsets, for other layers."""
    return _shards(_global_bounds(cu_seqlens), world_size)


def cp_shard(cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None = None) -> CPShard:
    """This rank's `CPShard` in ``group`` (default: the world)."""
    return cp_shards(cu_seqlens, dist.get_world_size(group))[dist.get_rank(group)]


# -- exchanged bytes (for experiments and tests) -----------------------------------------------------

_byte_logs: list[list] = []


@contextlib.contextmanager
def count_exchanged_bytes():
    """Within the block, every collective of the context-parallel path appends
    ``(name, bytes sent by this rank, bytes received by this rank)`` to the yielded list."""
    log: list = []
    _byte_logs.append(log)
    try:
        yield log
    finally:
        _byte_logs.remove(log)


def _record(name: str, sent: int, received: int) -> None:
    for log in _byte_logs:
        log.append((name, sent, received))


def _all_gather(name: str, x: torch.Tensor, group) -> list[torch.Tensor]:
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    size = x.numel() * x.element_size()
    _record(name, size, size * (world - 1))
    return parts


def _all_reduce_exact(name: str, x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the ranks of tensors with at most one nonzero term per element: exact in any order."""
    dist.all_reduce(x, group=group)
    size = x.numel() * x.element_size()
    world = dist.get_world_size(group)
    _record(name, size, size * (world - 1))  # what a gather of the same data would move
    return x


# -- the local passes of a backend ---------------------------------------------------------------------


@dataclass(frozen=True)
class LocalPasses:
    """A backend's local forward and backward over validated inputs of one share.

    ``forward(q, k, v, g, beta, h0, bounds)`` -> ``(o, final_state [n, HV, K, V] fp32, saved)``;
    ``backward(saved, do, dht)`` -> ``(dq, dk, dv, dg, dbeta, dh0)``; ``first_dh0(saved, do, dht, length)``
    -> the gradient of the first document's initial state (``[HV, K, V]``) from the outputs of its
    first ``length`` tokens and ``dht`` (``[HV, K, V]`` or None), the reverse state pass only."""

    forward: Callable
    backward: Callable
    first_dh0: Callable


# -- the autograd function -----------------------------------------------------------------------------


def _merge(es: list[torch.Tensor], ms: list[torch.Tensor] | None, shards: list[CPShard], rank: int) -> torch.Tensor:
    """The state entering ``rank``'s first document: ``E_s``, then ``M_j S + E_j`` in rank order."""
    s = rank - 1
    while shards[s].spans:  # back to the rank where the document starts
        s -= 1
    state = es[s]
    for j in range(s + 1, rank):  # in fp64: no TF32 whatever torch's matmul precision, one rounding per step
        state = (torch.matmul(ms[j].double(), state.double()) + es[j].double()).to(es[j].dtype)
    return state


def _fold_back(ds: list[torch.Tensor], ms: list[torch.Tensor] | None, shards: list[CPShard],
               rank: int) -> torch.Tensor:
    """The gradient of the state leaving ``rank``: ``D_e``, then ``D_j + M_j^T dS`` back to ``rank + 1``."""
    e = rank + 1
    while shards[e].spans:  # forward to the rank where the document ends
        e += 1
    grad = ds[e]
    for j in range(e - 1, rank, -1):  # in fp64, as the merge
        grad = (ds[j].double() + torch.matmul(ms[j].transpose(-1, -2).double(), grad.double())).to(ds[j].dtype)
    return grad


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, passes: LocalPasses, shards: list[CPShard], group,
                output_final_state: bool):
        rank = dist.get_rank(group)
        me = shards[rank]
        bounds, n = me.bounds, len(me.docs)
        num_docs = shards[-1].docs[-1] + 1
        state_shape = (v.shape[2], k.shape[3], v.shape[3])  # HV, K, V
        state_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
        new_state = functools.partial(v.new_zeros, dtype=state_dtype)

        def user_h0(doc: int) -> torch.Tensor:
            return new_state(state_shape) if initial_state is None else initial_state[doc]

        def local_forward(h0_rows: list[torch.Tensor] | None):
            h0 = None if h0_rows is None else torch.stack(h0_rows).contiguous()
            return passes.forward(q, k, v, g, beta, h0, bounds)

        user_rows = None if initial_state is None else [initial_state[d] for d in me.docs]
        # A rank whose last segment is its whole share and has nothing coming in takes E from its own
        # forward; any other rank sends E first (a forward over the last segment alone), so the next
        # rank waits for that segment only, not for this rank's whole share.
        early = not me.from_prev and (not me.to_next or bounds[-2] == 0)
        if early:
            o, ht_local, saved = local_forward(user_rows)
        crossing, spanning = any(s.to_next for s in shards), any(s.spans for s in shards)
        es = ms = None
        if crossing:
            # 1. the maps of the share's last segment: E, and M where the rank spans its document
            e_local, m_local = new_state(state_shape), new_state(state_shape[:2] + state_shape[1:2])
            if me.to_next and early:
                e_local = ht_local[n - 1]
            elif me.to_next:  # from zero where the rank spans its document
                lo = bounds[-2]
                h0 = new_state(state_shape) if me.spans else user_h0(me.docs[-1])
                e_local = passes.forward(*(t[:, lo:] for t in (q, k, v, g, beta)), h0[None].contiguous(),
                                         [0, me.tokens - lo])[1][0]
            if me.spans:  # M: the same recurrence with v = 0 from the identity
                eye = torch.eye(k.shape[3], dtype=state_dtype, device=v.device)
                zero_v = v.new_zeros((*v.shape[:3], k.shape[3]))
                m_local = passes.forward(q, k, zero_v, g, beta, eye.expand(1, *m_local.shape).contiguous(),
                                         bounds)[1][0]
            # 2. every rank's maps, gathered
            es = _all_gather("forward: E", e_local, group)
            if spanning:
                ms = _all_gather("forward: M", m_local, group)
        if not early:
            # 3. the incoming state by the merge, then 4. the local forward
            rows = user_rows
            if me.from_prev:
                rows = [_merge(es, ms, shards, rank)] + [user_h0(d) for d in me.docs[1:]]
            o, ht_local, saved = local_forward(rows)
        final_state = None
        if output_final_state:
            # 5. each document's final state, from the rank where it ends, on every rank
            final_state = new_state((num_docs, *state_shape))
            for i in range(n - 1 if me.to_next else n):
                final_state[me.docs[i]] = ht_local[i]
            final_state = _all_reduce_exact("forward: final states", final_state, group)
        # tensors through save_for_backward, so torch.utils.checkpoint frees them and recomputes this forward
        # (and autograd checks them for in-place changes); the rest of ``saved`` (document bounds) as is
        tensors = [t for t in saved if isinstance(t, torch.Tensor)] + (ms or [])
        ctx.save_for_backward(*tensors)
        ctx.saved_layout = [isinstance(t, torch.Tensor) for t in saved]
        ctx.saved_rest = [None if isinstance(t, torch.Tensor) else t for t in saved]
        ctx.num_ms = 0 if ms is None else len(ms)
        ctx.passes, ctx.shards, ctx.group = passes, shards, group
        ctx.state_shape, ctx.state_dtype, ctx.num_docs = state_shape, state_dtype, num_docs
        ctx.crossing, ctx.output_final_state = crossing, output_final_state
        ctx.has_initial_state = initial_state is not None
        ctx.h0_dtype = None if initial_state is None else initial_state.dtype
        return o, final_state

    @staticmethod
    def backward(ctx, do, dfinal):
        passes, shards, group = ctx.passes, ctx.shards, ctx.group
        tensors = list(ctx.saved_tensors)
        ms = tensors[len(tensors) - ctx.num_ms:] if ctx.num_ms else None
        given = iter(tensors)
        saved = tuple(next(given) if is_tensor else rest for is_tensor, rest in zip(ctx.saved_layout, ctx.saved_rest))
        rank = dist.get_rank(group)
        me = shards[rank]
        n = len(me.docs)
        new_state = functools.partial(do.new_zeros, dtype=ctx.state_dtype)
        dht = None  # the gradient of each local document's final state (None: all zero)
        if ctx.output_final_state:
            # a replicated output: its gradient is the sum over the ranks, in rank order
            parts = _all_gather("backward: final-state gradients",
                                new_state((ctx.num_docs, *ctx.state_shape)) if dfinal is None else dfinal, group)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            dht = new_state((n, *ctx.state_shape))
            for i in range(n - 1 if me.to_next else n):
                dht[i] = total[me.docs[i]]
        if ctx.crossing:
            d_local = new_state(ctx.state_shape)
            if me.from_prev:  # D: the incoming state's gradient from this share's own outputs
                first_ends_here = not (n == 1 and me.to_next)
                d_local = passes.first_dh0(saved, do, dht[0] if (dht is not None and first_ends_here) else None,
                                           me.bounds[1])
            ds = _all_gather("backward: D", d_local, group)
            if me.to_next:
                dht = new_state((n, *ctx.state_shape)) if dht is None else dht
                dht[n - 1] += _fold_back(ds, ms, shards, rank)
        dq, dk, dv, dg, dbeta, dh0_local = passes.backward(saved, do, dht)
        dh0 = None
        if ctx.has_initial_state:
            dh0 = do.new_zeros((ctx.num_docs, *ctx.state_shape), dtype=ctx.h0_dtype)
            for i, d in enumerate(me.docs):
                if not (i == 0 and me.from_prev):
                    dh0[d] = dh0_local[i]
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None


def chunk_gdn_cp(q, k, v, g, beta, initial_state, output_final_state: bool, passes: LocalPasses,
                 shards: list[CPShard], group):
    """``(o, final_state or None)`` of this rank's share (validated inputs; see the module)."""
    return _ContextParallel.apply(q, k, v, g, beta, initial_state, passes, shards, group, output_final_state)
