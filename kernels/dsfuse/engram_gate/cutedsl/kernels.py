"""CuTe DSL kernels of the Engram gate: forward with saved state, backward with packed dKV and dWeight.

Logical layouts, as the Triton backend (``dsfuse.engram_gate.triton``): ``x``/``out``/``dout``/``dx``
``[N, S, D]`` with contiguous ``[S, D]`` rows (row stride free, stream stride ``D``, channel
stride 1); ``kv``/``dkv`` ``[N, (S + 1) * D]`` (the S keys, then the value); ``weight`` fp32
``[S, D]`` contiguous; ``token_mask`` bool ``[N]`` (passed as its uint8 view); ``saved`` fp32
``[N, S, 4]`` = (gate, dot, rx, rk), contiguous. This backend moves every row in 128-bit vectors,
so it asks more than Triton (``layout_reasons``): ``D`` a multiple of ``VEC = 16 / itemsize``
channels, row strides multiples of ``VEC`` elements and 16-byte aligned data pointers.

Thread mapping (both directions): a CTA of ``T`` threads covers one token's rows; thread ``t`` owns
the vectors ``v = t + i * T`` (``i < ITERS``) of every stream, i.e. channels
``[v * VEC, (v + 1) * VEC)`` of x, out, dout, dx, the S keys and the value, and of weight and
dweight. ``ITERS = ceil(D / VEC / 512)``, ``T = 32 * ceil(D / VEC / (32 * ITERS))`` (``D = 5120``
bf16: 640 vectors per row, 320 threads, 2 vectors per thread and stream; a thread's last vector is
predicated off where ``T * ITERS`` exceeds the row).

Forward (``_Forward``): one CTA per token. Every thread loads its vectors of x, the S keys, the value
and weight (128-bit loads, all issued before any reduction), keeps x and the value in registers,
and sums ``h * h``, ``k * k`` and ``h * w * k`` per stream; the 3S sums are reduced over the CTA
(butterfly shuffles in each warp, then every thread adds the warps' partials from shared memory in
warp order), each thread evaluates (gate, dot, rx, rk) for the S streams, thread ``s`` writes
stream ``s``'s saved state (one 128-bit store), and every thread writes its vectors of
``out = h + gate * value``. The value row is read once per token (Triton reads it once per stream).

Backward, two kernels:

1. ``_Backward``: ``G = min(N, GROUPS)`` CTAs; CTA ``g`` takes tokens ``g, g + G, ...`` in order
   and keeps its token group's dWeight partial (``S * ITERS * VEC`` fp32 per thread) in registers.
   A token's ``dout`` rows and value row are staged in shared memory with ``cp.async`` (16 bytes per
   copy) one token ahead (two stages), and its x and key rows one phase ahead (one stage), so the
   next token's bytes are in flight while the current one computes. Per token: (A) from the staged
   dout and value, the value gradient ``sum_s gate_s * dout_s`` (stored) and ``G_s = sum_d dout *
   value``, reduced over the CTA like the forward's sums; the per-stream coefficients (a, bx, bk)
   from ``G`` and the saved state; (B) from the staged dout, x and keys, dx and the key gradients
   (stored) and the dWeight term ``a * h * k``. Every operand is read from HBM once (weight stays
   in registers, or comes from L2 where registers are short). A thread reads only the shared
   memory its own copies wrote, so ``cp.async.wait_group`` orders the staging for it; a barrier at
   the end of each token separates its last reads of a buffer from the copies that refill it.
   Where the staged rows do not fit the shared memory (``SMEM_BUDGET``), x and the keys are read
   from global memory in phase B, then a single dout stage is used (``_stages``).
2. ``_DweightSum``: ``dweight[c] = sum_g partial[g, c]`` for ``g = 0, 1, ..., G - 1`` in that
   order, one thread per four columns.

Reduction orders (why bitwise reproducible): within a thread, sums run over its vectors in a fixed
order; within a warp, a fixed butterfly; across warps, warp order; dWeight over the tokens of a
group in token order, then over the groups in group order. ``G`` depends on ``N`` only (never on
the GPU), so the result depends only on the inputs and the compile-time geometry. No atomics.
All math in fp32. Floating-point contraction is left to NVVM (multiply-adds of the sums and of
``h + gate * value`` may be fused, ``fma.rn``): the contract is a tolerance (the op's page). The
forward's sums, and so the saved state, differ from Triton's in the last bits (another summation
order); the saved state means the same and is interchangeable between the backends.

Compile-cache key: (kernel, dtype, S, D, staging, target arch); ``N`` (and the row strides) are
symbolic, so a new token count never compiles. Kernels are called through TVM-FFI (torch tensors
passed directly) on the current torch stream (``make_fake_stream(use_tvm_ffi_env_stream=True)``).

Registers (``ptxas -v`` of the sm_90a PTX, bf16, D = 5120): the forward is compiled for
``FWD_CTAS_PER_SM = 2`` resident CTAs (96 registers, 96 bytes spilled; with 1, 138 registers and
no spill); the backward uses 168 registers (64 bytes spilled) at one CTA per SM (184320 bytes of
staged rows).

On the H200 every GPU test passes (``experiments/engram_gate/raw/gpu-tests/``): float64 checks at
the model's width and odd widths, masks, eps and clamp cases, three runs bitwise equal, the saved
state interchangeable with Triton's both ways, the plan (no allocation, compile or sync; CUDA Graph
replay), autograd, ``torch.compile``, a side stream. Measured against Triton in one run (the Engram
gate page: the forward is slower, the backward faster, with Nsight Compute counters of each kernel).
Not tuned: ``GROUPS`` (one CTA per SM: 128 leaves 4 of an H200's 132 SMs and 20 of a B200's 148
idle), ``FWD_CTAS_PER_SM``, the thread count, whether the two dout stages and the x / key stage beat
fewer, and the dWeight sum's few CTAs.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Uint8, const_expr
from cutlass.cute.nvgpu import cpasync

MAX_DIM = 16384  # the forward keeps a token's x row in registers: S * D / T elements per thread
GROUPS = 128  # backward: token groups (dWeight partials) at most; one CTA each, at most one per SM
MAX_THREADS_PER_VECTOR_ROW = 512  # a row of D / VEC vectors takes ceil(. / 512) vectors per thread
SMEM_BUDGET = 220 * 1024  # bytes of staged rows per CTA (227 KB is the sm_90 / sm_100 limit)
ACC_REGS = 64  # backward: dWeight partial registers per thread at most
REG_FILE = 65536  # 32-bit registers per multiprocessor (sm_90, sm_100)
REG_RESERVE = 72  # registers per thread the backward needs besides weight and the dWeight partial
SUM_THREADS = 256  # dWeight sum: threads per CTA, four columns each
FWD_CTAS_PER_SM = 2  # forward: resident CTAs per SM the register allocation must allow (hides a token's reductions)

_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}


# -- geometry (pure Python: used by the launchers, the API's checks and the tests) --------------


def vector_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in one 128-bit access."""
    return 16 // dtype.itemsize if dtype in _DTYPES else 0


def geometry(dtype: torch.dtype, dim: int) -> tuple[int, int, int]:
    """``(VEC, ITERS, T)``: elements per vector, vectors per thread and stream, threads per CTA."""
    vec = vector_elements(dtype)
    vectors = dim // vec
    iters = max(1, math.ceil(vectors / MAX_THREADS_PER_VECTOR_ROW))
    threads = 32 * max(1, math.ceil(vectors / (32 * iters)))
    return vec, iters, threads


def _stages(dtype: torch.dtype, streams: int, dim: int) -> tuple[int, bool] | None:
    """Backward staging ``(dout stages, x and keys staged)`` that fits ``SMEM_BUDGET``, richest first."""
    size = dtype.itemsize
    dout_value = (streams + 1) * dim * size
    x_keys = 2 * streams * dim * size
    for stages, stage_xk in ((2, True), (2, False), (1, False)):
        if stages * dout_value + stage_xk * x_keys <= SMEM_BUDGET:
            return stages, stage_xk
    return None


def _weight_in_registers(dtype: torch.dtype, streams: int, dim: int) -> bool:
    vec, iters, threads = geometry(dtype, dim)
    return 2 * streams * iters * vec + REG_RESERVE <= REG_FILE // threads


def shape_reasons(dtype: torch.dtype, streams: int, dim: int, *, backward: bool) -> list[str]:
    """Why this backend cannot compute a gate of this geometry (empty when it can)."""
    if dtype not in _DTYPES:
        return [f"dtype {dtype} is not one of bf16, fp16, fp32"]
    vec, iters, _ = geometry(dtype, dim)
    reasons = []
    if dim % vec:
        reasons.append(f"D = {dim} is not a multiple of {vec} channels (the CuTe DSL kernels move 128-bit vectors)")
    if dim > MAX_DIM:
        reasons.append(f"D = {dim} is above the CuTe DSL kernels' limit of {MAX_DIM} channels per row")
    if backward and not reasons:
        if streams * iters * vec > ACC_REGS:
            reasons.append(f"S * D = {streams * dim} is too wide for the CuTe DSL backward, which keeps a token "
                           f"group's dWeight partial in registers ({streams * iters * vec} > {ACC_REGS} per thread)")
        if _stages(dtype, streams, dim) is None:
            reasons.append(f"a token's dout and value rows ({(streams + 1) * dim} elements) do not fit the CuTe "
                           f"DSL backward's {SMEM_BUDGET} bytes of shared memory")
    return reasons


def layout_reasons(**tensors: torch.Tensor) -> list[str]:
    """The 128-bit access requirements on the call's tensors: 16-byte aligned data pointers and, for
    ``[N, ...]`` row tensors, row strides that keep every row 16-byte aligned."""
    reasons = []
    for name, t in tensors.items():
        if t is None:
            continue
        if t.data_ptr() % 16:
            reasons.append(f"{name}: data pointer {t.data_ptr():#x} is not 16-byte aligned")
        if t.ndim >= 2 and (t.stride(0) * t.element_size()) % 16:
            reasons.append(f"{name}: row stride {t.stride(0)} elements is not a multiple of 16 bytes")
    return reasons


def token_groups(n_tokens: int) -> int:
    """dWeight partials of the backward for ``n_tokens`` (a function of N only: reproducible anywhere)."""
    return max(1, min(n_tokens, GROUPS))


def workspace_elements(n_tokens: int, streams: int, dim: int) -> int:
    """fp32 elements of the backward workspace: the ``[G, S, D]`` dWeight partials of the token groups."""
    return token_groups(n_tokens) * streams * dim


# -- device helpers --------------------------------------------------------------------------


@cute.jit
def _vector(row: cute.Tensor, index, vec: cutlass.Constexpr[int]) -> cute.Tensor:
    """Vector ``index`` (``vec`` contiguous elements) of a 1-D row, as a ``(vec,):(1,)`` tensor."""
    return cute.make_tensor(cute.zipped_divide(row, (vec,))[None, index].iterator, cute.make_layout((vec,)))


@cute.jit
def _load(src: cute.Tensor, dst: cute.Tensor, always: cutlass.Constexpr[bool], valid):
    """Copy the vector ``src`` into the zero-filled register fragment ``dst`` where ``valid`` (a
    thread's last vector may lie past the row); ``always``: valid for every thread (no predicate)."""
    dst.fill(0)
    if const_expr(always):
        cute.autovec_copy(src, dst)
    else:
        if valid:
            cute.autovec_copy(src, dst)


@cute.jit
def _fetch(src: cute.Tensor, dtype: cutlass.Constexpr, always: cutlass.Constexpr[bool], valid) -> cute.Tensor:
    """A new register fragment of ``dtype`` holding the vector ``src`` (`_load`)."""
    dst = cute.make_rmem_tensor((cute.size(src),), dtype)
    _load(src, dst, always, valid)
    return dst


def _slot(tidx, i: int, threads: int, vectors: int) -> tuple:
    """Vector ``i`` of thread ``tidx`` in a row of ``vectors`` vectors (see the module docstring):
    ``(v, always, valid)``, its index ``tidx + i * threads``, whether vector ``i`` of every thread
    lies in the row (known at compile time: no predicate) and whether this thread's does."""
    v = tidx + i * threads
    return v, (i + 1) * threads <= vectors, v < vectors


@cute.jit
def _block_sum(values: list, sRed: cute.Tensor, warps: cutlass.Constexpr[int]) -> list:
    """CTA-wide sums of ``len(values)`` per-thread fp32 values, the same in every thread.

    Fixed order: a butterfly in each warp, then the warps' partials (``sRed`` ``[warps, len]`` in
    shared memory) added in warp order. One barrier; the caller separates reuses of ``sRed``.
    """
    count = len(values)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    reduced = [cute.arch.warp_reduction(values[j], lambda a, b: a + b) for j in range(count)]
    if lane == 0:
        for j in cutlass.range_constexpr(count):
            sRed[warp, j] = reduced[j]
    cute.arch.barrier()
    totals = [Float32(0.0)] * count
    for w in cutlass.range_constexpr(warps):
        for j in cutlass.range_constexpr(count):
            totals[j] = totals[j] + sRed[w, j]
    return totals


@cute.jit
def _recip_sqrt(value: Float32) -> Float32:
    """``1 / sqrt(value)``, both correctly rounded (as the Triton kernels' div_rn / sqrt_rn)."""
    return cute.math.div(Float32(1.0), cute.math.sqrt(value))


# -- forward ---------------------------------------------------------------------------------


class _Forward:
    """One CTA per token (see the module docstring); compile-time dtype, S and D."""

    def __init__(self, dtype: torch.dtype, streams: int, dim: int):
        self.dtype, self.streams, self.dim = _DTYPES[dtype], streams, dim
        self.vec, self.iters, self.threads = geometry(dtype, dim)
        self.vectors = dim // self.vec

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [N, S, D]
        mKV: cute.Tensor,  # [N, (S + 1) * D]
        mW: cute.Tensor,  # [S, D] fp32
        mMask: cute.Tensor,  # [N] uint8
        mO: cute.Tensor,  # [N, S, D]
        mSaved: cute.Tensor,  # [N, S, 4] fp32
        eps: Float32,
        clamp: Float32,
        stream,
    ):
        self.kernel(mX, mKV, mW, mMask, mO, mSaved, eps, clamp).launch(
            grid=[mX.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=FWD_CTAS_PER_SM,
            preferred_smem_carveout=-1)  # -1: the driver's default carveout (also spares a device query)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mKV: cute.Tensor, mW: cute.Tensor, mMask: cute.Tensor, mO: cute.Tensor,
               mSaved: cute.Tensor, eps: Float32, clamp: Float32):
        S, D, VEC, ITERS, T, VD = self.streams, self.dim, self.vec, self.iters, self.threads, self.vectors
        dtype = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        n, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout((T // 32, 3 * S), stride=(3 * S, 1)), byte_alignment=16)
        rKV = mKV[n, None]  # [(S + 1) * D]
        # registers: x [S][ITERS] and the value [ITERS] vectors; sums (h.h, k.k, h.w.k) per stream
        rH = [None] * (S * ITERS)
        rV = [None] * ITERS
        sums = [Float32(0.0)] * (3 * S)
        for i in cutlass.range_constexpr(ITERS):
            v, always, valid = _slot(tidx, i, T, VD)
            rV[i] = _fetch(_vector(rKV, S * VD + v, VEC), dtype, always, valid)  # [VEC] of the value
            for s in cutlass.range_constexpr(S):
                fH = _fetch(_vector(mX[n, s, None], v, VEC), dtype, always, valid)  # [VEC] of x[n, s]
                fK = _fetch(_vector(rKV, s * VD + v, VEC), dtype, always, valid)  # [VEC] of key s
                fW = _fetch(_vector(mW[s, None], v, VEC), Float32, always, valid)  # [VEC] of weight[s]
                rH[s * ITERS + i] = fH
                h, k, w = fH.load().to(Float32), fK.load().to(Float32), fW.load()
                sums[3 * s] = sums[3 * s] + (h * h).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                sums[3 * s + 1] = sums[3 * s + 1] + (k * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                sums[3 * s + 2] = sums[3 * s + 2] + (h * w * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        totals = _block_sum(sums, sRed, T // 32)
        keep = mMask[n] != Uint8(0)
        inv_sqrt_dim = _recip_sqrt(Float32(D))
        for s in cutlass.range_constexpr(S):
            rx = _recip_sqrt(totals[3 * s] / Float32(D) + eps)
            rk = _recip_sqrt(totals[3 * s + 1] / Float32(D) + eps)
            dot = totals[3 * s + 2] * rx * rk * inv_sqrt_dim
            root = cute.math.copysign(cute.math.sqrt(cute.math.max(cute.math.absf(dot), clamp)), dot)
            gate = cute.math.div(Float32(1.0), Float32(1.0) + cute.math.exp(-root))
            gate = gate if keep else Float32(0.0)
            if tidx == s:
                fSaved = cute.make_rmem_tensor((4,), Float32)
                fSaved[0] = gate
                fSaved[1] = dot
                fSaved[2] = rx
                fSaved[3] = rk
                cute.autovec_copy(fSaved, mSaved[n, s, None])  # one 128-bit store
            for i in cutlass.range_constexpr(ITERS):
                v = tidx + i * T
                if v < VD:
                    fO = cute.make_rmem_tensor((VEC,), dtype)
                    fO.store((rH[s * ITERS + i].load().to(Float32) + gate * rV[i].load().to(Float32)).to(dtype))
                    cute.autovec_copy(fO, _vector(mO[n, s, None], v, VEC))


# -- backward --------------------------------------------------------------------------------


class _Backward:
    """Token groups with staged rows (see the module docstring); compile-time dtype, S, D, staging."""

    def __init__(self, dtype: torch.dtype, streams: int, dim: int, stages: int, stage_xk: bool,
                 weight_in_registers: bool):
        self.dtype, self.streams, self.dim = _DTYPES[dtype], streams, dim
        self.vec, self.iters, self.threads = geometry(dtype, dim)
        self.vectors = dim // self.vec
        self.stages, self.stage_xk, self.weight_in_registers = stages, stage_xk, weight_in_registers

    @cute.jit
    def __call__(
        self,
        mDout: cute.Tensor,  # [N, S, D]
        mX: cute.Tensor,  # [N, S, D]
        mKV: cute.Tensor,  # [N, (S + 1) * D]
        mW: cute.Tensor,  # [S, D] fp32
        mSaved: cute.Tensor,  # [N, S, 4] fp32: (gate, dot, rx, rk)
        mDx: cute.Tensor,  # [N, S, D]
        mDkv: cute.Tensor,  # [N, (S + 1) * D]
        mPart: cute.Tensor,  # [G, S, D] fp32: the token groups' dWeight partials
        clamp: Float32,
        stream,
    ):
        self.kernel(mDout, mX, mKV, mW, mSaved, mDx, mDkv, mPart, clamp).launch(
            grid=[mPart.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def _copy_rows(self, atom, mRow: cute.Tensor, first: int, count: int, sRow: cute.Tensor, tidx):
        """cp.async this thread's vectors of rows ``first .. first + count - 1`` (each ``D`` wide) of
        the 1-D ``mRow`` into the same vectors of the 1-D ``sRow`` (rows ``0 .. count - 1``)."""
        T, VD, VEC = self.threads, self.vectors, self.vec
        for i in cutlass.range_constexpr(self.iters):
            v = tidx + i * T
            if v < VD:
                for r in cutlass.range_constexpr(count):
                    cute.copy(atom, _vector(mRow, (first + r) * VD + v, VEC), _vector(sRow, r * VD + v, VEC))

    @cute.kernel
    def kernel(self, mDout: cute.Tensor, mX: cute.Tensor, mKV: cute.Tensor, mW: cute.Tensor, mSaved: cute.Tensor,
               mDx: cute.Tensor, mDkv: cute.Tensor, mPart: cute.Tensor, clamp: Float32):
        S, D, VEC, ITERS, T, VD = self.streams, self.dim, self.vec, self.iters, self.threads, self.vectors
        dtype, STAGES, STAGE_XK = self.dtype, self.stages, self.stage_xk
        tidx, _, _ = cute.arch.thread_idx()
        g, _, _ = cute.arch.block_idx()
        n_groups = mPart.shape[0]
        n_tokens = mX.shape[0]
        count = (n_tokens - g + n_groups - 1) // n_groups  # tokens g, g + G, ... (>= 1: G <= N)

        smem = cutlass.memory.SmemAllocator()
        # staged rows: per stage, a token's S dout rows then its value row; then its x and S key rows
        sDV = smem.allocate_tensor(dtype, cute.make_layout((STAGES, (S + 1) * D), stride=((S + 1) * D, 1)),
                                   byte_alignment=16)
        sXK = None
        if const_expr(STAGE_XK):
            sXK = smem.allocate_tensor(dtype, cute.make_layout((2 * S * D,)), byte_alignment=16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((T // 32, S), stride=(S, 1)), byte_alignment=16)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                                   num_bits_per_copy=128)

        # weight (when it fits the registers) and the dWeight partial, [S][ITERS][VEC] fp32
        rW = cute.make_rmem_tensor((S * ITERS * VEC,), Float32)
        rDW = cute.make_rmem_tensor((S * ITERS * VEC,), Float32)
        rDW.fill(0.0)
        rW.fill(0.0)
        if const_expr(self.weight_in_registers):
            for s in cutlass.range_constexpr(S):
                for i in cutlass.range_constexpr(ITERS):
                    if tidx + i * T < VD:
                        cute.autovec_copy(_vector(mW[s, None], tidx + i * T, VEC), _vector(rW, s * ITERS + i, VEC))

        # prologue: DV(0), [XK(0)], [DV(1)]
        self._copy_rows(atom, _flat_row(mDout, g), 0, S, sDV[0, None], tidx)
        self._copy_rows(atom, mKV[g, None], S, 1, _shift(sDV[0, None], S * D), tidx)
        cute.arch.cp_async_commit_group()
        if const_expr(STAGE_XK):
            self._copy_rows(atom, _flat_row(mX, g), 0, S, sXK, tidx)
            self._copy_rows(atom, mKV[g, None], 0, S, _shift(sXK, S * D), tidx)
            cute.arch.cp_async_commit_group()
        if const_expr(STAGES == 2):
            if count > 1:
                self._copy_rows(atom, _flat_row(mDout, g + n_groups), 0, S, sDV[1, None], tidx)
                self._copy_rows(atom, mKV[g + n_groups, None], S, 1, _shift(sDV[1, None], S * D), tidx)
            cute.arch.cp_async_commit_group()

        inv_sqrt_dim = _recip_sqrt(Float32(D))
        for it in cutlass.range(count):
            n = g + it * n_groups
            stage = it % STAGES
            # the saved state of the S streams (each thread, 128-bit loads; L1 broadcast)
            fSaved = cute.make_rmem_tensor((S * 4,), Float32)
            for s in cutlass.range_constexpr(S):
                cute.autovec_copy(mSaved[n, s, None], _vector(fSaved, s, 4))
            # this token's dout and value rows have landed (this thread's copies)
            if const_expr(STAGE_XK):
                cute.arch.cp_async_wait_group(2)
            elif const_expr(STAGES == 2):
                cute.arch.cp_async_wait_group(1)
            else:
                cute.arch.cp_async_wait_group(0)
            sDVn = sDV[stage, None]
            # phase A: the value gradient and this thread's part of G = sum_d dout * value per stream
            partial_g = [Float32(0.0)] * S
            for i in cutlass.range_constexpr(ITERS):
                v, always, valid = _slot(tidx, i, T, VD)
                value = _fetch(_vector(sDVn, S * VD + v, VEC), dtype, always, valid).load().to(Float32)  # the value
                fDo = cute.make_rmem_tensor((VEC,), dtype)
                dvalue = cute.make_rmem_tensor((VEC,), Float32)
                dvalue.fill(0.0)
                for s in cutlass.range_constexpr(S):
                    _load(_vector(sDVn, s * VD + v, VEC), fDo, always, valid)  # [VEC] of dout[n, s]
                    do = fDo.load().to(Float32)
                    partial_g[s] = partial_g[s] + (do * value).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    dvalue.store(dvalue.load() + fSaved[4 * s] * do)
                fDv = cute.make_rmem_tensor((VEC,), dtype)
                fDv.store(dvalue.load().to(dtype))
                if valid:
                    cute.autovec_copy(fDv, _vector(mDkv[n, None], S * VD + v, VEC))
            big_g = _block_sum(partial_g, sRed, T // 32)
            # per-stream coefficients (the Triton backend's _grad_coefficients, same operation order)
            coef_a, coef_bx, coef_bk = [None] * S, [None] * S, [None] * S
            for s in cutlass.range_constexpr(S):
                gate, dot, rx, rk = fSaved[4 * s], fSaved[4 * s + 1], fSaved[4 * s + 2], fSaved[4 * s + 3]
                droot = big_g[s] * gate * (Float32(1.0) - gate)
                mag = cute.math.absf(dot)
                ddot = cute.math.div(droot, Float32(2.0) * cute.math.sqrt(cute.math.max(mag, clamp)))
                ddot = ddot if mag >= clamp else Float32(0.0)
                coef_a[s] = ddot * rx * rk * inv_sqrt_dim
                coef_bx[s] = ddot * dot * rx * rx / Float32(D)
                coef_bk[s] = ddot * dot * rk * rk / Float32(D)
            # phase B: dx and the key gradients; the dWeight term a * h * k
            if const_expr(STAGE_XK):
                cute.arch.cp_async_wait_group(1)
            for s in cutlass.range_constexpr(S):
                for i in cutlass.range_constexpr(ITERS):
                    v = tidx + i * T
                    if v < VD:
                        do = _vector(sDVn, s * VD + v, VEC).load().to(Float32)
                        if const_expr(STAGE_XK):
                            h = _vector(sXK, s * VD + v, VEC).load().to(Float32)
                            k = _vector(sXK, (S + s) * VD + v, VEC).load().to(Float32)
                        else:
                            fH = _fetch(_vector(mX[n, s, None], v, VEC), dtype, True, True)
                            fK = _fetch(_vector(mKV[n, None], s * VD + v, VEC), dtype, True, True)
                            h, k = fH.load().to(Float32), fK.load().to(Float32)
                        rWv = _vector(rW, s * ITERS + i, VEC)
                        if const_expr(not self.weight_in_registers):
                            cute.autovec_copy(_vector(mW[s, None], v, VEC), rWv)
                        w = rWv.load()
                        dh = do + coef_a[s] * w * k - coef_bx[s] * h
                        dk = coef_a[s] * w * h - coef_bk[s] * k
                        rDWv = _vector(rDW, s * ITERS + i, VEC)
                        rDWv.store(rDWv.load() + coef_a[s] * h * k)
                        fDh = cute.make_rmem_tensor((VEC,), dtype)
                        fDk = cute.make_rmem_tensor((VEC,), dtype)
                        fDh.store(dh.to(dtype))
                        fDk.store(dk.to(dtype))
                        cute.autovec_copy(fDh, _vector(mDx[n, s, None], v, VEC))
                        cute.autovec_copy(fDk, _vector(mDkv[n, None], s * VD + v, VEC))
            # every thread is done with this token's buffers (and sRed): refill them
            cute.arch.barrier()
            if const_expr(STAGE_XK):
                if it + 1 < count:
                    self._copy_rows(atom, _flat_row(mX, n + n_groups), 0, S, sXK, tidx)
                    self._copy_rows(atom, mKV[n + n_groups, None], 0, S, _shift(sXK, S * D), tidx)
                cute.arch.cp_async_commit_group()
            ahead = STAGES  # the token whose rows refill the stage just used
            if it + ahead < count:
                nxt = n + ahead * n_groups
                self._copy_rows(atom, _flat_row(mDout, nxt), 0, S, sDV[stage, None], tidx)
                self._copy_rows(atom, mKV[nxt, None], S, 1, _shift(sDV[stage, None], S * D), tidx)
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

        # the group's dWeight partial
        for s in cutlass.range_constexpr(S):
            for i in cutlass.range_constexpr(ITERS):
                v = tidx + i * T
                if v < VD:
                    cute.autovec_copy(_vector(rDW, s * ITERS + i, VEC), _vector(mPart[g, s, None], v, VEC))


@cute.jit
def _flat_row(mRows: cute.Tensor, token) -> cute.Tensor:
    """Token ``token``'s ``[S, D]`` rows of a ``[N, S, D]`` tensor as one 1-D row of ``S * D``."""
    row = mRows[token, None, None]
    return cute.make_tensor(row.iterator, cute.make_layout((cute.size(row),)))


@cute.jit
def _shift(row: cute.Tensor, offset: cutlass.Constexpr[int]) -> cute.Tensor:
    """The 1-D ``row`` from element ``offset`` on."""
    return cute.make_tensor(row.iterator + offset, cute.make_layout((cute.size(row) - offset,)))


class _DweightSum:
    """``dweight[c] = sum_g partial[g, c]`` in group order; one thread per four fp32 columns."""

    def __init__(self, columns: int):
        self.columns = columns

    @cute.jit
    def __call__(self, mPart: cute.Tensor, mDw: cute.Tensor, stream):  # [G, S * D], [S * D]
        self.kernel(mPart, mDw).launch(grid=[cute.ceil_div(self.columns // 4, SUM_THREADS), 1, 1],
                                       block=[SUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPart: cute.Tensor, mDw: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        q = bidx * SUM_THREADS + tidx
        if q < self.columns // 4:
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((4,), Float32)
            for p in cutlass.range(mPart.shape[0]):
                cute.autovec_copy(_vector(mPart[p, None], q, 4), part)
                acc.store(acc.load() + part.load())
            cute.autovec_copy(acc, _vector(mDw, q, 4))


# -- compile and launch ----------------------------------------------------------------------

CACHE = _cd.KernelCache()  # (kernel, dtype, S, D, staging or CTAs per SM, arch) -> compiled function


def _rows(dtype, shape_tail: tuple[int, ...], vec: int):
    """A fake ``[N, *shape_tail]`` tensor: symbolic N and row stride (a multiple of ``vec``), the rest
    contiguous, 16-byte aligned."""
    tail_strides = tuple(math.prod(shape_tail[i + 1:]) for i in range(len(shape_tail)))
    return cute.runtime.make_fake_tensor(dtype, (cute.sym_int(), *shape_tail),
                                         (cute.sym_int(64, divisibility=vec), *tail_strides), assumed_align=16)


def _compact(dtype, shape: tuple):
    """A fake contiguous tensor, 16-byte aligned; ``None`` sizes are symbolic."""
    shape = tuple(cute.sym_int() if size is None else size for size in shape)
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                                 assumed_align=16)


def _stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def _compile(kernel, *args, arch: str, keep_ptx: bool):
    """``_cd.compile``; kept PTX goes to a scratch directory (``compiled.__ptx__`` holds it)."""
    dump_dir = None
    if keep_ptx:
        dump_dir = os.path.join(tempfile.gettempdir(), "dsfuse-cutedsl-ptx")
        os.makedirs(dump_dir, exist_ok=True)
    return _cd.compile(kernel, *args, arch=arch, keep_ptx=keep_ptx, dump_dir=dump_dir)


def compile_forward(dtype: torch.dtype, streams: int, dim: int, arch: str, keep_ptx: bool = False):
    """The forward for one (dtype, S, D, arch), compiled (no GPU needed)."""
    cdt = _DTYPES[dtype]
    vec = vector_elements(dtype)
    args = (_rows(cdt, (streams, dim), vec), _rows(cdt, ((streams + 1) * dim,), vec),
            _compact(Float32, (streams, dim)), _compact(Uint8, (None,)), _rows(cdt, (streams, dim), vec),
            _compact(Float32, (None, streams, 4)), Float32(0.0), Float32(0.0), _stream())
    return _compile(_Forward(dtype, streams, dim), *args, arch=arch, keep_ptx=keep_ptx)


def compile_backward(dtype: torch.dtype, streams: int, dim: int, arch: str, keep_ptx: bool = False,
                     staging: tuple[int, bool] | None = None):
    """The backward's main kernel for one (dtype, S, D, staging, arch), compiled (no GPU needed)."""
    cdt = _DTYPES[dtype]
    vec = vector_elements(dtype)
    stages, stage_xk = staging or _stages(dtype, streams, dim)
    kernel = _Backward(dtype, streams, dim, stages, stage_xk, _weight_in_registers(dtype, streams, dim))
    rows = _rows(cdt, (streams, dim), vec)
    kv = _rows(cdt, ((streams + 1) * dim,), vec)
    args = (rows, rows, kv, _compact(Float32, (streams, dim)), _compact(Float32, (None, streams, 4)),
            rows, kv, _compact(Float32, (None, streams, dim)), Float32(0.0), _stream())
    return _compile(kernel, *args, arch=arch, keep_ptx=keep_ptx)


def compile_dweight_sum(columns: int, arch: str, keep_ptx: bool = False):
    """The dWeight sum over the token groups' partials for ``columns = S * D``, compiled."""
    args = (_compact(Float32, (None, columns)), _compact(Float32, (columns,)), _stream())
    return _compile(_DweightSum(columns), *args, arch=arch, keep_ptx=keep_ptx)


_arch = _cd.arch_of  # a device's compile target (the CPU tests replace it to launch without a GPU)


def _forward_fn(dtype, streams, dim, arch):
    return CACHE.get(("fwd", dtype, streams, dim, FWD_CTAS_PER_SM, arch),
                     lambda: compile_forward(dtype, streams, dim, arch))


def _backward_fns(dtype, streams, dim, arch):
    staging = _stages(dtype, streams, dim)
    main = CACHE.get(("bwd", dtype, streams, dim, staging, arch),
                     lambda: compile_backward(dtype, streams, dim, arch, staging=staging))
    total = CACHE.get(("dweight", streams * dim, arch), lambda: compile_dweight_sum(streams * dim, arch))
    return main, total


def _check_geometry(dtype, streams, dim, backward):
    if reasons := shape_reasons(dtype, streams, dim, backward=backward):
        raise ValueError("the CuTe DSL backend cannot serve this gate: " + "; ".join(reasons))


def warm_up(dtype: torch.dtype, streams: int, dim: int, device: torch.device) -> None:
    """Compile both directions for ``device`` now (what a plan does at construction)."""
    arch = _arch(device)
    _check_geometry(dtype, streams, dim, backward=True)
    _forward_fn(dtype, streams, dim, arch)
    _backward_fns(dtype, streams, dim, arch)


def launch_forward(x, kv, weight, token_mask, out, saved, *, eps: float, clamp: float) -> None:
    """Arguments validated by the caller (the public API or the plan), aliasing and 128-bit layout
    (``layout_reasons``) included. Runs on the current torch stream."""
    n, streams, dim = x.shape
    _check_geometry(x.dtype, streams, dim, backward=False)
    if n == 0:
        return
    fn = _forward_fn(x.dtype, streams, dim, _arch(x.device))
    fn(x, kv, weight, token_mask.view(torch.uint8), out, saved, eps, clamp)


def launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp: float) -> None:
    """``workspace`` fp32 contiguous with at least ``workspace_elements(N, S, D)`` elements (overwritten).

    Arguments validated by the caller (the public API or the plan), aliasing and 128-bit layout
    included. Runs on the current torch stream.
    """
    n, streams, dim = x.shape
    _check_geometry(x.dtype, streams, dim, backward=True)
    if n == 0:
        dweight.zero_()
        return
    main, total = _backward_fns(x.dtype, streams, dim, _arch(x.device))
    groups = token_groups(n)
    partials = workspace[: groups * streams * dim]
    main(dout, x, kv, weight, saved, dx, dkv, partials.view(groups, streams, dim), clamp)
    total(partials.view(groups, streams * dim), dweight.view(streams * dim))


# -- ahead-of-time specialisations -----------------------------------------------------------


def _aot_specs() -> list[_cd.CuteAotSpec]:
    """The model's specialisations: S = 4 streams of D = 5120, bf16 (the tests add fp16 and fp32)."""
    return [
        _cd.CuteAotSpec("engram_fwd_bf16", lambda arch: compile_forward(torch.bfloat16, 4, 5120, arch, keep_ptx=True)),
        _cd.CuteAotSpec("engram_bwd_bf16", lambda arch: compile_backward(torch.bfloat16, 4, 5120, arch, keep_ptx=True)),
        _cd.CuteAotSpec("engram_dweight_sum", lambda arch: compile_dweight_sum(4 * 5120, arch, keep_ptx=True)),
    ]


AOT_SPECS = _aot_specs()
