"""Each chunk's step of the chunked state pass as an affine map of the state, and a run of chunks'
maps composed by a fixed binary tree instead of a walk: the algebra of the long-document split's
cheaper maps (`experiments/gdn/notes/long-document-split.md`, "Next: maps without a walk"), in plain
PyTorch, as the oracle a kernel would be checked against. Nothing here serves a call.

Layouts as `dsfuse.gdn.reference`'s stages: ``[NC, HV, C, ...]`` chunks, ``g_cum`` the chunk-local
cumulative gate (padding holding the last token's value).
"""

from __future__ import annotations

import torch


def chunk_affine_maps(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g_cum: torch.Tensor):
    """Each chunk's step of `chunk_state_pass` as an affine map of the state, ``h_next = T h + B``::

        T = exp(G_last) I - (k * exp(G_last - G))^T w      # [NC, HV, K, K]
        B = (k * exp(G_last - G))^T u                       # [NC, HV, K, V]: the step from h = 0

    A run of chunks composes to one such map (`compose_maps`), the segment's ``(M, E)`` of
    `dsfuse.gdn.split`, without walking the state through the chunks."""
    g_last = g_cum[..., -1]  # [NC, HV]
    k_decayed = k * (g_last[..., None] - g_cum).exp()[..., None]  # [NC, HV, C, K]
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    t = g_last.exp()[..., None, None] * eye - k_decayed.transpose(-1, -2) @ w
    return t, k_decayed.transpose(-1, -2) @ u


def compose_maps(t: torch.Tensor, b: torch.Tensor):
    """``(M, E)`` of a run of chunk maps ``t`` ``[n, ..., K, K]``, ``b`` ``[n, ..., K, V]`` in chunk order
    (``h_out = M h_in + E``), composed by a fixed binary tree: at each level neighbours ``(0, 1),
    (2, 3), ...`` are joined, ``(T2, B2) o (T1, B1) = (T2 T1, T2 B1 + B2)``, and an odd last one
    moves up unchanged. The tree, so the order of every rounding, depends on ``n`` alone."""
    if t.shape[0] == 0:
        raise ValueError("compose_maps: expected at least one chunk")
    while t.shape[0] > 1:
        even = t.shape[0] // 2 * 2
        first_t, first_b, then_t, then_b = t[0:even:2], b[0:even:2], t[1:even:2], b[1:even:2]
        joined_t, joined_b = then_t @ first_t, then_t @ first_b + then_b
        t, b = torch.cat([joined_t, t[even:]]), torch.cat([joined_b, b[even:]])
    return t[0], b[0]
