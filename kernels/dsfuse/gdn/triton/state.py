"""Gated DeltaNet forward state pass: the sequential scan over each document's chunks.

Per (document, value head, block of ``BV`` value channels) one program carries the state
``b_h`` ``[K, BV]`` in fp32 registers across the document's chunks (``BK = K``: the whole
key dim in one block) and, chunk by chunk (``C = BT = 64`` tokens, the last one possibly
short; :func:`dsfuse.gdn.reference.chunk_state_pass` is the math)::

    h[c]    = b_h                                          # stored in the input dtype
    v_new   = u - w @ b_h                                  # [BT, K] @ [K, BV]
    b_h     = exp(G_last) * b_h + (k * exp(G_last - G))^T @ v_new

and at the document's end ``final_state = b_h`` (fp32, optional). Only ``G_last - G_i <= 0``
(masked to 0 for tokens past the chunk's end before ``exp``) and ``G_last <= 0`` are
exponentiated. The decay ``exp(G_last - G)`` is applied to the rows of ``v_new`` (fp32, one
rounding to the dot dtype) rather than to ``k``: the same product with ``BT * BV`` instead
of ``K * BT`` multiplies and ``k`` enters the dot unrounded. ``k`` is loaded transposed
(``[K, BT]``, swapped strides) so no dot result is ever transposed (Triton 3.6 on Hopper
miscompiles ``tl.trans`` of a wgmma accumulator).

Precision: bf16/fp16 inputs multiply bf16/fp16 operands (``b_h`` rounded to the input dtype,
as it is stored in ``h``) with fp32 accumulation; fp32 inputs multiply in full fp32
(``input_precision="ieee"``, not TF32). ``USE_QK_L2NORM`` normalises each ``k`` row in fp32
(``x * rsqrt(sum x^2 + 1e-6)``) before rounding it to the dot dtype, as the output stage
and the WY stage do.

Layouts (packed tokens, batch flattened, documents by ``cu_seqlens``): ``k`` ``[T, H, K]``,
``w`` ``[T, HV, K]``, ``u`` and ``v_new`` ``[T, HV, V]`` with any token and head strides and
unit channel stride; ``g_cum`` fp32 ``[T, HV]`` (any strides); ``h`` ``[NC, HV, K, V]``,
``initial_state`` and ``final_state`` fp32 ``[N, HV, K, V]`` contiguous. Value head ``i_hv``
reads key head ``i_hv // (HV // H)``. ``h`` is the largest intermediate of the forward:
``NC * HV * K * V`` elements, 0.8 GB in bf16 at T = 32768 (512 chunks), HV = 48, K = V = 128.

Tokens in no chunk (past ``cu_seqlens[-1]``) get ``v_new = 0``: one extra program row
(``i_n == N``) writes them, so every element of ``v_new`` is written without a host sync.
No atomics: every element is written by one program, in a fixed order. Grid: one axis of
``(N + 1) * HV * (V // BV)`` programs, value block fastest, then value head, then document.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from dsfuse._common.aot import AotSpec
from dsfuse._common.backends import interpreting

CHUNK = 64  # BT: tokens per chunk (the chunk table's chunk size)
# Launch constants (no autotuner) per GPU family: (BV value channels per program, warps).
# Hopper and the CPU interpreter: 64 channels, 4 warps (wgmma). H200, Triton 3.6, the model's
# shape (T = 32768 in five documents, (H, HV) = (16, 48), K = V = 128, bf16, L2 norm), median of
# triton.testing.do_bench: 1.29 ms, against 1.34 ms for (32, 4), 1.58 (32, 2), 1.95 (64, 2),
# 1.82 (64, 8); every setting gave bitwise the same h and v_new. Blackwell (compute capability
# >= 10): 32 channels, 2 warps, flash-linear-attention's pin for its fwd_h there (a tl.dot
# recurrence race on Blackwell before Triton 3.8); not measured here. AOT_SPECS compile both
# for sm_90 and sm_100: Hopper's setting at 238-250 registers without spills, the 2-warp one at
# 251-255 registers with up to 16 bytes of spill in the initial/final-state variants.
CONFIG_HOPPER = (64, 4)
CONFIG_BLACKWELL = (32, 2)
NUM_STAGES = 2  # the kernel's default pipelining depth
# The chunk loop on the GPU: a for loop with runtime bounds, software-pipelined this deep (the next
# chunk's loads issued before this chunk's dots finish); the interpreter runs a while loop instead.
LOOP_STAGES = 2
L2NORM_EPS = tl.constexpr(1e-6)  # the reference's l2norm eps


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``acc + a @ b`` with an fp32 accumulator (``acc`` may be None).

    ``EMULATE_BF16`` only in Triton's CPU interpreter with bf16 data, whose ``tl.dot`` multiplies
    bf16 operands as their integer bit patterns: the operands are widened to fp32 (exact), so
    the products and fp32 sums are those of the GPU's bf16 MMA up to summation order."""
    if EMULATE_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _round(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (round to nearest even, as the GPU converts).

    ``EMULATE_BF16`` only in Triton's CPU interpreter, whose fp32 -> bf16 conversion truncates:
    the rounding is done on the bits first (finite values), so the conversion is exact."""
    if EMULATE_BF16 and dtype == tl.bfloat16:
        b_bits = x.to(tl.uint32, bitcast=True)
        b_bits = ((b_bits + 0x7FFF + ((b_bits >> 16) & 1)) >> 16) << 16
        x = b_bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _state_step(b_h, i_c, k_ptr, w_ptr, u_ptr, g_ptr, ci_ptr, h_ptr, vn_ptr, s_kt, s_kh, s_wt, s_wh, s_ut, s_uh,
                s_gt, s_gh, s_vt, s_vh, i_hv, i_h, o_k, o_v, o_i, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                EMULATE_BF16: tl.constexpr):
    """One chunk of the state pass: store ``h`` and ``v_new``, return the next state (fp32)."""
    dtype = w_ptr.dtype.element_ty
    i_c64 = i_c.to(tl.int64)
    bos = tl.load(ci_ptr + i_c64 * 3 + 1).to(tl.int64)
    eos = tl.load(ci_ptr + i_c64 * 3 + 2).to(tl.int64)
    o_t = bos + o_i  # [BT] int64 token offsets
    m_t = o_t < eos

    # the state at the chunk's start
    b_hc = _round(b_h, dtype, EMULATE_BF16)
    p_h = h_ptr + (i_c64 * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
    tl.store(p_h, b_hc)

    # v_new = u - w @ h
    p_w = w_ptr + o_t[:, None] * s_wt + i_hv * s_wh + o_k[None, :]
    b_w = tl.load(p_w, mask=m_t[:, None], other=0.0)  # [BT, K]
    b_wh = _dot(b_w, b_hc, None, DOT_PRECISION, EMULATE_BF16)  # [BT, K] @ [K, BV] -> [BT, BV]
    p_u = u_ptr + o_t[:, None] * s_ut + i_hv * s_uh + o_v[None, :]
    b_v = tl.load(p_u, mask=m_t[:, None], other=0.0).to(tl.float32) - b_wh  # [BT, BV]
    p_vn = vn_ptr + o_t[:, None] * s_vt + i_hv * s_vh + o_v[None, :]
    tl.store(p_vn, _round(b_v, vn_ptr.dtype.element_ty, EMULATE_BF16), mask=m_t[:, None])

    # decays: G_last - G_i <= 0 for tokens in the chunk, masked to 0 before exp
    b_g = tl.load(g_ptr + o_t * s_gt + i_hv * s_gh, mask=m_t, other=0.0)  # [BT]
    b_g_last = tl.load(g_ptr + (eos - 1) * s_gt + i_hv * s_gh)
    b_d = tl.where(m_t, tl.exp(tl.where(m_t, b_g_last - b_g, 0.0)), 0.0)  # [BT]
    b_vd = _round(b_v * b_d[:, None], dtype, EMULATE_BF16)  # [BT, BV]

    # k transposed from memory: [K, BT]
    p_k = k_ptr + o_t[None, :] * s_kt + i_h * s_kh + o_k[:, None]
    b_k = tl.load(p_k, mask=m_t[None, :], other=0.0)  # [K, BT]
    if USE_QK_L2NORM:
        b_kf = b_k.to(tl.float32)
        b_k = _round(b_kf * tl.rsqrt(tl.sum(b_kf * b_kf, axis=0) + L2NORM_EPS)[None, :], dtype, EMULATE_BF16)

    # h = exp(G_last) h + (k * exp(G_last - G))^T v_new
    b_h = b_h * tl.exp(b_g_last)
    b_h = _dot(b_k, b_vd, b_h, DOT_PRECISION, EMULATE_BF16)  # [K, BT] @ [BT, BV] -> [K, BV]
    return b_h


@triton.jit(do_not_specialize=["T", "N"])
def _state_pass_kernel(
    k_ptr,  # [T, H, K], unit channel stride
    w_ptr,  # [T, HV, K]
    u_ptr,  # [T, HV, V]
    g_ptr,  # g_cum fp32 [T, HV] chunk-local cumulative log decay
    ci_ptr,  # chunk_indices int32 [NC, 3] (sequence, start, end)
    co_ptr,  # chunk_offsets int32 [N + 1]
    h0_ptr,  # initial_state fp32 [N, HV, K, V] contiguous (read if USE_INITIAL_STATE)
    h_ptr,  # h [NC, HV, K, V] contiguous, input dtype
    vn_ptr,  # v_new [T, HV, V]
    ht_ptr,  # final_state fp32 [N, HV, K, V] contiguous (written if STORE_FINAL_STATE)
    T,  # tokens
    N,  # sequences
    s_kt, s_kh,
    s_wt, s_wh,
    s_ut, s_uh,
    s_gt, s_gh,
    s_vt, s_vh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # HV // H: value heads per key head
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32); ignored for bf16/fp16
    EMULATE_BF16: tl.constexpr,  # CPU interpreter with bf16 data only (see _dot, _round)
    PIPELINED: tl.constexpr,  # the chunk loop as a pipelined for loop (GPU) or a while loop (interpreter)
    NUM_STAGES_LOOP: tl.constexpr,
):
    NV: tl.constexpr = V // BV
    i_p = tl.program_id(0)
    i_v = i_p % NV
    i_hv = (i_p // NV) % HV
    i_n = i_p // (NV * HV)  # in [0, N]; N: the tail of tokens in no chunk
    i_h = i_hv // GROUP

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_i = tl.arange(0, BT)

    if i_n < N:
        b_h = tl.zeros([K, BV], dtype=tl.float32)
        o_state = (i_n.to(tl.int64) * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]  # [K, BV]
        if USE_INITIAL_STATE:
            b_h += tl.load(h0_ptr + o_state)  # [K, BV]

        i_c = tl.load(co_ptr + i_n)  # the document's chunks [i_c, i_c1)
        i_c1 = tl.load(co_ptr + i_n + 1)
        if PIPELINED:  # a for loop the compiler software-pipelines (loads of the next chunk early)
            for i_c in tl.range(i_c, i_c1, num_stages=NUM_STAGES_LOOP):
                b_h = _state_step(b_h, i_c, k_ptr, w_ptr, u_ptr, g_ptr, ci_ptr, h_ptr, vn_ptr, s_kt, s_kh, s_wt, s_wh,
                                  s_ut, s_uh, s_gt, s_gh, s_vt, s_vh, i_hv, i_h, o_k, o_v, o_i, HV, K, V,
                                  USE_QK_L2NORM, DOT_PRECISION, EMULATE_BF16)
        else:  # the interpreter cannot take runtime bounds in a for loop
            while i_c < i_c1:
                b_h = _state_step(b_h, i_c, k_ptr, w_ptr, u_ptr, g_ptr, ci_ptr, h_ptr, vn_ptr, s_kt, s_kh, s_wt, s_wh,
                                  s_ut, s_uh, s_gt, s_gh, s_vt, s_vh, i_hv, i_h, o_k, o_v, o_i, HV, K, V,
                                  USE_QK_L2NORM, DOT_PRECISION, EMULATE_BF16)
                i_c += 1

        if STORE_FINAL_STATE:
            tl.store(ht_ptr + o_state, b_h)
    else:
        # tokens past the last chunk's end (past cu_seqlens[-1]) belong to no chunk: v_new = 0
        NC = tl.load(co_ptr + N)
        tail = tl.load(ci_ptr + (NC - 1).to(tl.int64) * 3 + 2, mask=NC > 0, other=0)  # last chunk's end
        b_zero = tl.zeros([BT, BV], dtype=vn_ptr.dtype.element_ty)
        i_t = tail.to(tl.int64)
        while i_t < T:  # a while loop: runtime bounds, also in the interpreter
            o_t = i_t + o_i
            p_vn = vn_ptr + o_t[:, None] * s_vt + i_hv * s_vh + o_v[None, :]
            tl.store(p_vn, b_zero, mask=(o_t < T)[:, None])
            i_t += BT


@functools.lru_cache(maxsize=16)
def _blackwell(device_type: str, index: int | None) -> bool:
    return device_type == "cuda" and torch.cuda.get_device_capability(index)[0] >= 10


def family_config(device: torch.device, hopper: tuple[int, int], blackwell: tuple[int, int]) -> tuple[int, int]:
    """A sequential pass's ``(BV, num_warps)`` on ``device``: ``blackwell`` on compute capability
    >= 10, ``hopper`` elsewhere (the CPU interpreter included)."""
    return blackwell if _blackwell(device.type, device.index) else hopper


def launch_config(device: torch.device, V: int) -> tuple[int, int]:
    """``(BV, num_warps)`` of a launch on ``device`` with ``V`` value channels."""
    block_v, num_warps = family_config(device, CONFIG_HOPPER, CONFIG_BLACKWELL)
    return min(block_v, V), num_warps


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 inputs (TF32 is Triton's default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def emulate_bf16(dtype: torch.dtype) -> bool:
    """bf16 data in Triton's CPU interpreter: emulate the GPU's bf16 dots and rounding (``_dot``, ``_round``)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch_state_pass(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor,
    initial_state: torch.Tensor | None,
    h: torch.Tensor,
    v_new: torch.Tensor,
    final_state: torch.Tensor | None,
    *,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the state pass into ``h``, ``v_new`` and (if given) ``final_state``; returns them.

    ``k`` ``[T, H, K]``; ``w`` ``[T, HV, K]``; ``u``, ``v_new`` ``[T, HV, V]`` (unit channel
    stride); ``g_cum`` fp32 ``[T, HV]``; ``chunk_indices`` int32 ``[NC, 3]``;
    ``chunk_offsets`` int32 ``[N + 1]``; ``initial_state`` fp32 ``[N, HV, K, V]`` or None
    (zeros); ``h`` ``[NC, HV, K, V]`` (input dtype); ``final_state`` fp32 ``[N, HV, K, V]``
    or None. States and ``h`` contiguous. ``use_qk_l2norm`` normalises ``k`` in the kernel
    (the same flag as the WY and output stages). Arguments are validated by the public API.
    """
    T, H, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    N = chunk_offsets.shape[0] - 1
    BV, num_warps = launch_config(w.device, V)
    programs = (N + 1) * HV * (V // BV)
    if programs >= 2**31:
        raise ValueError(f"chunk_offsets: at most 2**31 - 1 programs (sequences x heads x value blocks), got {programs}")
    _state_pass_kernel[(programs,)](
        k, w, u, g_cum, chunk_indices, chunk_offsets, initial_state, h, v_new, final_state,
        T, N,
        k.stride(0), k.stride(1),
        w.stride(0), w.stride(1),
        u.stride(0), u.stride(1),
        g_cum.stride(0), g_cum.stride(1),
        v_new.stride(0), v_new.stride(1),
        HV=HV, GROUP=HV // H, K=K, V=V, BT=CHUNK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=final_state is not None,
        USE_QK_L2NORM=use_qk_l2norm,
        DOT_PRECISION=dot_precision(w.dtype),
        EMULATE_BF16=emulate_bf16(w.dtype),
        PIPELINED=not interpreting(), NUM_STAGES_LOOP=LOOP_STAGES,
        num_warps=num_warps,
        num_stages=NUM_STAGES,
    )
    return h, v_new, final_state


def _aot_specs() -> list[AotSpec]:
    """The model's specialisations: K = V = 128, H = 16, HV = 48, bf16, BT = 64; packed q/k/v row.

    k is a head view of the packed row ``[T, (2H + HV) * 128]``: token stride 10240, head
    stride 128; w, u, v_new ``[T, 48, 128]`` dense; g_cum ``[T, 48]`` dense (head stride 1).
    With and without the in-kernel L2 norm, with and without initial/final state, in both launch
    settings (Hopper's, and Blackwell's ``_2w``).
    """
    specs = []
    K = V = 128
    H, HV = 16, 48
    for (block_v, num_warps), tag in ((CONFIG_HOPPER, ""), (CONFIG_BLACKWELL, "_2w")):
        for l2 in (True, False):
            for states in (False, True):
                signature = {
                    "k_ptr": "*bf16", "w_ptr": "*bf16", "u_ptr": "*bf16", "g_ptr": "*fp32",
                    "ci_ptr": "*i32", "co_ptr": "*i32", "h0_ptr": "*fp32", "h_ptr": "*bf16",
                    "vn_ptr": "*bf16", "ht_ptr": "*fp32",
                    "T": "i32", "N": "i32",
                    "s_kt": "i32", "s_kh": "i32", "s_wt": "i32", "s_wh": "i32", "s_ut": "i32", "s_uh": "i32",
                    "s_gt": "i32", "s_vt": "i32", "s_vh": "i32",
                }
                constexprs = {
                    "s_gh": 1, "HV": HV, "GROUP": HV // H, "K": K, "V": V, "BT": CHUNK, "BV": min(block_v, V),
                    "USE_INITIAL_STATE": states, "STORE_FINAL_STATE": states, "USE_QK_L2NORM": l2,
                    "DOT_PRECISION": dot_precision(torch.bfloat16), "EMULATE_BF16": False,
                    "PIPELINED": True, "NUM_STAGES_LOOP": LOOP_STAGES,
                }
                if not states:
                    del signature["h0_ptr"], signature["ht_ptr"]
                    constexprs.update(h0_ptr=None, ht_ptr=None)
                specs.append(
                    AotSpec(
                        name=f"gdn_state_pass{'_l2' if l2 else ''}{'_states' if states else ''}_bf16{tag}",
                        kernel=_state_pass_kernel,
                        signature=signature,
                        constexprs=constexprs,
                        options={"num_warps": num_warps, "num_stages": NUM_STAGES},
                        divisible_by_16=tuple(n for n in signature if n.endswith("_ptr") or n.startswith("s_")),
                    )
                )
    return specs


AOT_SPECS = _aot_specs()
