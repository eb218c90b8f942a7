"""DeepSeek-V4.1 Engram gate (four hyper-connection streams): the math contract in plain PyTorch.

Layouts: ``x`` ``[N, S, D]`` bf16 (``S = 4`` residual streams of width ``D = 5120``);
``kv`` ``[N, (S + 1) * D]`` bf16 holding ``S`` keys (one per stream) and then one
shared value; ``weight`` fp32 ``[S, D]`` (the model's ``q_weight * k_weight``);
``token_mask`` bool ``[N]`` (False for image tokens and padding):

```text
h = x.float();  key = kv[:, :S*D].float().view(N, S, D);  value = kv[:, S*D:].float()
rx = rsqrt(mean(h * h, -1) + eps);  rk = rsqrt(mean(key * key, -1) + eps)          # [N, S]
dot = sum(h * weight * key, -1) * rx * rk * D ** -0.5                            # [N, S]
gate = sigmoid(copysign(sqrt(max(|dot|, clamp)), dot))                           # signed root
gate = where(token_mask[:, None], gate, 0)
out = (h + gate[..., None] * value[:, None, :]).to(x.dtype)
```

``copysign`` at ``dot == 0`` gives ``sigmoid(+sqrt(clamp))``, not 0.5. The saved
state ``[N, S, 4]`` fp32 holds ``(gate, dot, rx, rk)`` per token and stream.
"""

from __future__ import annotations

import torch

SAVED_FIELDS = ("gate", "dot", "rx", "rk")


def engram_gate_reference(x, kv, weight, token_mask, *, eps: float, clamp: float = 1e-6,
                          compute_dtype: torch.dtype = torch.float32):
    """The gate as the model computes it (``compute_dtype`` fp32), or in fp64 for tolerance checks.

    Returns ``(out, saved)``: ``out`` in ``x``'s dtype (fp64 when computing in fp64),
    ``saved`` ``[N, S, 4]`` = (gate, dot, rx, rk) in ``compute_dtype``.
    """
    n, streams, dim = x.shape
    h = x.to(compute_dtype)
    key = kv[:, : streams * dim].to(compute_dtype).unflatten(-1, (streams, dim))
    value = kv[:, streams * dim :].to(compute_dtype)
    w = weight.to(compute_dtype)
    rx = torch.rsqrt((h * h).mean(-1) + eps)
    rk = torch.rsqrt((key * key).mean(-1) + eps)
    dot = (h * w * key).sum(-1) * rx * rk * dim**-0.5
    gate = torch.sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp_min(clamp)), dot))
    gate = torch.where(token_mask[:, None], gate, torch.zeros_like(gate))
    out = h + gate[..., None] * value[:, None, :]
    if compute_dtype == torch.float32:
        out = out.to(x.dtype)
    return out, torch.stack([gate, dot, rx, rk], -1)


def engram_gate_backward_reference(dout, x, kv, weight, token_mask, *, eps: float, clamp: float = 1e-6,
                                   compute_dtype: torch.dtype = torch.float64):
    """``(dx, dkv, dweight)`` by autograd of ``engram_gate_reference`` in ``compute_dtype``.

    ``dkv`` is packed like ``kv``: the ``S`` key gradients, then the value gradient.
    """
    xs = x.to(compute_dtype).requires_grad_()
    kvs = kv.to(compute_dtype).requires_grad_()
    ws = weight.to(compute_dtype).requires_grad_()
    out, _ = engram_gate_reference(xs, kvs, ws, token_mask, eps=eps, clamp=clamp, compute_dtype=compute_dtype)
    return torch.autograd.grad(out, (xs, kvs, ws), dout.to(compute_dtype))


def engram_gate_backward_from_saved(dout, x, kv, weight, saved, *, clamp: float = 1e-6,
                                    compute_dtype: torch.dtype = torch.float64):
    """``(dx, dkv, dweight)`` by the explicit backward formula from a given saved state.

    The forward's scores are ill-conditioned where ``|dot|`` is small (the signed root's
    slope is ``1 / (2 sqrt|dot|)``), so two correct fp32 forwards can differ there far
    more than their own rounding. Starting the backward from the same ``saved``
    ``(gate, dot, rx, rk)`` isolates the backward's arithmetic:

    ```text
    G = sum_d dout * value;  ddot = G * gate * (1 - gate) / (2 sqrt|dot|)  (0 where |dot| < clamp)
    a = ddot * rx * rk / sqrt(D);  bx = ddot * dot * rx^2 / D;  bk = ddot * dot * rk^2 / D
    dx = dout + a * w * key - bx * h;  dkey = a * w * h - bk * key
    dvalue = sum_s gate * dout;  dweight = sum_n a * h * key
    ```

    Args:
        dout (torch.Tensor): ``[N, S, D]`` gradient of the output.
        x (torch.Tensor): ``[N, S, D]``, the forward's input.
        kv (torch.Tensor): ``[N, (S + 1) * D]``, the forward's keys and value.
        weight (torch.Tensor): ``[S, D]``, the forward's weight.
        saved (torch.Tensor): ``[N, S, 4]``, the forward's saved state ``(gate, dot, rx, rk)``.
        clamp: the forward's clamp.
        compute_dtype: the dtype of the arithmetic and of the results (float64 by default).

    Returns:
        (tuple[torch.Tensor, torch.Tensor, torch.Tensor]): The triple ``(dx, dkv, dweight)`` in
            ``compute_dtype``, ``dkv`` packed like ``kv`` (the ``S`` key gradients, then the
            value gradient).
    """
    n, streams, dim = x.shape
    c = compute_dtype
    h, do = x.to(c), dout.to(c)
    key = kv[:, : streams * dim].to(c).unflatten(-1, (streams, dim))
    value = kv[:, streams * dim :].to(c)
    w = weight.to(c)
    gate, dot, rx, rk = saved.to(c).unbind(-1)
    big = dot.abs() >= clamp
    ddot = torch.where(big, (do * value[:, None]).sum(-1) * gate * (1 - gate) / (2 * dot.abs().clamp_min(clamp).sqrt()),
                       torch.zeros_like(dot))
    a = (ddot * rx * rk * dim**-0.5)[..., None]
    bx = (ddot * dot * rx * rx / dim)[..., None]
    bk = (ddot * dot * rk * rk / dim)[..., None]
    dx = do + a * w * key - bx * h
    dkey = a * w * h - bk * key
    dvalue = (gate[..., None] * do).sum(1)
    return dx, torch.cat([dkey.flatten(1), dvalue], -1), (a * h * key).sum(0)
