"""Public API of Gated DeltaNet: :func:`chunk_gdn`.

Keyword-compatible with flash-linear-attention's ``chunk_gated_delta_rule``. The Triton backend
runs the chunked forward as four stage kernels (:mod:`dsfuse.gdn.schedule`); its backward is not
written yet, so a call that needs gradients is served by the reference (``backend="auto"``) or
refused (``backend="triton"``), never given wrong or missing gradients.
"""

from __future__ import annotations

import torch

from dsfuse._common import (
    FLOAT_DTYPES,
    REFERENCE,
    OpBackends,
    check_dtype,
    check_contiguous,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    register,
)
from dsfuse.gdn import schedule
from dsfuse.gdn.reference import chunk_gdn_reference
from dsfuse.gdn.triton import cumsum, output, state, wy

__all__ = ["chunk_gdn"]

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)  # the head dims the Triton stages are written for
BACKENDS = register(OpBackends(
    "gdn",
    kernels={"triton": ("dsfuse.gdn.triton.cumsum", "dsfuse.gdn.triton.wy", "dsfuse.gdn.triton.state",
                        "dsfuse.gdn.triton.output")},
    dtypes={"triton": FUSED_DTYPES},
))
TRITON_FORWARD = schedule.ForwardStages(cumsum=cumsum.launch_chunk_cumsum, wy=wy.launch_wy,
                                        state=state.launch_state_pass, output=output.launch_output)


def _document_bounds(cu_seqlens, batch: int, tokens: int) -> list[int]:
    """``cu_seqlens``: int32/int64 ``[N + 1]``, non-decreasing from 0 to ``T``, with ``B = 1``."""
    check_tensor("cu_seqlens", cu_seqlens)
    check_dtype("cu_seqlens", cu_seqlens, (torch.int32, torch.int64))
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: documents are packed in one row, expected B = 1, got B = {batch}")
    bounds = cu_seqlens.tolist()  # one device-to-host copy for a CUDA tensor
    if bounds[0] != 0 or bounds[-1] != tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {tokens}, got {bounds}")
    return bounds


def _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> list[int] | None:
    """Every argument; returns the document bounds read from ``cu_seqlens`` (None without it)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor(name, t)
    if q.ndim != 4:
        raise ValueError(f"q: expected [B, T, H, K], got shape {list(q.shape)}")
    batch, tokens, heads, dim_k = q.shape
    check_shape("k", k, (batch, tokens, heads, dim_k), "the shape of q")
    if v.ndim != 4 or tuple(v.shape[:2]) != (batch, tokens):
        raise ValueError(f"v: expected [B, T, HV, V] = [{batch}, {tokens}, *, *], got shape {list(v.shape)}")
    heads_v = v.shape[2]
    if heads_v % heads:
        raise ValueError(f"v: the value heads HV = {heads_v} must be a multiple of the qk heads H = {heads}")
    check_shape("g", g, (batch, tokens, heads_v), "[B, T, HV] log decay")
    check_shape("beta", beta, (batch, tokens, heads_v), "[B, T, HV]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_same_dtype("k", k, "q", q)
    check_same_dtype("v", v, "q", q)
    check_dtype("g", g, (torch.float32,))
    if beta.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"beta: expected dtype {str(q.dtype).removeprefix('torch.')} (that of q) or float32, "
                        f"got {str(beta.dtype).removeprefix('torch.')}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    bounds = _document_bounds(cu_seqlens, batch, tokens) if cu_seqlens is not None else None
    num_seqs = batch if bounds is None else len(bounds) - 1
    if initial_state is not None:
        check_dtype("initial_state", initial_state, (torch.float32,))
        check_shape("initial_state", initial_state, (num_seqs, heads_v, dim_k, v.shape[3]), "[N, HV, K, V]")
        check_contiguous("initial_state", initial_state, "[N, HV, K, V]")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale: expected a float > 0 or None (K ** -0.5), got {scale!r}")
    return bounds


def _reasons_against_fused(q, k, v, g, beta, initial_state) -> list[str]:
    reasons = []
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)):
        reasons.append("an input requires grad and the Triton backward is not written yet (the reference's "
                       "autograd serves gradients)")
    for name, dim in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if dim not in HEAD_DIMS:
            reasons.append(f"head dim {name} = {dim} is not one of {HEAD_DIMS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            reasons.append(f"{name} has channel stride {t.stride(-1)} (the kernels read unit-stride channels)")
    if beta.dtype != q.dtype:
        reasons.append("beta's dtype differs from q's")
    return reasons


def chunk_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet, chunked: ``(o, final_state)``.

    Args:
        q: ``[B, T, H, K]`` queries (bf16/fp16/fp32 fused; any token and head strides, unit
            channel stride: e.g. head views of a packed row).
        k: ``[B, T, H, K]`` keys, the dtype of ``q``.
        v: ``[B, T, HV, V]`` values, the dtype of ``q``; ``HV`` a multiple of ``H`` (value head
            ``j`` reads qk head ``j // (HV // H)``).
        g: fp32 ``[B, T, HV]`` log decay (``g <= 0``).
        beta: ``[B, T, HV]``, the dtype of ``q`` (or fp32: served by the reference).
        scale: the output scale, default ``K ** -0.5``.
        initial_state: fp32 contiguous ``[N, HV, K, V]`` or None (zeros).
        output_final_state: also return the final state ``[N, HV, K, V]`` (fp32; fp64 for fp64
            inputs, which only the reference serves).
        cu_seqlens: int32/int64 ``[N + 1]`` document offsets in one packed row (``B = 1``),
            non-decreasing from 0 to ``T``; read on the host once per call (a CUDA tensor costs
            one device-to-host copy, so the call cannot be captured in a CUDA Graph).
        use_qk_l2norm_in_kernel: normalise q and k over the head dim first
            (``x * rsqrt(sum(x^2) + 1e-6)``).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        The pair ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in ``v``'s dtype, and the final
        state (or None).

    Gradients: the Triton backward is not written yet. Under autograd (an input requiring grad),
    ``"auto"`` takes the reference (the chunked algorithm in eager fp32, differentiable) and
    ``"triton"`` raises.
    """
    bounds = _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    which = BACKENDS.choose(backend, v.device, v.dtype, _reasons_against_fused(q, k, v, g, beta, initial_state))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if which == REFERENCE:
        compute = torch.float64 if v.dtype == torch.float64 else torch.float32
        return chunk_gdn_reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                   use_qk_l2norm_in_kernel, compute_dtype=compute)
    return schedule.forward(TRITON_FORWARD, q, k, v, g, beta, scale=float(scale), initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=bounds,
                            use_qk_l2norm=use_qk_l2norm_in_kernel)
