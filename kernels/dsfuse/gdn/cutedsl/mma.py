"""Tensor-core products of shared-memory tiles, the building block of the fused forward's tensor-core
form: ``C (+)= A B^T`` for bf16/fp16 tiles ``A`` ``(M, K)`` and ``B`` ``(N, K)`` with fp32
accumulation, on the warp-level ``mma.sync`` 16x8x16 instruction (sm_80 and later: the same code on
sm_90a and sm_100a; Hopper's warpgroup form is `dsfuse.gdn.cutedsl.wgmma`).

Either operand may be a transposed view of a stored tile (``cute.make_tensor`` over the tile's
iterator with swapped strides): ``K^T`` for the state update, ``S`` stored ``[K, BV]`` as the B
operand of ``k S``. With `operands` the register fragments are filled by element-wise copies from
those views, so any strides work; with `ldmatrix_operands` (the per-head form and the UT inverse)
by ``ldmatrix`` from swizzled tiles. The GPU test below checks the element-wise path.

`tiled_mma` builds the product of 4 warps (2 x 2 over M and N, or as many as asked); `operands`
partitions a product's tiles for the calling thread, `gemm` runs it with element-wise operand
copies; `ldmatrix_operands` and `gemm_ldmatrix` do the same with ``ldmatrix`` from `swizzled_tile`s
(`transposed` views for the operands stored transposed); `coordinates` and `rounded` serve
elementwise work on accumulators in registers; `store` writes the fp32 accumulator into a shared (or
global) tile. The GPU test (``tests/gdn/test_gdn_cutedsl_mma.py``) checks the three operand layouts
the fused forward needs against float64 products of the same bf16 / fp16 values; the ``ldmatrix``
path is checked through the kernels that use it (their float64 tests).
"""

from __future__ import annotations

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32

WARPS_MN = (2, 2)  # warps over M and N: a product needs M % 32 == 0, N % 16 == 0, K % 16 == 0
THREADS = 32 * WARPS_MN[0] * WARPS_MN[1]


def tiled_mma(ab_dtype, warps_mn: tuple[int, int] = WARPS_MN, ldmatrix: bool = False):
    """The product of ``ab_dtype`` (``cutlass.BFloat16`` or ``cutlass.Float16``) operands with fp32
    accumulators on ``warps_mn`` warps (over M and N: a product needs M a multiple of 16 times the
    first, N of 8 times the second, K of 16). With ``ldmatrix``, each warp takes 16 columns of N per
    tile (N a multiple of 16 times the second), the 16 x 16 blocks an ``ldmatrix.x4`` fills
    (`ldmatrix_operands`)."""
    op = cute.nvgpu.warp.MmaF16BF16Op(ab_dtype, Float32, (16, 8, 16))
    if ldmatrix:
        return cute.make_tiled_mma(op, atom_layout_mnk=(*warps_mn, 1),
                                   permutation_mnk=(16 * warps_mn[0], 16 * warps_mn[1], 16))
    return cute.make_tiled_mma(op, atom_layout_mnk=(*warps_mn, 1))


def accumulator(mma, tidx, shape_mn):
    """This thread's fp32 accumulator of an ``(M, N)`` product, zeroed."""
    acc = mma.make_fragment_C(mma.get_slice(tidx).partition_shape_C(shape_mn))
    acc.fill(0.0)
    return acc


def operands(mma, tidx, sA, sB):
    """This thread's part of a product's operands: ``sA`` ``(M, K)``, ``sB`` ``(N, K)`` tile views and
    register fragments of one 16-wide block of K each. Made once, before the loop that runs the
    product (the partitions are the same on every pass)."""
    thr = mma.get_slice(tidx)
    tCsA, tCsB = thr.partition_A(sA), thr.partition_B(sB)
    return tCsA, tCsB, mma.make_fragment_A(tCsA[None, None, 0]), mma.make_fragment_B(tCsB[None, None, 0])


def gemm(mma, acc, ops):
    """``acc += A B^T`` of `operands` ``ops``, one block of K at a time."""
    tCsA, tCsB, tCrA, tCrB = ops
    for kb in range(cute.size(tCsA, mode=[2])):  # static: unrolled as the kernel is traced
        cute.autovec_copy(tCsA[None, None, kb], tCrA)
        cute.autovec_copy(tCsB[None, None, kb], tCrB)
        cute.gemm(mma, acc, tCrA, tCrB, acc)


