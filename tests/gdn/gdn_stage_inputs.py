"""Inputs the Gated DeltaNet stage tests share (tests/gdn/test_gdn_stages_*.py): the layouts, the
forward's q, k, v and gates with the extra tensors a stage reads, and strided views of them.

Sizes: K = 32, V = 64 (K != V, so a transposed state cannot pass). Layouts, batch 1: one sequence
of T = 150 (not a multiple of 64); packed documents of 1, 45, 0 and 130 tokens (T = 176, every
token in a document, as the public API requires), and the same followed by 4 tokens in no document
(T = 180: the forward stages leave them at zero); documents of 130, 1 and 200 tokens (3, 1 and 4
chunks) followed by 9 tokens in no document (T = 340: two documents a split cuts, one between them).
"""

from __future__ import annotations

import torch
from helpers import model_like_gates

F64 = torch.float64
DK, DV = 32, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# name: (T, cu_seqlens)
LAYOUTS = {
    "one_seq_T150": (150, [0, 150]),
    "docs_1_45_0_130": (176, [0, 1, 46, 46, 176]),
    "docs_1_45_0_130_tail4": (180, [0, 1, 46, 46, 176]),
    "docs_130_1_200_tail9": (340, [0, 130, 131, 331]),  # two documents a split cuts, one between them
}


def make_inputs(layout, heads, *, l2, gates, dtype, seed=0, dk=DK, dv=DV, extra=()):
    """``(forward, draws)``: q, k ``[1, T, H, K]``, v ``[1, T, HV, V]``, model-made gates and
    ``cu_seqlens``; then the tensors named in ``extra``, drawn in that order from the same generator:
    ``"do"`` ``[T, HV, V]`` (values of ``dtype``), ``"do64"`` the same in fp64 (no rounding),
    ``"h0"`` or ``"dht"`` fp32 ``[N, HV, K, V]``.

    Held in fp32, q, k, v, beta (and ``do``) with values of ``dtype`` (the model's inputs are bf16), so
    the fp64 reference starts from the very inputs the kernels read; g stays fp32."""
    tokens, cu = LAYOUTS[layout]
    h, hv = heads
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, h, dk, generator=gen)
    k = torch.randn(1, tokens, h, dk, generator=gen)
    if not l2:
        k = k * dk**-0.5  # |k| ~ 1 without the L2 norm: the delta rule stays stable
    v = torch.randn(1, tokens, hv, dv, generator=gen)
    g, beta = model_like_gates((1, tokens, hv), gen, gates)
    shapes = {"do": (tokens, hv, dv), "do64": (tokens, hv, dv), "h0": (len(cu) - 1, hv, dk, dv),
              "dht": (len(cu) - 1, hv, dk, dv)}
    draws = {name: torch.randn(*shapes[name], generator=gen, dtype=F64 if name == "do64" else torch.float32)
             for name in extra}
    if "do" in draws:
        draws["do"] = draws["do"].to(dtype).float()
    q, k, v, beta = (x.to(dtype).float() for x in (q, k, v, beta))
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu}, draws


def qk_views(q, k, device, dtype):
    """q and k ``[T, H, K]`` as head views of one buffer ``[T, 2H + 3, K]`` (token stride (2H + 3) K)."""
    tokens, heads, dk = q.shape
    buf = torch.zeros(tokens, 2 * heads + 3, dk, dtype=dtype, device=device)
    buf[:, :heads] = q.to(dtype)
    buf[:, heads:2 * heads] = k.to(dtype)
    return buf[:, :heads], buf[:, heads:2 * heads]


def head_view(x, device, dtype, *, first: bool = True):
    """``x`` ``[T, HV, V]`` as HV heads of a wider buffer ``[T, HV + 1, V]`` (token stride (HV + 1) V):
    its first heads, or (``first=False``) its last."""
    tokens, heads, dim = x.shape
    buf = torch.zeros(tokens, heads + 1, dim, dtype=dtype, device=device)
    part = slice(0, heads) if first else slice(1, heads + 1)
    buf[:, part] = x.to(dtype)
    return buf[:, part]
