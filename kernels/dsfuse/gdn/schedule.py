"""The chunked Gated DeltaNet forward as a sequence of stages, backend-neutral.

A backend supplies its stage launchers (:class:`ForwardStages`); the schedule allocates the
intermediates once per call and strings the stages together in the packed token layout:

1. ``cumsum``: ``g`` ``[T, HV]`` -> chunk-local cumulative gate ``g_cum`` (fp32);
2. ``wy``: the UT transform ``A = (I + L)^-1`` ``[T, HV, BT]`` and the WY representation
   ``w = A (beta exp(G) k)``, ``u = A (beta v)``;
3. ``state``: the sequential pass over each document's chunks: ``h`` (the state at every
   chunk's start) ``[NC, HV, K, V]``, ``v_new = u - w h``, the final state;
4. ``output``: ``o = scale [(q exp(G)) h + tril(q k^T Gamma) v_new]``.

The chunk table comes from the document bounds on the host (each document chunked from its
own start): the public function reads them from ``cu_seqlens`` once and passes the list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsfuse.gdn.reference import CHUNK_SIZE, packed_cu_seqlens, prepare_chunk_indices, prepare_chunk_offsets


@dataclass(frozen=True)
class ForwardStages:
    """A backend's launchers of the forward stages (each writes into given outputs)."""

    cumsum: Callable  # (g, chunk_indices, g_cum)
    wy: Callable  # (k, v, beta, g_cum, chunk_indices, A, w, u, *, use_qk_l2norm)
    state: Callable  # (k, w, u, g_cum, chunk_indices, chunk_offsets, h0, h, v_new, ht, *, use_qk_l2norm)
    output: Callable  # (q, k, v_new, h, g_cum, chunk_indices, scale, o, *, use_qk_l2norm)


@dataclass(frozen=True)
class ChunkTable:
    """The chunks of a packed batch: int32 ``indices`` ``[NC, 3]`` (sequence, start, end) and
    ``offsets`` ``[N + 1]`` (each sequence's first chunk), on the tensors' device."""

    indices: torch.Tensor
    offsets: torch.Tensor
    num_seqs: int


def chunk_table(cu_seqlens, batch: int, tokens: int, device: torch.device) -> ChunkTable:
    """Documents of ``cu_seqlens`` (or ``batch`` sequences of ``tokens``) chunked by ``CHUNK_SIZE``."""
    bounds = packed_cu_seqlens(cu_seqlens, batch, tokens)
    indices = prepare_chunk_indices(bounds, CHUNK_SIZE).to(device=device, dtype=torch.int32)
    offsets = prepare_chunk_offsets(bounds, CHUNK_SIZE).to(device=device, dtype=torch.int32)
    return ChunkTable(indices, offsets, len(bounds) - 1)


def stage_calls(stages: ForwardStages, q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool,
                cu_seqlens, use_qk_l2norm: bool):
    """The forward of validated inputs as ``(calls, (o, final_state))``: ``calls`` lists
    ``(stage name, zero-argument launch)`` in order over buffers allocated here, once; running
    them fills ``o`` ``[B, T, HV, V]`` and ``final_state`` (or None). Experiments time the calls
    one by one; :func:`forward` runs them."""
    batch, tokens, heads_v, dim_v = v.shape
    dim_k = k.shape[-1]
    n = batch * tokens
    q_, k_, v_ = (t.reshape(n, *t.shape[2:]) for t in (q, k, v))  # views for the layouts the API accepts
    g_, beta_ = g.reshape(n, heads_v), beta.reshape(n, heads_v)
    table = chunk_table(cu_seqlens, batch, tokens, v.device)
    chunks = table.indices.shape[0]
    new = functools.partial(torch.empty, device=v.device)
    g_cum = new((n, heads_v), dtype=torch.float32)
    a = new((n, heads_v, CHUNK_SIZE), dtype=torch.float32)
    w, u = new((n, heads_v, dim_k), dtype=k.dtype), new((n, heads_v, dim_v), dtype=v.dtype)
    h = new((chunks, heads_v, dim_k, dim_v), dtype=v.dtype)
    v_new, o = new((n, heads_v, dim_v), dtype=v.dtype), new((n, heads_v, dim_v), dtype=v.dtype)
    final_state = new((table.num_seqs, heads_v, dim_k, dim_v), dtype=torch.float32) if output_final_state else None
    l2 = dict(use_qk_l2norm=use_qk_l2norm)
    calls = [
        ("cumsum", lambda: stages.cumsum(g_, table.indices, g_cum)),
        ("wy", lambda: stages.wy(k_, v_, beta_, g_cum, table.indices, a, w, u, **l2)),
        ("state", lambda: stages.state(k_, w, u, g_cum, table.indices, table.offsets, initial_state, h, v_new,
                                       final_state, **l2)),
        ("output", lambda: stages.output(q_, k_, v_new, h, g_cum, table.indices, scale, o, **l2)),
    ]
    return calls, (o.view(batch, tokens, heads_v, dim_v), final_state)


def forward(stages: ForwardStages, q, k, v, g, beta, **kwargs):
    """``(o, final_state)`` of validated inputs ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``
    (keyword arguments as :func:`stage_calls`)."""
    calls, outputs = stage_calls(stages, q, k, v, g, beta, **kwargs)
    for _, launch in calls:
        launch()
    return outputs
