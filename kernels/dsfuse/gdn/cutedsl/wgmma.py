"""Warpgroup tensor-core products (``wgmma``, sm_90a only) of shared-memory tiles, step 10 of
the fused forward's record (docs/ops/gdn_forward.md): ``C (+)= A B^T`` for bf16/fp16 ``A`` ``(M, K)``
and ``B`` ``(N, K)`` with fp32 accumulators in registers, each operand read by the tensor cores
straight from shared memory (a descriptor, no ``ldmatrix`` into every warp's registers).

Tiles are the canonical 128-byte-swizzled layouts the instruction reads: `tile` gives a ``[rows,
cols]`` 16-bit tile stored row-major in 8-row atoms 64 wide, its 16-byte chunks permuted by row (the
swizzle rides on the pointer). The same storage serves a product three ways:

- as a K-major operand ``(rows, cols)`` = ``(M or N, K)`` (q, k, the gated ``64 x 64`` tiles);
- through `transposed`, as an M- or N-major operand ``(cols, rows)``: ``k^T`` as the A operand of the
  state update, and the state, ``X``, ``v_new`` and its decayed copy (stored ``[K or C, V]``) as B
  operands ``(V, K or C)``;
- through the ``(rows, cols)`` view itself for everything else: 16-byte ``cp.async`` rows, the
  accumulators' rounded stores, elementwise reads.

`tiled_mma` spreads a product over warpgroups (4 of them: 512 threads); `operands` and `gemm` run it
(``wgmma.fence``, the K blocks, commit, wait); `store` and `store_rounded` put a (rounded)
accumulator into a tile by ``stmatrix``, `load_like` a tile into a fragment in an accumulator's
layout by ``ldmatrix``; `row_pair`, `pick` and `masked` the elementwise work on an accumulator by
its two rows a thread; `fence_writes` orders a thread's ordinary shared-memory
writes (``st.shared``, ``cp.async``) before the tensor cores read them (``fence.proxy.async``; call it
before the barrier that precedes the product). Accumulators, their coordinates and rounded copies
are `dsfuse.gdn.cutedsl.mma`'s (`accumulator`, `coordinates`, `rounded`): the same calls for any tiled
product.

Checked on the H200 (``tests/gdn/test_gdn_cutedsl_wgmma.py``): the check kernel below, one
``wgmma`` per 16-wide block of K and warpgroup tile, against float64 in every operand form; the CPU
tests compile it for sm_90a.
"""

from __future__ import annotations

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
import cutlass.utils.hopper_helpers as sm90

from dsfuse.gdn.cutedsl import mma as _mma

WARPGROUPS = 4
THREADS = 128 * WARPGROUPS
ARCHS = ("sm_90a",)  # wgmma is Hopper's; sm_100a has tcgen05 instead


