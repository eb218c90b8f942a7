"""Each chunk's step of the chunked state pass as an affine map of the state, and a run of chunks'
maps composed by a fixed binary tree instead of a walk: the algebra of the long-document split's
cheaper maps (`experiments/gdn/notes/long-document-split.md`, "Next: maps without a walk"); and
where a segment's warm-up may be cut because a bound proves the rest below a given size ("Next: a
warm-up cut where a bound proves the rest negligible"). In plain PyTorch, as the oracle a kernel
would be checked against. Nothing here serves a call.

Layouts as `dsfuse.gdn.reference`'s stages: ``[NC, HV, C, ...]`` chunks, ``g_cum`` the chunk-local
cumulative gate (padding holding the last token's value).
"""

from __future__ import annotations

import math

import torch

LOG_BOUND = math.log(2.0**-24)
"""The warm-up's cut (`warmup_starts`): the dropped part at most ``2^-24`` of the state's norm."""


def chunk_affine_maps(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g_cum: torch.Tensor, mm=torch.matmul):
    """Each chunk's step of `chunk_state_pass` as an affine map of the state, ``h_next = T h + B``
    (every product by ``mm``: a kernel's rounding of its operands may be emulated there)::

        T = exp(G_last) I - (k * exp(G_last - G))^T w      # [NC, HV, K, K]
        B = (k * exp(G_last - G))^T u                       # [NC, HV, K, V]: the step from h = 0

    A run of chunks composes to one such map (`compose_maps`), the segment's ``(M, E)`` of
    `dsfuse.gdn.split`, without walking the state through the chunks."""
    g_last = g_cum[..., -1]  # [NC, HV]
    k_decayed = k * (g_last[..., None] - g_cum).exp()[..., None]  # [NC, HV, C, K]
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    t = g_last.exp()[..., None, None] * eye - mm(k_decayed.transpose(-1, -2), w)
    return t, mm(k_decayed.transpose(-1, -2), u)


def compose_maps(t: torch.Tensor, b: torch.Tensor, mm=torch.matmul):
    """``(M, E)`` of a run of chunk maps ``t`` ``[n, ..., K, K]``, ``b`` ``[n, ..., K, V]`` in chunk order
    (``h_out = M h_in + E``), composed by a fixed binary tree: at each level neighbours ``(0, 1),
    (2, 3), ...`` are joined, ``(T2, B2) o (T1, B1) = (T2 T1, T2 B1 + B2)``, and an odd last one
    moves up unchanged. The tree, so the order of every rounding, depends on ``n`` alone. Every
    product by ``mm``."""
    if t.shape[0] == 0:
        raise ValueError("compose_maps: expected at least one chunk")
    while t.shape[0] > 1:
        even = t.shape[0] // 2 * 2
        first_t, first_b, then_t, then_b = t[0:even:2], b[0:even:2], t[1:even:2], b[1:even:2]
        joined_t, joined_b = mm(then_t, first_t), mm(then_t, first_b) + then_b
        t, b = torch.cat([joined_t, t[even:]]), torch.cat([joined_b, b[even:]])
    return t[0], b[0]


def warmup_starts(chunk_decay: torch.Tensor, starts: list[int], log_bound: float = LOG_BOUND) -> torch.Tensor:
    """Where each segment's warm-up starts, per value head: for a segment starting at chunk ``s`` of a
    document (``starts``, chunk indices from the document's first chunk), the largest ``w < s`` whose
    chunks ``[w, s)`` decay by at most ``log_bound`` in all (``chunk_decay[w:s].sum() <= log_bound``),
    or 0 (the document's start, whose true initial state drops nothing) where no run is long enough.
    ``chunk_decay`` ``[NC, HV]``: each chunk's summed log decay (``g_cum[..., -1]``, <= 0). Returns
    ``[len(starts), HV]`` (int64).

    Why the cut is safe: per token the state's transition is ``e^g (I - beta k k^T)``, symmetric
    with eigenvalues ``e^g`` and ``e^g (1 - beta ||k||^2)``; with ``0 <= beta ||k||^2 <= 2`` (the L2
    norm, even with its keys rounded to bf16, and beta a sigmoid) its norm is at most ``e^g``. So a
    walk from zero over ``[w, s)`` misses the true state at ``s`` by ``P S_w``, with
    ``||P S_w|| <= e^{sum} ||S_w||``. Without the L2 norm there is no such bound."""
    if (chunk_decay > 0).any():
        raise ValueError("warmup_starts: a chunk's log decay is at most 0")
    if any(not 0 <= s <= chunk_decay.shape[0] for s in starts):
        raise ValueError(f"warmup_starts: segment starts are chunks 0 to {chunk_decay.shape[0]}, got {starts}")
    prefix = torch.cat([chunk_decay.new_zeros(1, chunk_decay.shape[1]), chunk_decay.cumsum(0)])  # [NC + 1, HV]
    out = []
    for s in starts:
        # prefix[s] - prefix[w] <= log_bound  <=>  prefix[w] >= prefix[s] - log_bound; prefix falls with w
        ok = prefix[:s] >= prefix[s] - log_bound  # [s, HV]: true for w up to the last that qualifies
        out.append(torch.where(ok.any(0), ok.sum(0) - 1, torch.zeros_like(ok.sum(0))))
    return torch.stack(out) if out else chunk_decay.new_zeros(0, chunk_decay.shape[1], dtype=torch.int64)
