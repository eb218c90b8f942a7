"""DeepSeek-V4.1 vision RoPE: the math contract in plain PyTorch (the oracle).

The vision encoder's attention front end, as the source model computes it:

```text
qkv = wqkv(x)                                   # [T, 3 * H * D]: q | k | v column blocks
q, k, v = (t.view(T, H, D) for t in qkv.chunk(3, -1))
q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)   # split-half pairs (i, i + D/2)
o = sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))   # 3D [H, T, D]: math path
```

With 3D inputs SDPA runs its math path, so the gradients reaching the front end
arrive as dq and dv in ``[H, T, D]`` storage (contiguous) and dk as the
transpose of a contiguous ``[H, D, T]`` buffer. The fused backward consumes those
layouts and writes ``dqkv`` ``[T, 3 * H * D]``, the gradient of ``qkv``.

Rounding contract: fp32 tables; every product and every sum rounds separately in
fp32 (no FMA), then one round-to-nearest-even to bf16. Then
``dx1 = g1 * cos + g2 * sin`` and ``dx2 = g2 * cos - g1 * sin`` equal eager
autograd bit for bit (a sum of two rounded products does not depend on order).
"""

from __future__ import annotations

import torch


def vision_cos_sin(n_h: int, n_w: int, dim: int = 32, theta: float = 10000.0,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` ``[T, dim]`` for an ``n_h x n_w`` patch grid (``T = n_h * n_w``, row-major).

    The first ``dim / 2`` angles are the row position times the ``dim / 2``
    inverse frequencies ``theta^(-2i/dim)``, the last ``dim / 2`` the column
    position times the same frequencies. ``dim`` is half the head dim (32 for 64).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    hpos = torch.arange(n_h, device=device)[:, None].expand(n_h, n_w)
    wpos = torch.arange(n_w, device=device)[None, :].expand(n_h, n_w)
    freqs = torch.stack([hpos, wpos], -1).reshape(-1, 2, 1).float() * inv_freq
    freqs = freqs.flatten(1)
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-half rotary of ``x`` ``[T, H, D]`` with ``cos, sin`` ``[T, D/2]`` (the model's formula)."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def attention_front(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int):
    """``qkv`` ``[T, 3HD]`` -> rotated ``q, k`` and ``v`` as ``[H, T, D]`` views, as the model feeds SDPA."""
    tokens = qkv.shape[0]
    q, k, v = (t.view(tokens, heads, -1) for t in qkv.chunk(3, -1))
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)


def attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The model's attention core: front end then 3D SDPA (math path); returns ``o`` ``[H, T, D]``."""
    q, k, v = attention_front(qkv, cos, sin, heads)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def vision_rope_backward_reference(dq_htd: torch.Tensor, dk_hdt: torch.Tensor, dv_htd: torch.Tensor,
                                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary backward and packing by the contract's formula, in eager PyTorch.

    ``dq_htd``/``dv_htd`` ``[H, T, D]``, ``dk_hdt`` ``[H, D, T]`` (any strides),
    ``cos``/``sin`` fp32 ``[T, D/2]``; returns ``dqkv`` ``[T, 3HD]`` in the gradients' dtype.
    """
    heads, tokens, dim = dq_htd.shape

    def unrotate(g_htd: torch.Tensor) -> torch.Tensor:
        g1, g2 = g_htd.float().chunk(2, dim=-1)
        c, s = cos[None], sin[None]
        return torch.cat([g1 * c + g2 * s, g2 * c - g1 * s], -1).to(g_htd.dtype)

    dq = unrotate(dq_htd)
    dk = unrotate(dk_hdt.transpose(1, 2))
    pack = [g.transpose(0, 1).reshape(tokens, heads * dim) for g in (dq, dk, dv_htd)]
    return torch.cat(pack, -1)


def vision_rope_backward_autograd(dq_htd: torch.Tensor, dk_hdt: torch.Tensor, dv_htd: torch.Tensor,
                                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``dqkv`` through eager autograd of ``attention_front`` (the model's own backward)."""
    heads, tokens, dim = dq_htd.shape
    qkv = torch.zeros(tokens, 3 * heads * dim, dtype=dq_htd.dtype, device=dq_htd.device, requires_grad=True)
    q, k, v = attention_front(qkv, cos, sin, heads)
    (dqkv,) = torch.autograd.grad((q, k, v), qkv, (dq_htd, dk_hdt.transpose(1, 2), dv_htd))
    return dqkv