def swizzled_layout(rows: int, cols: int, stages: int = 1):
    """The layout of a ``[rows, cols]`` 16-bit `swizzled_tile` (1024-byte aligned storage), or of
    ``stages`` of them one after the other (``[rows, cols, stages]``)."""
    width = 64 if cols % 64 == 0 else 32
    if rows % 8 or cols % width:  # whole atoms: a stage's offset then leaves the swizzle's bits alone
        raise ValueError(f"a swizzled tile is whole 8 x {width} atoms, not [{rows}, {cols}]")
    atom = cute.make_composed_layout(cute.make_swizzle(3 if width == 64 else 2, 3, 3), 0,
                                     cute.make_layout((8, width), stride=(width, 1)))
    shape = (rows, cols) if stages == 1 else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, tuple(range(len(shape))))


def swizzled_tile(smem, dtype, rows: int, cols: int, stages: int = 1):
    """A ``[rows, cols]`` 16-bit shared-memory tile, row-major in 8-row atoms 64 (or 32) wide whose
    16-byte chunks are permuted by row (``Swizzle<3, 3, 3>``, or ``<2, 3, 3>``): the 8 rows an
    ``ldmatrix`` reads, or a row of 16-byte ``cp.async`` writes, fall in distinct banks. With
    ``stages`` > 1, that many tiles one after the other: a stage is ``t[None, None, s]``."""
    return smem.allocate_tensor(dtype, swizzled_layout(rows, cols, stages), byte_alignment=1024)


def transposed(tile):
    """The ``(cols, rows)`` view of a ``[rows, cols]`` tile (any layout, swizzled too)."""
    rows, cols = cute.size(tile, mode=[0]), cute.size(tile, mode=[1])
    return cute.composition(tile, cute.make_layout((cols, rows), stride=(rows, 1)))


def ldmatrix_operands(mma, tidx, sA, sB, a_transposed: bool, b_transposed: bool):
    """`operands` for a `tiled_mma` made with ``ldmatrix``: ``sA`` ``(M, K)`` and ``sB`` ``(N, K)``
    views, the fragments filled by ``ldmatrix.x4`` (``.trans`` for an operand stored M- or
    N-contiguous, a `transposed` view). Run with `gemm_ldmatrix`."""
    thr = mma.get_slice(tidx)
    ab = sA.element_type
    copies = []
    for tile, trans, make, frag in ((sA, a_transposed, cute.make_tiled_copy_A, thr.make_fragment_A),
                                    (sB, b_transposed, cute.make_tiled_copy_B, thr.make_fragment_B)):
        atom = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=trans, num_matrices=4), ab)
        tiled = make(atom, mma)
        part = tiled.get_slice(tidx)
        regs = frag(thr.partition_A(tile) if make is cute.make_tiled_copy_A else thr.partition_B(tile))
        copies.append((tiled, part.partition_S(tile), part.retile(regs), regs))
    return copies


def gemm_ldmatrix(mma, acc, ops):
    """``acc += A B^T`` of `ldmatrix_operands` ``ops``, one 16-wide block of K at a time."""
    (copy_a, tAs, tAr, tCrA), (copy_b, tBs, tBr, tCrB) = ops
    for kb in range(cute.size(tCrA, mode=[2])):  # static: unrolled as the kernel is traced
        cute.copy(copy_a, tAs[None, None, kb], tAr[None, None, kb])
        cute.copy(copy_b, tBs[None, None, kb], tBr[None, None, kb])
        cute.gemm(mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)


def store(mma, tidx, acc, sC):
    """Write this thread's accumulator into the ``(M, N)`` fp32 tile ``sC``."""
    cute.autovec_copy(acc, mma.get_slice(tidx).partition_C(sC))


def coordinates(mma, tidx, shape_mn):
    """The ``(row, column)`` of each element of this thread's accumulator of an ``(M, N)`` product:
    elementwise work on the accumulator in registers (masks, gates, row scales)."""
    return mma.get_slice(tidx).partition_C(cute.make_identity_tensor(shape_mn))


def rounded(acc, dtype):
    """A register copy of ``acc`` in ``dtype`` (the operand of a following product), same layout."""
    frag = cute.make_fragment_like(acc, dtype)
    frag.store(acc.load().to(dtype))
    return frag


def view(tile, shape, stride):
    """``tile``'s storage seen with another shape and stride (a transposed operand)."""
    return cute.make_tensor(tile.iterator, cute.make_layout(shape, stride=stride))


# -- the check of the building block ---------------------------------------------------------------

# The fused forward's operand forms, as (name, M, N, K, A stored transposed, B stored transposed):
# q k^T (both stored [tokens, K]); k S (S stored [K, BV]); k^T v_new (k stored [tokens, K], v_new [tokens, BV]).
FORMS = {"qkT": (64, 64, 128, False, False), "kS": (64, 32, 128, False, True), "kTv": (128, 32, 64, True, True)}