def tile(smem, dtype, rows: int, cols: int, stages: int = 1) -> cute.Tensor:
    """A ``[rows, cols]`` 16-bit tile (``rows`` a multiple of 8, ``cols`` of 64) in the K-major
    128-byte-swizzled layout: a K-major operand ``(rows, cols)`` as it stands, an M- or N-major one
    ``(cols, rows)`` through `transposed` (1024-byte aligned storage). With ``stages`` > 1, that many
    tiles one after the other, ``[rows, cols, stages]``: a stage is ``t[None, None, s]``."""
    if rows % 8 or cols % 64:  # whole 8 x 64 swizzle atoms: each stage then starts 1024-byte aligned
        raise ValueError(f"a wgmma tile is whole 8 x 64 atoms, not [{rows}, {cols}]")
    return tile_over(smem.allocate(rows * cols * stages * dtype.width // 8, 1024), dtype, rows, cols, stages)


def tile_over(storage, dtype, rows: int, cols: int, stages: int = 1) -> cute.Tensor:
    """A `tile` on ``storage`` (a 1024-byte aligned shared-memory pointer with room for it): two tiles
    on the same storage share it, for a kernel whose tiles take turns (the second written only after
    every read of the first)."""
    layout = tile_layout(dtype, rows, cols, stages)
    return cute.make_tensor(cute.recast_ptr(storage, layout.inner, dtype=dtype), layout.outer)


def tile_layout(dtype, rows: int, cols: int, stages: int = 1):
    """The swizzled layout of a `tile` (the swizzle its ``inner``): also what a TMA copy of the tile
    is built from."""
    shape = (rows, cols) if stages == 1 else (rows, cols, stages)
    return cute.tile_to_shape(warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype),
                              shape, tuple(range(len(shape))))


def transposed(t: cute.Tensor) -> cute.Tensor:
    """The ``(cols, rows)`` view of a `tile` (same storage and swizzle)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


def tiled_mma(dtype, m: int, n: int, a_k_major: bool, b_k_major: bool, warpgroups: int = WARPGROUPS,
              a_in_registers: bool = False):
    """The product of an ``(m, n)`` tile over ``warpgroups`` warpgroups, fp32 accumulators: the
    warpgroups split M in 64-row slices first (``m / 64`` of them), then N. ``a_in_registers``: A
    comes from each thread's registers (`operands_rs`), K-major."""
    over_m = m // 64
    over_n = warpgroups // over_m
    major = {True: OperandMajorMode.K, False: OperandMajorMode.MN}
    source = warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM
    return sm90.make_trivial_tiled_mma(dtype, dtype, major[a_k_major], major[b_k_major], Float32,
                                       (over_m, over_n, 1), (64, n // over_n), source)


def row_pair(coords: cute.Tensor, vec: cute.Tensor, first=0) -> tuple:
    """``vec[first + r]`` for this thread's two rows of a warpgroup product's accumulator (``r0 = coords[0]``'s and ``r0 + 8``),
    read once into registers: the elementwise loops then `pick` them rather than read shared memory
    for every element (a read that a store or a branch in between would keep the compiler from
    sharing)."""
    r0 = coords[0][0]
    return vec[first + r0], vec[first + r0 + 8]


def pick(coords: cute.Tensor, i: int, pair: tuple):
    """Element ``i``'s row's value of a `row_pair` (the comparison folds: an element's row offset in
    the accumulator is static)."""
    return Float32(cutlass.select_(coords[i][0] == coords[0][0], pair[0], pair[1]))


def masked(keep, x):
    """``x`` where ``keep``, else zero: a select, so a masked-off ``x`` (an overflowed decay above the
    diagonal) never reaches the result, and no branch splits the loop."""
    return Float32(cutlass.select_(keep, x, Float32(0.0)))


def as_operand_a(frag: cute.Tensor) -> cute.Tensor:
    """A 16-bit fragment in the layout of an ``(M, N)`` product's accumulator, seen as the A operand
    ``(M, K = N)`` of a product whose A comes from registers: each 8-column piece of the
    accumulator's values pairs with the next into one 16-wide block of K (the same registers)."""
    layout = frag.layout
    values = cute.logical_divide(layout, ((None, None, 2), None, None))  # ((2, 2, (2, N / 16)), M, N)
    a = cute.make_layout(((values.shape[0][0], values.shape[0][1], values.shape[0][2][0]), values.shape[1],
                          (values.shape[0][2][1], values.shape[2])),
                         stride=((values.stride[0][0], values.stride[0][1], values.stride[0][2][0]), values.stride[1],
                                 (values.stride[0][2][1], values.stride[2])))
    return cute.make_tensor(frag.iterator, a)


def operands_rs(mma, tidx, frag: cute.Tensor, sB: cute.Tensor):
    """The operands of a product whose A is ``frag`` (this thread's registers, `as_operand_a`) and whose
    B is the tile ``sB`` ``(N, K)``."""
    return as_operand_a(frag), mma.make_fragment_B(mma.get_slice(tidx).partition_B(sB))


def operands(mma, tidx, sA: cute.Tensor, sB: cute.Tensor):
    """The operand descriptors of ``sA`` ``(M, K)`` and ``sB`` ``(N, K)`` for this thread's warpgroup."""
    thr = mma.get_slice(tidx)
    return mma.make_fragment_A(thr.partition_A(sA)), mma.make_fragment_B(thr.partition_B(sB))


def gemm(mma, acc, ops, wait: bool = True, fresh: bool = False):
    """``acc += A B^T`` of `operands` ``ops``, every K block issued, then waited for (the accumulator
    is the thread's to read or change again when this returns); without ``wait``, issued only: the
    thread may do other work (not touching ``acc`` or the operands' writers) until `wait`. ``fresh``:
    ``acc = A B^T``, the first K block not adding what ``acc`` holds (a `fresh_accumulator`)."""
    tCrA, tCrB = ops
    warpgroup.fence()
    for kb in range(cute.size(tCrA, mode=[2])):  # static: unrolled as the kernel is traced
        mma.set(warpgroup.Field.ACCUMULATE, not (fresh and kb == 0))
        cute.gemm(mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
    warpgroup.commit_group()
    if wait:
        warpgroup.wait_group(0)


def fresh_accumulator(mma, tidx, shape_mn):
    """This thread's fp32 accumulator of an ``(M, N)`` product, not zeroed: for a first product issued
    with ``fresh``. (Zeroing by ordinary instructions between asynchronous products makes the
    assembler wait for the ones in flight before the next starts: ptxas's C7517.)"""
    return mma.make_fragment_C(mma.get_slice(tidx).partition_shape_C(shape_mn))


def wait():
    """Wait for the products issued by `gemm` without ``wait``."""
    warpgroup.wait_group(0)


def wait_for(pending: int):
    """Wait until at most the last ``pending`` of the products issued by `gemm` without ``wait`` still
    run (they finish in the order they were issued)."""
    warpgroup.wait_group(pending)


def store(mma, tidx, frag: cute.Tensor, t: cute.Tensor, transpose: bool = False):
    """``frag``, a 16-bit fragment in the accumulator's layout, into the `tile` ``t`` (its ``(rows,
    cols)`` view, the accumulator's ``(M, N)``) by ``stmatrix``: four 8 x 8 matrices a warp
    instruction, where a plain copy takes a 32-bit store for every two values; ``transpose``: ``t``
    is a `transposed` view (``stmatrix.trans``)."""
    atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=transpose, num_matrices=4),
                               frag.element_type)
    copy = cute.make_tiled_copy_C(atom, mma)
    cute.copy(copy, copy.retile(frag), copy.get_slice(tidx).partition_D(t))


def store_rounded(mma, tidx, acc, t: cute.Tensor, dtype):
    """``acc`` rounded to ``dtype`` into the `tile` ``t`` by ``stmatrix`` (`store`)."""
    store(mma, tidx, _mma.rounded(acc, dtype), t)


def load_like(mma, tidx, t: cute.Tensor, frag: cute.Tensor, transpose: bool = False):
    """The `tile` ``t`` (``(rows, cols)`` = ``(M, N)``) into ``frag``, a 16-bit fragment in the
    accumulator's layout, by ``ldmatrix`` (four 8 x 8 matrices a warp instruction); ``transpose``:
    ``t`` is a `transposed` view (``ldmatrix.trans``)."""
    atom = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4),
                               frag.element_type)
    copy = cute.make_tiled_copy_C(atom, mma)
    cute.copy(copy, copy.get_slice(tidx).partition_S(t), copy.retile(frag))


def fence_writes():
    """Order this thread's ordinary shared-memory writes before later tensor-core reads of them."""
    cute.arch.fence_proxy("async.shared", space="cta")


# -- the check of the building block ---------------------------------------------------------------

# The per-head forward's products, as (name, M, N, K, A stored transposed, B stored transposed), with
# a "stored transposed" operand held [K, M] or [K, N] and read through `transposed`:
# q k^T (both stored [tokens, K]); k S, and alike A X and (q k^T) v_new (S stored [K, V]);
# k^T v_new, the state update (k stored [tokens, K], v_new [tokens, V]); kS64, k S at K = V = 64, whose
# warpgroups read 16-wide slices of the N-major B operand (starting inside a 128-byte swizzled row).
FORMS = {"qkT": (64, 64, 128, False, False), "kS": (64, 128, 128, False, True), "kTv": (128, 128, 64, True, True),
         "kS64": (64, 64, 64, False, True)}


class _Check(_mma.ProductCheck):
    """`dsfuse.gdn.cutedsl.mma.ProductCheck` on ``wgmma``, 4 warpgroups, from `tile`s."""

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
        self.kernel(mA, mB, mC).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
        M, N = self.m, self.n
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        sA, sB = tile(smem, self.dtype, *self.a_shape), tile(smem, self.dtype, *self.b_shape)
        _mma.fill(tidx, THREADS, mA, sA)
        _mma.fill(tidx, THREADS, mB, sB)
        fence_writes()
        cute.arch.sync_threads()

        mma = tiled_mma(self.dtype, M, N, not self.a_t, not self.b_t)
        acc = _mma.accumulator(mma, tidx, (M, N))
        gemm(mma, acc, operands(mma, tidx, transposed(sA) if self.a_t else sA, transposed(sB) if self.b_t else sB))
        cute.autovec_copy(acc, mma.get_slice(tidx).partition_C(mC))


CACHE = _cd.KernelCache()  # (dtype, form, arch) -> compiled function


def compile_check(dtype: torch.dtype, form: str, arch: str, *, keep_ptx: bool = False, dump_dir: str | None = None):
    """The check kernel of one operand form, compiled for ``arch`` (sm_90a; no GPU needed)."""
    if arch not in ARCHS:
        raise ValueError(f"wgmma products compile for {ARCHS} only, not {arch}")
    return _Check(dtype, form, FORMS).compile(arch, keep_ptx=keep_ptx, dump_dir=dump_dir)


def check(a: torch.Tensor, b: torch.Tensor, form: str) -> torch.Tensor:
    """``c`` fp32 ``[M, N]`` of the form's stored operands (contiguous, on an sm_90 GPU)."""
    fn = CACHE.get((a.dtype, form, _cd.arch_of(a.device)), lambda: compile_check(a.dtype, form, _cd.arch_of(a.device)))
    return _mma.ProductCheck.run(fn, a, b, *FORMS[form][:2])


def _aot_specs() -> list[_cd.CuteAotSpec]:
    return [_cd.CuteAotSpec(f"gdn_wgmma_check_{form}",
                            lambda arch, dump_dir=None, form=form: compile_check(torch.bfloat16, form, arch,
                                                                                 keep_ptx=True, dump_dir=dump_dir),
                            archs=ARCHS)
            for form in FORMS]


AOT_SPECS = _aot_specs()
