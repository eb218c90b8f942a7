"""Gated DeltaNet forward output stage: every chunk's output from its starting state.

One program per (chunk, value head, block of ``BV`` value channels), chunks of ``C = BT = 64``
tokens from the chunk table (the last chunk of a document may be short;
:func:`dsfuse.gdn.reference.chunk_output` is the math)::

    o = scale * [exp(G) * (q @ h) + tril(q @ k^T * Gamma) @ v_new],   Gamma_ij = exp(G_i - G_j), j <= i

``exp(G)`` scales the rows of the fp32 product ``q @ h`` (the same as ``(q * exp(G)) @ h``
without rounding ``q * exp(G)`` to the dot dtype). The causal mask (``j <= i``, both tokens in
the chunk) is applied to the exponent before ``exp`` and to the product after it, so only
``G_i - G_j <= 0`` and ``G_i <= 0`` are exponentiated. ``k`` is loaded transposed
(``[K, BT]``, swapped strides) so no dot result is transposed (Triton 3.6 on Hopper
miscompiles ``tl.trans`` of a wgmma accumulator).

Precision: bf16/fp16 inputs multiply bf16/fp16 operands with fp32 accumulation (the masked
``q k^T * Gamma`` is rounded to the input dtype before its product with ``v_new``); fp32 inputs
multiply in full fp32 (``input_precision="ieee"``, not TF32). ``USE_QK_L2NORM`` normalises
``q`` and ``k`` rows in fp32 (``x * rsqrt(sum x^2 + 1e-6)``) before rounding them to the dot
dtype, as the state and WY stages do.

Layouts (packed tokens): ``q``, ``k`` ``[T, H, K]``; ``v_new``, ``o`` ``[T, HV, V]`` (any token
and head strides, unit channel stride); ``g_cum`` fp32 ``[T, HV]``; ``h`` ``[NC, HV, K, V]``
contiguous (the state pass's). Value head ``i_hv`` reads qk head ``i_hv // (HV // H)``.
``o`` is written in its own dtype (``v``'s). Tokens in no chunk (past ``cu_seqlens[-1]``) get
``o = 0`` from one extra row of programs (``i_c == NC``), so every element is written without a
host sync; no atomics. Grid: one axis of ``(NC + 1) * HV * (V // BV)`` programs, value block
fastest, then value head (grouped heads read the same q and k), then chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse._common.aot import AotSpec
from dsfuse.gdn.triton.state import (
    CHUNK,
    L2NORM_EPS,
    _dot,
    _round,
    dot_precision,
    emulate_bf16,
)

# Launch constants (no autotuner): 128 value channels per program (min(BLOCK_V, V)), 4 warps.
# H200, Triton 3.6, the model's shape (T = 32768 in five documents, (H, HV) = (16, 48),
# K = V = 128, bf16, L2 norm), median of triton.testing.do_bench: 0.82 ms, against 1.18 ms for
# (64, 4 warps), 1.61 (32, 4), 1.40 (128, 8), 2.12 (64, 8); num_stages 1, 2, 3 alike (no loop);
# every setting gave bitwise the same o. Compiles without spills (AOT_SPECS).
BLOCK_V = 128
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit(do_not_specialize=["T", "NC"])
def _output_kernel(
    q_ptr,  # [T, H, K], unit channel stride
    k_ptr,  # [T, H, K]
    vn_ptr,  # v_new [T, HV, V]
    h_ptr,  # [NC, HV, K, V] contiguous: state at each chunk's start
    g_ptr,  # g_cum fp32 [T, HV]
    ci_ptr,  # chunk_indices int32 [NC, 3] (sequence, start, end)
    o_ptr,  # [T, HV, V]
    scale,  # fp32
    T,
    NC,
    s_qt, s_qh,
    s_kt, s_kh,
    s_vt, s_vh,
    s_gt, s_gh,
    s_ot, s_oh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # HV // H
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32); ignored for bf16/fp16
    EMULATE_BF16: tl.constexpr,  # CPU interpreter with bf16 data only (see state._dot, state._round)
):
    NV: tl.constexpr = V // BV
    i_p = tl.program_id(0)
    i_v = i_p % NV
    i_hv = (i_p // NV) % HV
    i_c = i_p // (NV * HV)  # in [0, NC]; NC: the tail of tokens in no chunk
    i_h = i_hv // GROUP

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_i = tl.arange(0, BT)
    dtype = q_ptr.dtype.element_ty

    if i_c < NC:
        i_c64 = i_c.to(tl.int64)
        bos = tl.load(ci_ptr + i_c64 * 3 + 1).to(tl.int64)
        eos = tl.load(ci_ptr + i_c64 * 3 + 2).to(tl.int64)
        o_t = bos + o_i  # [BT] int64 token offsets
        m_t = o_t < eos

        p_q = q_ptr + o_t[:, None] * s_qt + i_h * s_qh + o_k[None, :]
        b_q = tl.load(p_q, mask=m_t[:, None], other=0.0)  # [BT, K]
        p_k = k_ptr + o_t[None, :] * s_kt + i_h * s_kh + o_k[:, None]
        b_k = tl.load(p_k, mask=m_t[None, :], other=0.0)  # [K, BT]: k transposed from memory
        if USE_QK_L2NORM:
            b_qf = b_q.to(tl.float32)
            b_q = _round(b_qf * tl.rsqrt(tl.sum(b_qf * b_qf, axis=1) + L2NORM_EPS)[:, None], dtype, EMULATE_BF16)
            b_kf = b_k.to(tl.float32)
            b_k = _round(b_kf * tl.rsqrt(tl.sum(b_kf * b_kf, axis=0) + L2NORM_EPS)[None, :], dtype, EMULATE_BF16)

        p_h = h_ptr + (i_c64 * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(p_h)  # [K, BV]
        b_o = _dot(b_q, b_h, None, DOT_PRECISION, EMULATE_BF16)  # [BT, K] @ [K, BV] -> [BT, BV]
        b_A = _dot(b_q, b_k, None, DOT_PRECISION, EMULATE_BF16)  # [BT, K] @ [K, BT] -> [BT, BT]

        b_g = tl.load(g_ptr + o_t * s_gt + i_hv * s_gh, mask=m_t, other=0.0)  # [BT], <= 0
        b_o = b_o * tl.exp(b_g)[:, None]
        m_A = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]  # [BT, BT] causal, in the chunk
        b_A = tl.where(m_A, b_A * tl.exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.0)), 0.0)

        p_vn = vn_ptr + o_t[:, None] * s_vt + i_hv * s_vh + o_v[None, :]
        b_vn = tl.load(p_vn, mask=m_t[:, None], other=0.0)  # [BT, BV]
        b_o = _dot(_round(b_A, dtype, EMULATE_BF16), b_vn, b_o, DOT_PRECISION, EMULATE_BF16)  # [BT, BT] @ [BT, BV]
        b_o = b_o * scale

        p_o = o_ptr + o_t[:, None] * s_ot + i_hv * s_oh + o_v[None, :]
        tl.store(p_o, _round(b_o, o_ptr.dtype.element_ty, EMULATE_BF16), mask=m_t[:, None])
    else:
        # tokens past the last chunk's end (past cu_seqlens[-1]) belong to no chunk: o = 0
        tail = tl.load(ci_ptr + (NC - 1).to(tl.int64) * 3 + 2, mask=NC > 0, other=0)  # last chunk's end
        b_zero = tl.zeros([BT, BV], dtype=o_ptr.dtype.element_ty)
        i_t = tail.to(tl.int64)
        while i_t < T:  # a while loop: runtime bounds, also in the interpreter
            o_t = i_t + o_i
            p_o = o_ptr + o_t[:, None] * s_ot + i_hv * s_oh + o_v[None, :]
            tl.store(p_o, b_zero, mask=(o_t < T)[:, None])
            i_t += BT


def block_v(V: int) -> int:
    return min(BLOCK_V, V)


def launch_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    g_cum: torch.Tensor,
    chunk_indices: torch.Tensor,
    scale: float,
    o: torch.Tensor,
    *,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Write the output into ``o`` ``[T, HV, V]`` (``v``'s dtype) and return it.

    ``q``, ``k`` ``[T, H, K]``; ``v_new`` ``[T, HV, V]``; ``h`` ``[NC, HV, K, V]`` contiguous;
    ``g_cum`` fp32 ``[T, HV]``; ``chunk_indices`` int32 ``[NC, 3]``; ``use_qk_l2norm``
    normalises q and k in the kernel. Arguments are validated by the public API.
    """
    T, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    NC = chunk_indices.shape[0]
    BV = block_v(V)
    programs = (NC + 1) * HV * (V // BV)
    if programs >= 2**31:
        raise ValueError(f"chunk_indices: at most 2**31 - 1 programs (chunks x heads x value blocks), got {programs}")
    _output_kernel[(programs,)](
        q, k, v_new, h, g_cum, chunk_indices, o,
        float(scale), T, NC,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v_new.stride(0), v_new.stride(1),
        g_cum.stride(0), g_cum.stride(1),
        o.stride(0), o.stride(1),
        HV=HV, GROUP=HV // H, K=K, V=V, BT=CHUNK, BV=BV,
        USE_QK_L2NORM=use_qk_l2norm,
        DOT_PRECISION=dot_precision(q.dtype),
        EMULATE_BF16=emulate_bf16(q.dtype),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return o


def _aot_specs() -> list[AotSpec]:
    """The model's specialisations: K = V = 128, H = 16, HV = 48, bf16, BT = 64; packed q/k/v row.

    q, k are head views of the packed row ``[T, (2H + HV) * 128]`` (token stride 10240, head
    stride 128); v_new, o ``[T, 48, 128]``; g_cum ``[T, 48]`` dense (head stride 1).
    With and without the in-kernel L2 norm.
    """
    K = V = 128
    H, HV = 16, 48
    signature = {
        "q_ptr": "*bf16", "k_ptr": "*bf16", "vn_ptr": "*bf16", "h_ptr": "*bf16", "g_ptr": "*fp32",
        "ci_ptr": "*i32", "o_ptr": "*bf16", "scale": "fp32", "T": "i32", "NC": "i32",
        "s_qt": "i32", "s_qh": "i32", "s_kt": "i32", "s_kh": "i32", "s_vt": "i32", "s_vh": "i32",
        "s_gt": "i32", "s_ot": "i32", "s_oh": "i32",
    }
    return [
        AotSpec(
            name=f"gdn_output{'_l2' if l2 else ''}_bf16",
            kernel=_output_kernel,
            signature=signature,
            constexprs={
                "s_gh": 1, "HV": HV, "GROUP": HV // H, "K": K, "V": V, "BT": CHUNK, "BV": block_v(V),
                "USE_QK_L2NORM": l2, "DOT_PRECISION": dot_precision(torch.bfloat16), "EMULATE_BF16": False,
            },
            options={"num_warps": NUM_WARPS, "num_stages": NUM_STAGES},
            divisible_by_16=tuple(n for n in signature if n.endswith("_ptr") or n.startswith("s_")),
        )
        for l2 in (True, False)
    ]


AOT_SPECS = _aot_specs()
