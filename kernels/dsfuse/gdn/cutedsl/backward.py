"""The fused backward of the Gated DeltaNet in CuTe DSL as a sequence of launches (sm_90a), the plan of
``experiments/gdn/notes/fused-backward-design.md``. `FusedBackward` is the ``cutedsl`` backend's
backward table (`chunk_gdn`'s backward where the forward ran ``head_rs`` and saved for it, the Triton
stages otherwise); `fused_backward` runs the forward and the backward on packed ``[T, ...]``
inputs, for the kernels' tests and probe:

1. the forward's preparing UT inverse and its chain kernel in the saving mode (``head_rs``): o, the
   final state, ``round(A Gamma)``, the rows' factors and ``round(S)`` of every chunk (what a forward
   keeps for this backward);
2. the reverse state chain (`dsfuse.gdn.cutedsl.state_bwd`): ``round(dS')`` of every chunk, ``dh0``;
3. the per-chunk gradients (`dsfuse.gdn.cutedsl.chunk_bwd`): dv, dg, dbeta, and dq, dk (the value
   heads of each qk head summed in head order by a cluster of their CTAs, the L2 norm's backward
   applied, in the kernel).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsfuse.gdn.cutedsl.chunk_bwd import launch_chunk_backward
from dsfuse.gdn.cutedsl.fused_fwd_head import aligned_reasons
from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward
from dsfuse.gdn.cutedsl.state_bwd import launch_state_backward
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse
from dsfuse.gdn.reference import CHUNK_SIZE, prepare_chunk_indices, prepare_chunk_offsets
from dsfuse.gdn import schedule
from dsfuse.gdn.reference import packed_cu_seqlens
from dsfuse.gdn.schedule import document_order, reverse_chain_order


def saved_rows(tokens: int, docs: int, dim_k: int, dim_v: int) -> int:
    """Rows of ``[HV, 64]`` fp32 (``256 HV`` bytes each) of what the saving forward keeps for the fused
    backward, `saved_views`: ``round(A Gamma)`` (``[T, HV, 64]``, half a row a token), the rows'
    factors (8 rows a chunk) and ``round(S)`` of every chunk (``K V / 128`` rows a chunk, 128 at
    K = V = 128), for at most ``ceil(T / 64) + N`` chunks (a document adds at most one partial chunk):
    a size of the shapes alone, so that a traced forward (``torch.compile``) knows it."""
    chunks = -(-tokens // CHUNK_SIZE) + docs
    return -(-tokens // 2) + chunks * (len(FACTORS) + dim_k * dim_v // 128)


def saved_views(saved: torch.Tensor, tokens: int, chunks: int, dim_k: int, dim_v: int, dtype: torch.dtype):
    """``(a_round, factors, states)``: views of ``saved`` (fp32 ``[saved_rows(..), HV, 64]``, contiguous)
    as ``[T, HV, 64]`` and ``[NC, K, HV, V]`` in ``dtype`` (the inputs', 16-bit) and ``[NC * 8, HV, 64]``
    fp32, each 16-byte aligned."""
    value_heads = saved.shape[1]
    flat = saved.view(saved.shape[0], -1)  # rows of 64 HV fp32
    a_rows = -(-tokens // 2)
    a_round = flat[:a_rows].view(dtype).reshape(-1)[: tokens * value_heads * CHUNK_SIZE]
    factors = flat[a_rows: a_rows + chunks * len(FACTORS)].view(-1, value_heads, CHUNK_SIZE)
    first = a_rows + chunks * len(FACTORS)
    states = flat[first: first + chunks * dim_k * dim_v // 128].view(dtype)
    return (a_round.view(tokens, value_heads, CHUNK_SIZE), factors,
            states.reshape(chunks, dim_k, value_heads, dim_v))


def serves(device: torch.device, heads: int, value_heads: int, dim_k: int, dim_v: int, dtype: torch.dtype) -> bool:
    """Whether a saving forward on ``device`` keeps what the fused backward reads (and the backend's
    backward then runs it): the ``head_rs`` form (sm_90a, V = 128), K = 128, bf16 or fp16, at most
    8 value heads per qk head (`dsfuse.gdn.cutedsl.chunk_bwd.shape_reasons`)."""
    from dsfuse.gdn.cutedsl import chunk_bwd, forward

    return (device.type == "cuda" and forward.form_of(device, dim_v) == "head_rs"
            and not chunk_bwd.shape_reasons(dtype, heads, value_heads, dim_k, dim_v))


def fused_backward(q, k, v, g, beta, do, scale=None, initial_state=None, dht=None, cu_seqlens=None,
                   use_qk_l2norm=False, overlap=True) -> dict:
    """The forward and the fused backward of packed ``[T, ...]`` inputs (no batch dim): ``q``, ``k``
    ``[T, H, 128]``, ``v``, ``do`` ``[T, HV, 128]``, ``beta`` ``[T, HV]`` in one 16-bit dtype, ``g``
    fp32 ``[T, HV]``; ``initial_state``, ``dht`` fp32 ``[N, HV, K, V]`` or None (zeros).

    Returns a dict of ``o``, ``final_state``, ``dq``, ``dk``, ``dv``, ``dg``, ``dbeta``, ``dh0``
    and the intermediates ``states``, ``dstates`` (``[NC, K, HV, V]``). ``overlap``: the per-chunk
    kernel starts while the reverse chain runs, as `chunk_gdn` runs them (False: after it; the same
    bits)."""
    tokens, value_heads, dim_v = v.shape
    heads, dim_k = k.shape[1:]
    bounds = [0, tokens] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    dev = k.device
    ci = prepare_chunk_indices(bounds).to(device=dev, dtype=torch.int32).contiguous()
    co = prepare_chunk_offsets(bounds).to(device=dev, dtype=torch.int32).contiguous()
    order = torch.tensor(document_order(bounds), device=dev, dtype=torch.int32)
    n, chunks = len(bounds) - 1, ci.shape[0]
    scale = dim_k**-0.5 if scale is None else scale
    g = g.float()
    new = torch.empty
    a_round = new(tokens, value_heads, CHUNK_SIZE, device=dev, dtype=k.dtype)
    factors = new(chunks * len(FACTORS), value_heads, CHUNK_SIZE, device=dev)
    g_cum = torch.empty_like(g)
    if chunks:
        launch_ut_inverse(k, beta, ci, None, use_qk_l2norm=use_qk_l2norm, g=g, g_cum=g_cum, q=q, a_round=a_round,
                          factors=factors)
    state_shape = (n, value_heads, dim_k, dim_v)
    h0 = torch.zeros(state_shape, device=dev) if initial_state is None else initial_state.float().contiguous()
    dht = torch.zeros(state_shape, device=dev) if dht is None else dht.float().contiguous()
    out = {"o": torch.zeros(tokens, value_heads, dim_v, device=dev, dtype=v.dtype),
           "final_state": new(state_shape, device=dev),
           "states": new(chunks, dim_k, value_heads, dim_v, device=dev, dtype=v.dtype),
           "dstates": new(chunks, dim_k, value_heads, dim_v, device=dev, dtype=v.dtype),
           "dh0": new(state_shape, device=dev),
           "dv": torch.zeros_like(v), "dg": torch.zeros_like(g), "dbeta": torch.zeros_like(beta),
           "dq": torch.zeros_like(q), "dk": torch.zeros_like(k)}
    launch_fused_forward(q, k, v, g, beta, None, ci, co, order, h0, out["final_state"], out["o"], scale,
                         use_qk_l2norm=use_qk_l2norm, form="head_rs", g_cum=g_cum, a_round=a_round, factors=factors,
                         states=out["states"])
    ready = torch.zeros(chunks, value_heads, device=dev, dtype=torch.int32) if overlap else None
    finished = torch.tensor(reverse_chain_order(bounds), device=dev, dtype=torch.int32) if overlap else None
    launch_state_backward(q, k, do, a_round, factors, ci, co, order, dht, out["dh0"], out["dstates"], scale,
                          use_qk_l2norm=use_qk_l2norm, ready=ready)
    launch_chunk_backward(q, k, v, do, a_round, factors, out["states"], out["dstates"], ci, out["dq"], out["dk"],
                          out["dv"], out["dg"], out["dbeta"], scale, use_qk_l2norm=use_qk_l2norm, ready=ready,
                          finished=finished)
    return out


@dataclass(frozen=True)
class FusedBackward:
    """The ``cutedsl`` backend's backward table (`dsfuse.gdn.schedule.backward` runs its ``calls``): the
    fused backward where the forward kept what it reads (`serves`: ``A`` is then the saved buffer of
    `saved_rows`), the Triton stages (``fallback``) otherwise."""

    fallback: schedule.BackwardStages

    def calls(self, q, k, v, beta, g_cum, A, do, dht, *, scale: float, initial_state, cu_seqlens,
              use_qk_l2norm: bool, dq=None, dk=None, dv=None, segment_chunks=None):
        """``(calls, Gradients)`` as `dsfuse.gdn.schedule.backward_calls` (``segment_chunks`` has no
        effect on the fused backward: each document is one chain)."""
        batch, tokens, heads_v, dim_v = v.shape
        heads, dim_k = k.shape[2:]
        if not serves(v.device, heads, heads_v, dim_k, dim_v, v.dtype):
            kwargs = {} if segment_chunks is None else {"segment_chunks": segment_chunks}
            return schedule.backward_calls(self.fallback, q, k, v, beta, g_cum, A, do, dht, scale=scale,
                                           initial_state=initial_state, cu_seqlens=cu_seqlens,
                                           use_qk_l2norm=use_qk_l2norm, dq=dq, dk=dk, dv=dv, **kwargs)
        n = batch * tokens
        q_, k_, v_, do_ = (t.reshape(n, *t.shape[2:]) for t in (q, k, v, do))
        if aligned_reasons(do=do_):  # rows the 16-byte copies cannot read: a copy (the same values)
            do_ = do_.clone(memory_format=torch.contiguous_format)
        bounds = packed_cu_seqlens(cu_seqlens, batch, tokens)
        table = schedule.chunk_table(bounds, v.device)
        chunks = table.indices.shape[0]
        a_round, factors, states = saved_views(A, n, chunks, dim_k, dim_v, v.dtype)
        new = functools.partial(torch.empty, device=v.device)
        dq = new((batch, tokens, heads, dim_k), dtype=q.dtype) if dq is None else dq
        dk = new((batch, tokens, heads, dim_k), dtype=k.dtype) if dk is None else dk
        dv = new((batch, tokens, heads_v, dim_v), dtype=v.dtype) if dv is None else dv
        dg = new((batch, tokens, heads_v), dtype=torch.float32)
        dbeta = new((batch, tokens, heads_v), dtype=beta.dtype)
        state_shape = (table.num_seqs, heads_v, dim_k, dim_v)
        dh0 = new(state_shape, dtype=torch.float32)
        dht_ = torch.zeros(state_shape, device=v.device) if dht is None else dht
        dstates = new((chunks, dim_k, heads_v, dim_v), dtype=v.dtype)
        dq_, dk_ = dq.view(n, heads, dim_k), dk.view(n, heads, dim_k)
        dv_, dg_, dbeta_ = dv.view(n, heads_v, dim_v), dg.view(n, heads_v), dbeta.view(n, heads_v)
        ci = table.indices

        def tails():  # tokens in no chunk (past the last document): zero gradients, as the stages give
            if bounds[-1] < n:
                for t in (dq_, dk_, dv_, dg_, dbeta_):
                    t[bounds[-1]:].zero_()

        # the per-chunk kernel starts while the chain runs (a programmatic dependent launch: nothing
        # on the stream between the two), each CTA waiting for its chunk's flag in `ready` (zeroed
        # before the chain at every launch: the calls may be replayed)
        ready = new((chunks, heads_v), dtype=torch.int32)
        calls = [
            ("state backward", lambda: (tails(), ready.zero_(), launch_state_backward(
                q_, k_, do_, a_round, factors, ci, table.offsets, table.order, dht_, dh0, dstates, scale,
                use_qk_l2norm=use_qk_l2norm, ready=ready))),
            ("per-chunk gradients", lambda: launch_chunk_backward(
                q_, k_, v_, do_, a_round, factors, states, dstates, ci, dq_, dk_, dv_, dg_, dbeta_, scale,
                use_qk_l2norm=use_qk_l2norm, ready=ready, finished=table.finished)),
        ]
        return calls, schedule.Gradients(dq, dk, dv, dg, dbeta, dh0 if initial_state is not None else None)
