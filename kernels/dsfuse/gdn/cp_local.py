"""The local passes of context parallelism (``dsfuse.gdn.cp.LocalPasses``) for each backend.

A fused backend (`fused_passes`, given its stage tables by the caller, which read them from the
registry): the forward and backward stages of ``dsfuse.gdn.schedule``, exactly as a call without
context parallelism runs them (so a world of one rank gives the same bits), the gradients of packed
q/k/v views written into one packed row; the incoming state's gradient alone (``first_dh0``) runs
only the stages it depends on (``dsfuse.gdn.schedule.DH0_STAGES``) over the first document.

Reference: the chunked PyTorch reference, its backward by ``torch.autograd.grad`` of a recomputed
forward (the CPU path of the tests).
"""

from __future__ import annotations

import torch

from dsfuse.gdn import schedule
from dsfuse.gdn.cp import LocalPasses
from dsfuse.gdn.packed import packed_grad_row
from dsfuse.gdn.reference import chunk_gdn_reference


def fused_passes(forward_stages: schedule.ForwardStages, backward_stages: schedule.BackwardStages, scale: float,
                 use_qk_l2norm: bool) -> LocalPasses:
    """The local passes of a fused backend, run by its stage tables."""
    common = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)

    def forward(q, k, v, g, beta, h0, bounds):
        out = schedule.forward(forward_stages, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               cu_seqlens=bounds, **common)
        return out.o, out.final_state, (q, k, v, beta, h0, bounds, out.g_cum, out.A)

    def backward(saved, do, dht):
        q, k, v, beta, h0, bounds, g_cum, A = saved
        views = packed_grad_row(q, k, v)
        dq, dk, dv = (None, None, None) if views is None else views[1:]
        do = do if do.stride(-1) == 1 else do.contiguous()
        dht = None if dht is None else dht.contiguous()
        return tuple(schedule.backward(backward_stages, q, k, v, beta, g_cum, A, do, dht, initial_state=h0,
                                       cu_seqlens=bounds, dq=dq, dk=dk, dv=dv, **common))

    def first_dh0(saved, do, dht, length):
        q, k, v, beta, h0, _, g_cum, A = saved
        do = do if do.stride(-1) == 1 else do.contiguous()
        first = [t[:, :length] for t in (q, k, v, beta)]
        dht = None if dht is None else dht[None].contiguous()
        calls, grads = schedule.backward_calls(backward_stages, *first, g_cum[:length], A[:length], do[:, :length],
                                               dht, initial_state=h0[:1], cu_seqlens=[0, length], **common)
        names = [name for name, _ in calls]
        if not set(schedule.DH0_STAGES) <= set(names):
            raise RuntimeError(f"gdn: the backward has stages {names}, not all of DH0_STAGES {schedule.DH0_STAGES}")
        for name, launch in calls:
            if name in schedule.DH0_STAGES:
                launch()
        return grads.dh0[0]

    return LocalPasses(forward, backward, first_dh0)


def reference_passes(scale: float, use_qk_l2norm: bool, compute_dtype: torch.dtype) -> LocalPasses:
    def run(q, k, v, g, beta, h0, bounds):
        cu_seqlens = torch.tensor(bounds, dtype=torch.int64)
        return chunk_gdn_reference(q, k, v, g, beta, scale, h0, True, cu_seqlens, use_qk_l2norm,
                                   compute_dtype=compute_dtype)

    def forward(q, k, v, g, beta, h0, bounds):
        o, ht = run(q, k, v, g, beta, h0, bounds)
        return o, ht, (q, k, v, g, beta, h0, bounds)

    def backward(saved, do, dht):
        *tensors, bounds = saved
        leaves = [None if t is None else t.detach().requires_grad_() for t in tensors]
        with torch.enable_grad():
            o, ht = run(*leaves, bounds)
            used = [t for t in leaves if t is not None]
            outputs, grads_out = ((o, ht), (do, dht)) if dht is not None else ((o,), (do,))
            grads = iter(torch.autograd.grad(outputs, used, grads_out, allow_unused=True))
        return tuple(None if t is None else _zero_if_none(next(grads), t) for t in leaves)

    def first_dh0(saved, do, dht, length):
        q, k, v, g, beta, h0, _ = saved
        first = [t[:, :length] for t in (q, k, v, g, beta)]
        h0_first = h0[:1].detach().requires_grad_()
        with torch.enable_grad():
            o, ht = run(*first, h0_first, [0, length])
            outputs, grads_out = ((o, ht), (do[:, :length], dht[None])) if dht is not None \
                else ((o,), (do[:, :length],))
            (grad,) = torch.autograd.grad(outputs, [h0_first], grads_out)
        return grad[0]

    return LocalPasses(forward, backward, first_dh0)


def _zero_if_none(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad
