"""CuTe DSL kernel of the vision RoPE backward: native gradient layouts -> packed dQKV in one pass.

Layouts (the model's storage; ``layout_reasons`` says what a call breaks):

* ``dq`` and ``dv`` logical ``[H, T, D]``, contiguous ("HTD");
* ``dk`` logical ``[H, T, D]`` with stride 1 along T: the transpose of a contiguous ``[H, D, T]``
  buffer ("HDT", ``dk_hdt``). The kernel takes the buffer itself;
* ``cos``, ``sin`` fp32 ``[T, D/2]``, unit stride along D/2, rows 16-byte aligned;
* ``out`` ``[T, 3 * H * D]`` contiguous, column ``part * H * D + h * D + d`` (part 0 q, 1 k, 2 v).

Tiling: a CTA takes ``TT`` tokens (a tile: 64 bytes of one dK row, so 32 tokens of a 16-bit
dtype, 16 of fp32; widened to one warp's rows of the rotation, ``32 / NC`` tokens, where that is more) of ``G`` heads (``HEADS_PER_CTA``, or the largest divisor of H below it), with
three warps per head, one per part; grid ``(ceil(T / TT), H / G)``. Every access moves one vector
of ``VEC = gcd(D / 2, 16 / itemsize)`` elements (128 bits for the model: 8 bf16 channels).

1. Staging (all threads of the CTA, ``cp.async`` to shared memory, nothing held in registers):
   the tables' ``TT`` rows; per head the dQ tile (``TT`` contiguous rows of D channels, padded by
   one vector per row so the rotation's reads below are spread over all banks), the dV tile, and
   the dK tile. A dK row ``d`` of the tile, tokens ``[t0, t0 + TT)``, starts at flat element
   ``(h * D + d) * T + t0``, which is 16-byte aligned only when T is a multiple of VEC (the model's
   T = 8649 is odd), so the kernel copies the ``TT / VEC + 1`` aligned vectors that cover the row
   and remembers the row's misalignment ``m_d = (h * D + d) * T mod VEC``. Every global read is a
   coalesced VEC-wide copy (16 bytes for the model), dK's included (along T). One
   ``cp.async.wait_group`` and one barrier.
2. Rotation: lane ``l`` of a q or k warp takes channel vector ``c = l mod NC`` of each half
   (``NC = D / 2 / VEC``) for tokens ``tau = l / NC + i * 32 / NC``, so a warp-wide store covers
   ``32 / NC`` whole half head rows of the output (64 bytes each for the model: full 32-byte
   sectors). q reads its two vectors from the staged tile (VEC-wide shared loads), k gathers them
   from the staged dK columns (``sK[d, m_d + tau]``, one shared load per element: this is the
   transpose), both read cos and sin as 16-byte shared loads, rotate in fp32 and store two
   vectors into the packed row. v warps copy their tile into the v columns (zeros without dV).

Rounding (why the result is bitwise eager autograd): eager autograd of ``x1 * cos - x2 * sin``,
``x2 * cos + x1 * sin`` gives ``dx1 = g1 * cos + g2 * sin`` and ``dx2 = g2 * cos + (-g1) * sin``
in fp32, each product and each sum rounded once; ``(-a) * b = -(a * b)`` and ``x + (-y) = x - y``
exactly (signed zeros included), and a sum of two terms does not depend on their order. The
kernel computes ``g1 * c + g2 * s`` and ``g2 * c - g1 * s`` with ``mul.rn.f32``, ``add.rn.f32``
and ``sub.rn.f32`` written as inline PTX: NVVM contracts a plain multiply and add into ``fma``
(it does so by default), and PTX forbids contracting instructions with an explicit rounding
mode, so no step is fused. One round-to-nearest-even to the output dtype (``cvt.rn``).

Compile-cache key: (dtype, H, D, has dV, TT, G, target arch). T is symbolic (``cute.sym_int``,
shared by every tensor, so TVM-FFI checks that the sizes agree), with the row strides of dK and
the tables; a new token count never compiles. The kernel is called through TVM-FFI with the torch
tensors and launches on the current torch stream (``make_fake_stream(use_tvm_ffi_env_stream=True)``):
the public API's ``stream=`` makes its stream current. No allocation, no host synchronisation:
CUDA Graph capture works after a first (compiling) call.

Compiles for sm_90a and sm_100a on the CPU (``ptxas`` 13.0 on the PTX: 40 to 54 registers, no
spills). On the H200 every GPU test passes (``experiments/vision_rope/raw/gpu-tests/``): bitwise
equal to eager autograd at the model's geometries, tails, T = 1, without dV, caller's ``out``, every
tile width and heads-per-CTA setting, a side stream, CUDA Graph replay with a new T,
``torch.compile``. ``TILE_BYTES`` and ``HEADS_PER_CTA`` come from the sweep
``experiments/vision_rope/raw/tuning/cutedsl-tiles.csv`` (``tune_cutedsl.py``: 64-byte tiles of two
heads were the fastest, or within 2% of it, at every T swept; the tables are staged once per CTA,
so fewer heads per CTA read them more often, while bigger CTAs fit fewer per multiprocessor). The
timing against the Triton kernel and the controls is on the vision RoPE page.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from dsfuse._common import cutedsl as _cd
from dsfuse._common.validation import addresses_known

cutlass, cute = _cd.require()
from cutlass import Float32, Int32, Int64, const_expr  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.nvgpu import LoadCacheMode, cpasync  # noqa: E402
from cutlass.cutlass_dsl import T as ir_types  # noqa: E402
from cutlass.cutlass_dsl import dsl_user_op  # noqa: E402

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TILE_BYTES = 64  # tokens per tile: one 64-byte segment of a dK row (32 bf16 / fp16, 16 fp32)
HEADS_PER_CTA = 2  # at most; the largest divisor of H not above it
MAX_CHUNKS = 32  # a warp covers a token's half row: NC = D / 2 / VEC lanes, a power of two <= 32
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a CTA may use on sm_90 and sm_100

_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: Float32}


# -- geometry (pure Python: the launcher, the API's checks and the tests use it) ------------------


@dataclass(frozen=True)
class Geometry:
    """Compile-time sizes of one configuration (see the module docstring)."""

    vec: int  # elements per vector access (VEC)
    chunks: int  # vectors per half head row (NC): lanes per token in the rotation
    tile_t: int  # tokens per tile (TT)
    group: int  # heads per CTA (G)
    dim: int  # head dim (D)

    @property
    def warps(self) -> int:
        return 3 * self.group

    @property
    def table_pitch(self) -> int:  # fp32 per staged table row: D/2 + 4 (16 bytes) staggers the banks
        return self.dim // 2 + 4

    @property
    def q_pitch(self) -> int:  # elements per staged dQ row: D + VEC
        return self.dim + self.vec

    @property
    def k_pitch(self) -> int:  # elements per staged dK row: TT + VEC (the covering vectors)
        return self.tile_t + self.vec

    def smem_bytes(self, itemsize: int, has_v: bool) -> int:
        tables = 2 * self.tile_t * self.table_pitch * 4
        per_head = (self.tile_t * self.q_pitch + self.dim * self.k_pitch + has_v * self.tile_t * self.dim) * itemsize
        return tables + self.group * per_head


def geometry(dtype: torch.dtype, heads: int, dim: int, *, tile_tokens: int | None = None,
             heads_per_cta: int | None = None) -> Geometry:
    """The sizes the kernel compiles with: ``TILE_BYTES`` and ``HEADS_PER_CTA`` unless overridden
    (``tile_tokens``, ``heads_per_cta``: sweeps). The default tile is widened to whole warps of the
    rotation (``32 / NC`` tokens) where ``TILE_BYTES`` holds fewer (fp32 with a small D)."""
    if tile_tokens is None:
        tile_tokens = max(TILE_BYTES // dtype.itemsize, 32 // _vectors(dtype, dim)[1])
    return _geometry(dtype, heads, dim, tile_tokens, heads_per_cta or HEADS_PER_CTA)


def _vectors(dtype: torch.dtype, dim: int) -> tuple[int, int]:
    """``(VEC, NC)``: elements per vector access, vectors per half head row."""
    vec = math.gcd(dim // 2, 16 // dtype.itemsize)
    return vec, dim // 2 // vec


@functools.cache
def _geometry(dtype: torch.dtype, heads: int, dim: int, tile_t: int, max_group: int) -> Geometry:
    vec, chunks = _vectors(dtype, dim)
    if tile_t % vec or tile_t * chunks % 32:
        raise ValueError(f"tile_tokens: expected a multiple of {vec} with tile_tokens * {chunks} a multiple of 32, "
                         f"got {tile_t}")
    group = max(g for g in range(1, max_group + 1) if heads % g == 0)
    return Geometry(vec=vec, chunks=chunks, tile_t=tile_t, group=group, dim=dim)


def shape_reasons(dtype: torch.dtype, heads: int, dim: int) -> list[str]:
    """Why the kernel does not compile for these sizes (empty when it does)."""
    return list(_shape_reasons(dtype, heads, dim))


@functools.cache
def _shape_reasons(dtype: torch.dtype, heads: int, dim: int) -> tuple[str, ...]:
    if dtype not in _DTYPES:
        return (f"dtype {dtype} is not one of bfloat16, float16, float32",)
    if dim % 8:
        return (f"head dim D = {dim} is not a multiple of 8 (the kernel moves the fp32 tables 4 at a time)",)
    vec, chunks = _vectors(dtype, dim)
    if chunks > MAX_CHUNKS or chunks & (chunks - 1):
        return (f"D / 2 / {vec} = {chunks} vectors per half head row is not a power of two <= {MAX_CHUNKS}",)
    return ()


def _ptr_reasons(name: str, t: torch.Tensor) -> list[str]:
    if not addresses_known() or t.data_ptr() % 16 == 0:  # tracing: no addresses (the launch checks)
        return []
    return [f"{name} data pointer {t.data_ptr():#x} is not 16-byte aligned"]


def table_reasons(cos: torch.Tensor, sin: torch.Tensor) -> list[str]:
    """Why the kernel cannot stage the ``[T, D/2]`` tables (16-byte copies of fp32 rows)."""
    if (cos.stride(-1) == 1 and sin.stride(-1) == 1 and not (cos.stride(0) | sin.stride(0)) & 3
            and (not addresses_known() or not (cos.data_ptr() | sin.data_ptr()) & 15)):
        return []
    reasons = []
    for name, t in (("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1 or t.stride(0) % 4:
            reasons.append(f"{name} rows are not 16-byte aligned fp32 rows (strides {tuple(t.stride())})")
        reasons += _ptr_reasons(name, t)
    return reasons


def layout_reasons(dq: torch.Tensor, dk_hdt: torch.Tensor, dv: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, out: torch.Tensor | None) -> list[str]:
    """What the kernel asks of the storage beyond the op's shapes (empty when it is served).

    ``dk_hdt`` is the ``[H, D, T]`` buffer; ``cos``/``sin`` are ``[T, D/2]``.
    """
    if (dq.is_contiguous() and dk_hdt.is_contiguous() and (dv is None or dv.is_contiguous())
            and (out is None or out.is_contiguous()) and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and not (cos.stride(0) | sin.stride(0)) & 3
            and (not addresses_known() or not (dq.data_ptr() | dk_hdt.data_ptr() | cos.data_ptr() | sin.data_ptr()
                                               | (0 if dv is None else dv.data_ptr())
                                               | (0 if out is None else out.data_ptr())) & 15)):
        return []  # the common case, in one pass (the launcher runs this on every call)
    reasons = []
    for name, t in (("dq_htd", dq), ("dk_hdt", dk_hdt), ("dv_htd", dv), ("out", out)):
        if t is None:
            continue
        if not t.is_contiguous():
            reasons.append(f"{name} is not contiguous (strides {tuple(t.stride())})")
        reasons += _ptr_reasons(name, t)
    return reasons + table_reasons(cos, sin)


# -- device helpers -------------------------------------------------------------------------------


def _rn(op: str):
    """``op.rn.f32`` as inline PTX: an explicit rounding mode, so never contracted into an FMA."""

    @dsl_user_op
    def apply(a, b, *, loc=None, ip=None) -> Float32:
        args = [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)]
        return Float32(llvm.inline_asm(ir_types.f32(), args, f"{op}.rn.f32 $0, $1, $2;", "=f,f,f",
                                       has_side_effects=False, is_align_stack=False,
                                       asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    apply.__name__ = f"{op}_rn"
    return apply


mul_rn, add_rn, sub_rn = _rn("mul"), _rn("add"), _rn("sub")


@cute.jit
def _vector(row: cute.Tensor, index, vec: cutlass.Constexpr[int]) -> cute.Tensor:
    """Vector ``index`` (``vec`` contiguous elements) of a 1-D tensor."""
    return cute.zipped_divide(row, (vec,))[None, index]


# -- kernel ---------------------------------------------------------------------------------------


class _Backward:
    """``(dQ [H, T, D], dK_hdt [H, D, T], dV [H, T, D] | None, cos, sin [T, D/2]) -> out [T, 3HD]``."""

    def __init__(self, dtype: torch.dtype, heads: int, dim: int, has_v: bool, geo: Geometry):
        self.dtype, self.heads, self.dim, self.has_v, self.geo = _DTYPES[dtype], heads, dim, has_v, geo
        self.threads = 32 * geo.warps

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (H, T, D)
        mK: cute.Tensor,  # (H, D, T)
        mV: cute.Tensor | None,  # (H, T, D)
        mCos: cute.Tensor,  # (T, D/2) fp32
        mSin: cute.Tensor,  # (T, D/2) fp32
        mO: cute.Tensor,  # (T, 3 * H * D)
        stream,
    ):
        grid = [cute.ceil_div(mQ.shape[1], self.geo.tile_t), self.heads // self.geo.group, 1]
        # nothing uses L1 (cp.async.cg reads bypass it, stores do not allocate in it): all of it as
        # shared memory, for resident CTAs
        self.kernel(mQ, mK, mV, mCos, mSin, mO).launch(grid=grid, block=[self.threads, 1, 1], stream=stream,
                                                        preferred_smem_carveout=100)

    @cute.jit
    def _stage(self, atom, mSrc: cute.Tensor, sDst: cute.Tensor, rows: cutlass.Constexpr[int],
               vectors: cutlass.Constexpr[int], vec: cutlass.Constexpr[int], first_row, tokens, tidx):
        """Copy rows ``first_row + [0, rows)`` (those below ``tokens``), ``vectors`` vectors each, of the
        2-D ``mSrc`` into ``sDst`` (cp.async, every thread of the CTA)."""
        total = rows * vectors
        for i in cutlass.range_constexpr((total + self.threads - 1) // self.threads):
            item = tidx + i * self.threads
            row = item // vectors
            j = item - row * vectors
            if (total % self.threads == 0 or item < total) and first_row + row < tokens:
                cute.copy(atom, _vector(mSrc[first_row + row, None], j, vec), _vector(sDst[row, None], j, vec))

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor | None, mCos: cute.Tensor,
               mSin: cute.Tensor, mO: cute.Tensor):
        geo = self.geo
        TT, VEC, NC, G, D, H = geo.tile_t, geo.vec, geo.chunks, geo.group, self.dim, self.heads
        HALF = D // 2
        KV = TT // VEC + 1  # vectors covering one dK row segment of the tile
        tidx, _, _ = cute.arch.thread_idx()
        i_t, i_g, _ = cute.arch.block_idx()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        tokens = mQ.shape[1]
        t0 = i_t * TT

        smem = cutlass.memory.SmemAllocator()
        table = cute.make_layout((TT, geo.table_pitch), stride=(geo.table_pitch, 1))
        sCos = smem.allocate_tensor(Float32, table, byte_alignment=16)  # (TT, D/2) used
        sSin = smem.allocate_tensor(Float32, table, byte_alignment=16)
        sQ = smem.allocate_tensor(self.dtype, cute.make_layout((G, TT, geo.q_pitch), stride=(
            TT * geo.q_pitch, geo.q_pitch, 1)), byte_alignment=16)  # (G, TT, D) used
        sK = smem.allocate_tensor(self.dtype, cute.make_layout((G, D, geo.k_pitch), stride=(
            D * geo.k_pitch, geo.k_pitch, 1)), byte_alignment=16)  # (G, D, covering vectors)
        sV = None
        if const_expr(self.has_v):
            sV = smem.allocate_tensor(self.dtype, cute.make_layout((G, TT, D), stride=(TT * D, D, 1)),
                                      byte_alignment=16)

        vec_bits = VEC * self.dtype.width
        cache = LoadCacheMode.GLOBAL if const_expr(vec_bits == 128) else LoadCacheMode.ALWAYS
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cache), self.dtype, num_bits_per_copy=vec_bits)
        g2s_table = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=LoadCacheMode.GLOBAL), Float32,
                                        num_bits_per_copy=128)

        # 1. staging: every input of the tile, 16-byte cp.async copies, all threads
        self._stage(g2s_table, mCos, sCos, TT, HALF // 4, 4, t0, tokens, tidx)
        self._stage(g2s_table, mSin, sSin, TT, HALF // 4, 4, t0, tokens, tidx)
        numel = Int64(H * D) * Int64(tokens)
        flat_k = cute.make_tensor(mK.iterator, cute.make_layout(numel))  # the whole [H, D, T] buffer
        for g in cutlass.range_constexpr(G):
            h = i_g * G + g
            self._stage(g2s, mQ[h, None, None], sQ[g, None, None], TT, D // VEC, VEC, t0, tokens, tidx)
            if const_expr(self.has_v):
                self._stage(g2s, mV[h, None, None], sV[g, None, None], TT, D // VEC, VEC, t0, tokens, tidx)
            # dK rows (h, d, t0 + [0, TT)): the aligned vectors covering each row segment
            for i in cutlass.range_constexpr((D * KV + self.threads - 1) // self.threads):
                item = tidx + i * self.threads
                d = item // KV
                v = item - d * KV
                first = (Int64(h * D + d) * Int64(tokens) + Int64(t0)) // VEC + Int64(v)
                if (D * KV % self.threads == 0 or item < D * KV) and first * VEC < numel:
                    cute.copy(g2s, _vector(flat_k, first, VEC), _vector(sK[g, d, None], v, VEC))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        # 2. one warp per (part, head): rotate q or k, copy v
        part = warp % 3
        g = warp // 3
        h = i_g * G + g
        if part < 2:
            c = lane % NC
            rCos = cute.make_rmem_tensor((VEC,), Float32)
            rSin = cute.make_rmem_tensor((VEC,), Float32)
            rG1 = cute.make_rmem_tensor((VEC,), self.dtype)
            rG2 = cute.make_rmem_tensor((VEC,), self.dtype)
            rX1 = cute.make_rmem_tensor((VEC,), Float32)
            rX2 = cute.make_rmem_tensor((VEC,), Float32)
            rO1 = cute.make_rmem_tensor((VEC,), self.dtype)
            rO2 = cute.make_rmem_tensor((VEC,), self.dtype)
            # misalignment of this lane's dK rows c * VEC + e and D/2 + c * VEC + e (low bits of a
            # product are exact in wrapping 32-bit arithmetic; t0 is a multiple of VEC)
            mis = cute.make_rmem_tensor((2 * VEC,), Int32)
            for e in cutlass.range_constexpr(2 * VEC):
                row = c * VEC + (e % VEC) + (e // VEC) * HALF
                mis[e] = ((h * D + row) * tokens) & (VEC - 1)
            col = (part * H + h) * 2 * NC  # the head's first output vector in the packed row
            for i in cutlass.range_constexpr(TT * NC // 32):
                tau = lane // NC + i * (32 // NC)
                if t0 + tau < tokens:
                    cute.autovec_copy(_vector(sCos[tau, None], c, VEC), rCos)
                    cute.autovec_copy(_vector(sSin[tau, None], c, VEC), rSin)
                    if part == 0:
                        cute.autovec_copy(_vector(sQ[g, tau, None], c, VEC), rG1)
                        cute.autovec_copy(_vector(sQ[g, tau, None], c + NC, VEC), rG2)
                    else:  # the transpose: column tau of the staged dK rows
                        for e in cutlass.range_constexpr(VEC):
                            rG1[e] = sK[g, c * VEC + e, mis[e] + tau]
                            rG2[e] = sK[g, HALF + c * VEC + e, mis[VEC + e] + tau]
                    for e in cutlass.range_constexpr(VEC):
                        g1 = rG1[e].to(Float32)
                        g2 = rG2[e].to(Float32)
                        rX1[e] = add_rn(mul_rn(g1, rCos[e]), mul_rn(g2, rSin[e]))
                        rX2[e] = sub_rn(mul_rn(g2, rCos[e]), mul_rn(g1, rSin[e]))
                    rO1.store(rX1.load().to(self.dtype))
                    rO2.store(rX2.load().to(self.dtype))
                    cute.autovec_copy(rO1, _vector(mO[t0 + tau, None], col + c, VEC))
                    cute.autovec_copy(rO2, _vector(mO[t0 + tau, None], col + NC + c, VEC))
        else:
            rV = cute.make_rmem_tensor((VEC,), self.dtype)
            if const_expr(not self.has_v):
                rV.fill(0)
            row_vectors = D // VEC
            col = (2 * H + h) * row_vectors
            for i in cutlass.range_constexpr(TT * row_vectors // 32):
                item = lane + i * 32
                tau = item // row_vectors
                j = item - tau * row_vectors
                if t0 + tau < tokens:
                    if const_expr(self.has_v):
                        cute.autovec_copy(_vector(sV[g, tau, None], j, VEC), rV)
                    cute.autovec_copy(rV, _vector(mO[t0 + tau, None], col + j, VEC))


# -- compile and launch ---------------------------------------------------------------------------

CACHE = _cd.KernelCache()  # (dtype, H, D, has dV, geometry, arch) -> compiled function


def _fake_tensors(dtype: torch.dtype, heads: int, dim: int, has_v: bool) -> tuple:
    """Fake tensors of the compiled signature: one symbolic T shared by all; 16-byte aligned."""
    cdt = _DTYPES[dtype]
    tokens = cute.sym_int()

    def fake(dt, shape, stride):
        return cute.runtime.make_fake_tensor(dt, shape, stride, assumed_align=16)

    # dQ/dV head stride T * D (a multiple of D); dK row stride T (any), head stride T * D
    htd = fake(cdt, (heads, tokens, dim), (cute.sym_int64(divisibility=dim), dim, 1))
    hdt = fake(cdt, (heads, dim, tokens), (cute.sym_int64(divisibility=dim), cute.sym_int64(), 1))
    v = fake(cdt, (heads, tokens, dim), (cute.sym_int64(divisibility=dim), dim, 1)) if has_v else None
    cos = fake(Float32, (tokens, dim // 2), (cute.sym_int64(divisibility=4), 1))
    sin = fake(Float32, (tokens, dim // 2), (cute.sym_int64(divisibility=4), 1))
    out = fake(cdt, (tokens, 3 * heads * dim), (3 * heads * dim, 1))
    return htd, hdt, v, cos, sin, out


def compile_backward(dtype: torch.dtype, heads: int, dim: int, has_v: bool, arch: str, *, keep_ptx: bool = False,
                     dump_dir: str | None = None, geo: Geometry | None = None):
    """The kernel for one configuration, compiled for ``arch`` (``sm_90a``, ``sm_100a``; no GPU needed).

    Called as ``fn(dq_htd, dk_hdt, dv_htd or None, cos, sin, out)`` with torch tensors; it launches
    on the current torch stream. ``keep_ptx``: the PTX is ``fn.__ptx__`` (also written to
    ``dump_dir``, see `dsfuse._common.cutedsl.compile`). ``geo``: another geometry (sweeps).
    """
    if reasons := shape_reasons(dtype, heads, dim):
        raise ValueError("the CuTe DSL vision RoPE backward cannot compile this: " + "; ".join(reasons))
    geo = geo or geometry(dtype, heads, dim)
    itemsize = dtype.itemsize
    if geo.smem_bytes(itemsize, has_v) > SMEM_LIMIT:
        raise ValueError(f"{geo} stages {geo.smem_bytes(itemsize, has_v)} bytes per CTA (limit {SMEM_LIMIT})")
    args = _fake_tensors(dtype, heads, dim, has_v)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _cd.compile(_Backward(dtype, heads, dim, has_v, geo), *args, stream, arch=arch, keep_ptx=keep_ptx,
                       dump_dir=dump_dir)


_arch = _cd.arch_of  # a device's compile target (the CPU tests replace it to launch without a GPU)


def compiled(dtype: torch.dtype, heads: int, dim: int, has_v: bool, arch: str):
    """The cached compiled kernel (compiled on first use)."""
    geo = geometry(dtype, heads, dim)
    return CACHE.get((dtype, heads, dim, has_v, geo, arch),
                     lambda: compile_backward(dtype, heads, dim, has_v, arch, geo=geo))


_LAUNCH: dict[tuple, object] = {}  # per device and launch constants: the compiled function, looked up once


def _kernel(dtype: torch.dtype, heads: int, dim: int, has_v: bool, device: torch.device):
    key = (dtype, heads, dim, has_v, device, TILE_BYTES, HEADS_PER_CTA)
    fn = _LAUNCH.get(key)
    if fn is None:
        if not _cd.tvm_ffi_installed():  # torch tensors in, the current torch stream: TVM-FFI's call path
            raise ImportError(f"the CuTe DSL vision RoPE backward is called through TVM-FFI: pip install "
                              f"'dsfuse[{_cd.EXTRA}]' (apache-tvm-ffi)")
        fn = _LAUNCH[key] = compiled(dtype, heads, dim, has_v, _arch(device))
    return fn


def launch_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dQ, dK, dV (``[H, T, D]`` logical, the model's strides; ``dv=None``: zeros) -> ``out`` ``[T, 3HD]``.

    Same signature as the Triton launcher. ``dk`` is the ``[H, T, D]`` view of a contiguous
    ``[H, D, T]`` buffer. Shapes, dtypes and aliasing are validated by the public API (under
    ``torch.compile`` by the declared op); the layout this kernel needs is checked here
    (``ValueError``). Runs on the current torch stream; compiles on the first call of a
    configuration only.
    """
    heads, tokens, dim = dq.shape
    dk_hdt = dk.transpose(1, 2)
    if reasons := shape_reasons(dq.dtype, heads, dim) + layout_reasons(dq, dk_hdt, dv, cos, sin, out):
        raise ValueError("the CuTe DSL vision RoPE backward cannot serve this call: " + "; ".join(reasons))
    if tokens == 0:
        return out
    _kernel(dq.dtype, heads, dim, dv is not None, dq.device)(dq, dk_hdt, dv, cos, sin, out)
    return out


# -- ahead-of-time specialisations ----------------------------------------------------------------


def _aot_specs() -> list[_cd.CuteAotSpec]:
    """The model's specialisations: 16 heads x 64, bf16, with dV (the public backward) and without
    (dQ, dK alone; zeros in the v columns). The tests add fp16 and fp32."""
    def spec(has_v: bool) -> _cd.CuteAotSpec:
        return _cd.CuteAotSpec(f"vision_rope_bwd_bf16{'' if has_v else '_no_v'}",
                           lambda arch, dump_dir=None: compile_backward(torch.bfloat16, 16, 64, has_v, arch,
                                                                        keep_ptx=True, dump_dir=dump_dir))

    return [spec(True), spec(False)]


AOT_SPECS = _aot_specs()