@cute.jit
def fill(tidx, threads: cutlass.Constexpr, mX: cute.Tensor, sX: cute.Tensor):
    """``sX = mX`` element by element, an ``(rows, cols)`` tile by ``threads`` threads."""
    cols = cute.size(sX, mode=[1])
    for i in cutlass.range(cute.size(sX) // threads):
        idx = tidx + i * threads
        r = idx // cols
        sX[r, idx - r * cols] = mX[r, idx - r * cols]


class ProductCheck:
    """A check kernel of one product form ``(M, N, K, A stored transposed, B stored transposed)`` of
    ``forms``: ``c = a b^T`` with ``a`` stored ``[M, K]`` (or ``[K, M]``) and ``b`` ``[N, K]`` (or
    ``[K, N]``), all contiguous; a subclass defines ``__call__`` and ``kernel``, `compile` and `run`
    are shared."""

    def __init__(self, dtype: torch.dtype, form: str, forms: dict):
        self.dtype = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
        self.m, self.n, self.k, self.a_t, self.b_t = forms[form]
        self.a_shape = (self.k, self.m) if self.a_t else (self.m, self.k)
        self.b_shape = (self.k, self.n) if self.b_t else (self.n, self.k)

    def compile(self, arch: str, *, keep_ptx: bool = False, dump_dir: str | None = None):
        """This check compiled for ``arch`` (no GPU needed)."""
        fake = [cute.runtime.make_fake_compact_tensor(elem, shape, stride_order=(1, 0), assumed_align=16)
                for elem, shape in ((self.dtype, self.a_shape), (self.dtype, self.b_shape),
                                    (Float32, (self.m, self.n)))]
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return _cd.compile(self, *fake, stream, arch=arch, keep_ptx=keep_ptx, dump_dir=dump_dir)

    @staticmethod
    def run(fn, a: torch.Tensor, b: torch.Tensor, m: int, n: int) -> torch.Tensor:
        """``c`` fp32 ``[m, n]`` from the compiled check ``fn`` of the stored operands (poisoned with NaN
        first: an element the kernel leaves unwritten fails the caller's comparison)."""
        c = torch.full((m, n), float("nan"), device=a.device, dtype=torch.float32)
        fn(a, b, c)
        return c


class _Check(ProductCheck):
    """`ProductCheck` on ``mma.sync`` with element-wise operand copies, 4 warps."""

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
        self.kernel(mA, mB, mC).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
        M, N, K = self.m, self.n, self.k
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        a_shape, b_shape = self.a_shape, self.b_shape
        sA = smem.allocate_tensor(self.dtype, cute.make_layout(a_shape, stride=(a_shape[1], 1)), byte_alignment=16)
        sB = smem.allocate_tensor(self.dtype, cute.make_layout(b_shape, stride=(b_shape[1], 1)), byte_alignment=16)
        sC = smem.allocate_tensor(Float32, cute.make_layout((M, N), stride=(N, 1)), byte_alignment=16)
        fill(tidx, THREADS, mA, sA)
        fill(tidx, THREADS, mB, sB)
        cute.arch.sync_threads()

        mma = tiled_mma(self.dtype)
        opA = view(sA, (M, K), (1, M)) if self.a_t else sA
        opB = view(sB, (N, K), (1, N)) if self.b_t else sB
        acc = accumulator(mma, tidx, (M, N))
        gemm(mma, acc, operands(mma, tidx, opA, opB))
        store(mma, tidx, acc, sC)
        cute.arch.sync_threads()
        fill(tidx, THREADS, sC, mC)


CACHE = _cd.KernelCache()  # (dtype, form, arch) -> compiled function


def compile_check(dtype: torch.dtype, form: str, arch: str, *, keep_ptx: bool = False, dump_dir: str | None = None):
    """The check kernel of one operand form, compiled for ``arch`` (no GPU needed)."""
    return _Check(dtype, form, FORMS).compile(arch, keep_ptx=keep_ptx, dump_dir=dump_dir)


def check(a: torch.Tensor, b: torch.Tensor, form: str) -> torch.Tensor:
    """``c`` fp32 ``[M, N]`` of the form's stored operands (contiguous, on a GPU)."""
    fn = CACHE.get((a.dtype, form, _cd.arch_of(a.device)), lambda: compile_check(a.dtype, form, _cd.arch_of(a.device)))
    return ProductCheck.run(fn, a, b, *FORMS[form][:2])


def _aot_specs() -> list[_cd.CuteAotSpec]:
    return [_cd.CuteAotSpec(f"gdn_mma_check_{form}",
                            lambda arch, dump_dir=None, form=form: compile_check(torch.bfloat16, form, arch,
                                                                                 keep_ptx=True, dump_dir=dump_dir))
            for form in FORMS]


AOT_SPECS = _aot_specs()
