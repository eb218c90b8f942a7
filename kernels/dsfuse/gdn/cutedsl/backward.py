"""The fused backward of the Gated DeltaNet in CuTe DSL as a sequence of launches (sm_90a), the plan of
``experiments/gdn/notes/fused-backward-design.md``; not yet reachable from `chunk_gdn` (whose
``cutedsl`` backend still runs the Triton stages' backward). `fused_backward` runs it on packed
``[T, ...]`` inputs, for its tests and probe:

1. the forward's preparing UT inverse and its chain kernel in the saving mode (``head_rs``): o, the
   final state, ``round(A Gamma)``, the rows' factors and ``round(S)`` of every chunk (what a forward
   keeps for this backward);
2. the reverse state chain (`dsfuse.gdn.cutedsl.state_bwd`): ``round(dS')`` of every chunk, ``dh0``;
3. the per-chunk gradients (`dsfuse.gdn.cutedsl.chunk_bwd`): dv, dg, dbeta, and each value head's
   dq and dk with respect to the normalised q and k, fp32;
4. the value heads of each qk head summed in head order and the L2 norm's backward: the Triton
   stages' ``finalize`` (`dsfuse.gdn.triton.finalize`), for now.
"""

from __future__ import annotations

import torch

from dsfuse.gdn.cutedsl.chunk_bwd import launch_chunk_backward
from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward
from dsfuse.gdn.cutedsl.state_bwd import launch_state_backward
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse
from dsfuse.gdn.reference import CHUNK_SIZE, prepare_chunk_indices, prepare_chunk_offsets
from dsfuse.gdn.schedule import document_order


def fused_backward(q, k, v, g, beta, do, scale=None, initial_state=None, dht=None, cu_seqlens=None,
                   use_qk_l2norm=False) -> dict:
    """The forward and the fused backward of packed ``[T, ...]`` inputs (no batch dim): ``q``, ``k``
    ``[T, H, 128]``, ``v``, ``do`` ``[T, HV, 128]``, ``beta`` ``[T, HV]`` in one 16-bit dtype, ``g``
    fp32 ``[T, HV]``; ``initial_state``, ``dht`` fp32 ``[N, HV, K, V]`` or None (zeros).

    Returns a dict of ``o``, ``final_state``, ``dq``, ``dk``, ``dv``, ``dg``, ``dbeta``, ``dh0``
    and the intermediates ``states``, ``dstates`` (``[NC, K, HV, V]``), ``dq_hv``, ``dk_hv``."""
    from dsfuse.gdn.triton.finalize import launch_qk_finalize

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
           "dq_hv": torch.zeros(tokens, value_heads, dim_k, device=dev),
           "dk_hv": torch.zeros(tokens, value_heads, dim_k, device=dev),
           "dv": torch.zeros_like(v), "dg": torch.zeros_like(g), "dbeta": torch.zeros_like(beta),
           "dq": torch.empty_like(q), "dk": torch.empty_like(k)}
    launch_fused_forward(q, k, v, g, beta, None, ci, co, order, h0, out["final_state"], out["o"], scale,
                         use_qk_l2norm=use_qk_l2norm, form="head_rs", g_cum=g_cum, a_round=a_round, factors=factors,
                         states=out["states"])
    launch_state_backward(q, k, do, a_round, factors, ci, co, order, dht, out["dh0"], out["dstates"], scale,
                          use_qk_l2norm=use_qk_l2norm)
    launch_chunk_backward(q, k, v, do, a_round, factors, out["states"], out["dstates"], ci, out["dq_hv"],
                          out["dk_hv"], out["dv"], out["dg"], out["dbeta"], scale, use_qk_l2norm=use_qk_l2norm)
    launch_qk_finalize(q, k, out["dq_hv"], out["dk_hv"], out["dq"], out["dk"], use_qk_l2norm=use_qk_l2norm)
    return out
