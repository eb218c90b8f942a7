"""What the Gated DeltaNet Triton stages share.

* The chunk size ``CHUNK`` (``BT``) and the L2 norm's eps.
* Device helpers: `dot` and `round_to`, a ``tl.dot`` and an fp32 -> dtype conversion that
  the CPU interpreter can run with bf16 data as the GPU does (``EMULATE_BF16``);
  `value_block_program` and `chunk_head_program`, a program's coordinates in the grids of the
  stages; `chunk_span` and `chunk_tokens`, a chunk's tokens from the chunk table; `rows` and `cols`,
  pointers to a chunk's tile of a ``[T, heads, C]`` tensor and to its transpose, `load_rows`,
  `load_cols`, `store_rows` and `load_tokens` (a ``[T, heads]`` tensor's ``[BT]`` values) their
  masked loads and stores; `state_tile`, a block of a ``[*, HV, K, V]`` state; `l2_normalize`,
  `chunk_decays` and `causal_decay`, the L2 norm and the decays of a chunk; `store_zero_tail`, zeros
  for the tokens in no chunk.
* Host helpers of the launchers: `dot_precision`, `emulate_bf16`, `stage` (the
  constexprs the per-head stages have in common, one `Stage` argument), `token_head_strides`, `value_block_programs`
  (the size of `value_block_program`'s grid), `sequential_pass` (a state pass's launch).
* Launch constants: a `LaunchConfig` per kernel, per GPU family where the families differ.
  The families are ``HOPPER`` (``"sm_90"``: every device below compute capability 10, the CPU
  interpreter included) and ``BLACKWELL`` (``"sm_100"``: compute capability 10 and above);
  `launch_family` maps a device to one (through `dsfuse._common.backends.gpu_family`) and
  `assume_family` pins one, which is how the AOT specs record each family's launch on a machine
  without its GPU.
* `model_tensors`: meta tensors of the model's shapes, the example arguments from which each stage
  records its ``AOT_SPECS`` (`record_variants`, through `dsfuse._common.aot.record_specs`).

The kernels' tensor arguments are named by what they hold, and each name has one layout (any token
and head strides, passed as ``s_<x>t, s_<x>h`` where a kernel's comments name no other letters, and a
unit channel stride, unless said otherwise):

* ``q``, ``k``: ``[T, H, K]``; ``w``, ``dw``: ``[T, HV, K]``; ``v``, ``u``, ``v_new`` (``vn``), ``o``,
  ``do`` and their gradients (``du``, ``dv``, ``dv_local``, ``dv_new``): ``[T, HV, V]``; the stages'
  fp32 gradients of q and k by value head (``dq_hv``, ``dk_hv``): ``[T, HV, K]``.
* ``g``, ``g_cum`` (the chunk-local cumulative log decay), ``beta``, ``dg``, ``dbeta``: ``[T, HV]``,
  fp32 for g, ``g_cum`` and ``dg``; ``A``: fp32 ``[T, HV, BT]``, unit column stride.
* ``chunk_indices`` (``ci``): int32 ``[NC, 3]`` (sequence, start, end), contiguous;
  ``chunk_offsets`` (``co``): int32 ``[N + 1]``.
* ``h``, ``dh``: ``[NC, HV, K, V]`` contiguous, input dtype (the state at each chunk's start, the
  gradient of the state after each chunk); ``h0``, ``ht``, ``dht``, ``dh0``: fp32 ``[N, HV, K, V]``
  contiguous, or None (zeros when read, not written when written).

The device helpers are inlined where they are called: a stage built from them compiles to the code
it had with the same expressions written out.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsfuse._common.aot import AotSpec, record_specs
from dsfuse._common.backends import gpu_family, interpreting

CHUNK = 64  # BT: tokens per chunk (the chunk table's chunk size)
L2NORM_EPS = tl.constexpr(1e-6)  # the reference's l2norm eps


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def dot(a, b, acc, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``acc + a @ b`` with an fp32 accumulator (``acc`` may be None).

    ``EMULATE_BF16`` only in Triton's CPU interpreter with bf16 data, whose ``tl.dot`` multiplies
    bf16 operands as their integer bit patterns: the operands are widened to fp32 (exact), so
    the products and fp32 sums are those of the GPU's bf16 MMA up to summation order."""
    if EMULATE_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (round to nearest even, as the GPU converts).

    ``EMULATE_BF16`` only in Triton's CPU interpreter, whose fp32 -> bf16 conversion truncates:
    the rounding is done on the bits first (finite values), so the conversion is exact."""
    if EMULATE_BF16 and dtype == tl.bfloat16:
        b_bits = x.to(tl.uint32, bitcast=True)
        b_bits = ((b_bits + 0x7FFF + ((b_bits >> 16) & 1)) >> 16) << 16
        x = b_bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def value_block_program(HV: tl.constexpr, GROUP: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                        BK: tl.constexpr, BT: tl.constexpr):
    """This program's place in a one-axis grid over (x, value head, value block), value block
    fastest (x: a chunk or a document): ``(i_x, i_hv, i_h, o_k, o_v, o_i)``, x's index, the value
    head, its qk head ``i_hv // GROUP``, and the offsets ``[BK]`` of key rows, ``[BV]`` of the
    program's value channels and ``[BT]`` of a chunk's tokens."""
    NV: tl.constexpr = V // BV
    i_p = tl.program_id(0)
    i_v = i_p % NV
    i_hv = (i_p // NV) % HV
    i_x = i_p // (NV * HV)
    i_h = i_hv // GROUP
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_i = tl.arange(0, BT)
    return i_x, i_hv, i_h, o_k, o_v, o_i


@triton.jit
def chunk_span(ci_ptr, i_c):
    """``(start, end)`` (int64) of chunk ``i_c`` (int64) of the chunk table ``ci_ptr`` (int32
    ``[NC, 3]``: sequence, start, end)."""
    start = tl.load(ci_ptr + i_c * 3 + 1).to(tl.int64)
    end = tl.load(ci_ptr + i_c * 3 + 2).to(tl.int64)
    return start, end


@triton.jit
def chunk_head_program(ci_ptr, kv_group):
    """This program's place in a ``(chunk, value head)`` grid: ``(i_c, i_hv, i_hv64, i_h, start, end)``,
    the chunk (int64), the value head (int32 and int64), its qk head ``i_hv // kv_group`` (int64) and
    the chunk's tokens (`chunk_span`)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_hv64 = i_hv.to(tl.int64)
    i_h = (i_hv // kv_group).to(tl.int64)
    start, end = chunk_span(ci_ptr, i_c)
    return i_c, i_hv, i_hv64, i_h, start, end


@triton.jit
def chunk_tokens(ci_ptr, i_c, o_i):
    """Chunk ``i_c`` of the chunk table: ``(i_c64, eos, o_t, m_t)``, the chunk index and its end as
    int64, the int64 token offsets ``start + o_i`` ``[BT]`` and their mask ``o_t < eos``."""
    i_c64 = i_c.to(tl.int64)
    bos, eos = chunk_span(ci_ptr, i_c64)
    o_t = bos + o_i  # [BT] int64 token offsets
    m_t = o_t < eos
    return i_c64, eos, o_t, m_t


@triton.jit
def rows(ptr, s_t, s_h, o_t, i_h, o_c):
    """Pointers ``[BT, C]`` to tokens ``o_t``, head ``i_h`` and channels ``o_c`` of a ``[T, heads, C]``
    tensor with token stride ``s_t``, head stride ``s_h`` and unit channel stride."""
    return ptr + o_t[:, None] * s_t + i_h * s_h + o_c[None, :]


@triton.jit
def cols(ptr, s_t, s_h, o_t, i_h, o_c):
    """The `rows` tile transposed, ``[C, BT]``: a transposed operand is read through swapped strides,
    so no dot result is ever transposed (Triton 3.6 on Hopper miscompiles ``tl.trans`` of a wgmma
    accumulator)."""
    return ptr + o_t[None, :] * s_t + i_h * s_h + o_c[:, None]


@triton.jit
def load_rows(ptr, s_t, s_h, o_t, m_t, i_h, o_c):
    """The `rows` tile ``[BT, C]``, 0 in the rows of tokens outside the mask ``m_t``."""
    p = rows(ptr, s_t, s_h, o_t, i_h, o_c)  # the pointers before the mask, as the stages wrote them out
    return tl.load(p, mask=m_t[:, None], other=0.0)


@triton.jit
def load_cols(ptr, s_t, s_h, o_t, m_t, i_h, o_c):
    """The `cols` tile ``[C, BT]``, 0 in the columns of tokens outside the mask ``m_t``."""
    p = cols(ptr, s_t, s_h, o_t, i_h, o_c)
    return tl.load(p, mask=m_t[None, :], other=0.0)


@triton.jit
def store_rows(ptr, s_t, s_h, o_t, m_t, i_h, o_c, x, EMULATE_BF16: tl.constexpr):
    """fp32 ``x`` ``[BT, C]`` rounded once to ``ptr``'s dtype into the `rows` tile (tokens in ``m_t``)."""
    p = rows(ptr, s_t, s_h, o_t, i_h, o_c)
    tl.store(p, round_to(x, ptr.dtype.element_ty, EMULATE_BF16), mask=m_t[:, None])


@triton.jit
def load_tokens(ptr, s_t, s_h, o_t, m_t, i_h):
    """The ``[BT]`` values of head ``i_h`` of a ``[T, heads]`` tensor (a gate), 0 outside ``m_t``."""
    return tl.load(ptr + o_t * s_t + i_h * s_h, mask=m_t, other=0.0)


@triton.jit
def state_tile(ptr, i_x, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, o_k, o_v):
    """Pointers ``[BK, BV]`` to key rows ``o_k`` and value channels ``o_v`` of state ``i_x``
    (int64: a chunk or a document) and value head ``i_hv`` of a contiguous ``[*, HV, K, V]`` tensor."""
    return ptr + (i_x * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]


@triton.jit
def l2_normalize(x, AXIS: tl.constexpr, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``x * rsqrt(sum x^2 + eps)`` along ``AXIS`` in fp32 (the rows of a ``[BT, K]`` tile with
    ``AXIS = 1``, the columns of a ``[K, BT]`` one with ``AXIS = 0``), rounded once to ``dtype``."""
    xf = x.to(tl.float32)
    return round_to(xf * tl.expand_dims(tl.rsqrt(tl.sum(xf * xf, axis=AXIS) + L2NORM_EPS), AXIS), dtype,
                    EMULATE_BF16)


@triton.jit
def chunk_decays(g_ptr, s_gt, s_gh, o_t, m_t, i_hv, eos):
    """A chunk's decays from the cumulative gate ``g_ptr`` ``[T, HV]``: ``(G, G_last, exp(G_last - G))``,
    ``G`` ``[BT]``, ``G_last`` at the chunk's last token, and the decays ``[BT]`` of its tokens (0
    outside ``m_t``; the exponents, ``<= 0`` in the chunk, are masked to 0 before ``exp``)."""
    b_g = load_tokens(g_ptr, s_gt, s_gh, o_t, m_t, i_hv)  # [BT]
    b_g_last = tl.load(g_ptr + (eos - 1) * s_gt + i_hv * s_gh)
    b_d = tl.where(m_t, tl.exp(tl.where(m_t, b_g_last - b_g, 0.0)), 0.0)  # [BT]
    return b_g, b_g_last, b_d


@triton.jit
def causal_decay(b_a, b_g, o_i, m_t, TRANSPOSED: tl.constexpr):
    """``b_a`` ``[BT, BT]`` times ``Gamma_ij = exp(G_i - G_j)`` where ``j <= i`` and both tokens are in
    the chunk (``m_t``), 0 elsewhere; ``TRANSPOSED``: ``b_a`` is indexed ``[j, i]`` and times
    ``Gamma^T``. The mask is applied to the exponent before ``exp`` (only ``G_i - G_j <= 0`` is
    exponentiated) and to the product after it."""
    if TRANSPOSED:
        m_a = (o_i[:, None] <= o_i[None, :]) & m_t[:, None] & m_t[None, :]
        b_a = tl.where(m_a, b_a * tl.exp(tl.where(m_a, b_g[None, :] - b_g[:, None], 0.0)), 0.0)
    else:
        m_a = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
        b_a = tl.where(m_a, b_a * tl.exp(tl.where(m_a, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    return b_a


@triton.jit
def store_zero_tail(ptr, ci_ptr, NC, T, s_t, s_h, i_hv, o_v, o_i, BT: tl.constexpr, BV: tl.constexpr):
    """Zeros into ``ptr`` ``[T, HV, V]`` (head ``i_hv``, channels ``o_v``) for the tokens past the
    last chunk's end (past ``cu_seqlens[-1]``: in no chunk), ``BT`` at a time."""
    tail = tl.load(ci_ptr + (NC - 1).to(tl.int64) * 3 + 2, mask=NC > 0, other=0)  # last chunk's end
    b_zero = tl.zeros([BT, BV], dtype=ptr.dtype.element_ty)
    i_t = tail.to(tl.int64)
    while i_t < T:  # a while loop: runtime bounds, also in the interpreter
        o_t = i_t + o_i
        p = rows(ptr, s_t, s_h, o_t, i_hv, o_v)
        tl.store(p, b_zero, mask=(o_t < T)[:, None])
        i_t += BT


# ----------------------------------------------------------------------------- host helpers


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 inputs (TF32 is Triton's default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def emulate_bf16(dtype: torch.dtype) -> bool:
    """bf16 data in Triton's CPU interpreter: emulate the GPU's bf16 dots and rounding (`dot`, `round_to`)."""
    return dtype == torch.bfloat16 and interpreting()


class Stage(NamedTuple):
    """The constexprs the per-head stages' kernels share (state, output, state backward,
    dq/dk/dw/dg), passed as one kernel argument ``S`` (a tuple of ``tl.constexpr``: Triton
    specialises each field as a constexpr, so the kernel compiles as with eight arguments)."""

    HV: tl.constexpr  # value heads
    GROUP: tl.constexpr  # HV // H: value heads per qk head
    K: tl.constexpr
    V: tl.constexpr
    BT: tl.constexpr  # CHUNK
    USE_QK_L2NORM: tl.constexpr
    DOT_PRECISION: tl.constexpr  # `dot_precision`: "ieee" for fp32 inputs (no TF32); ignored by bf16/fp16 dots
    EMULATE_BF16: tl.constexpr  # `emulate_bf16`: bf16 data in the CPU interpreter only (see `dot`, `round_to`)


def stage(H: int, HV: int, K: int, V: int, dtype: torch.dtype, use_qk_l2norm: bool) -> Stage:
    """The `Stage` of a call with inputs of ``dtype``: the kernel argument ``S``."""
    values = (HV, HV // H, K, V, CHUNK, use_qk_l2norm, dot_precision(dtype), emulate_bf16(dtype))
    return Stage(*(tl.constexpr(v) for v in values))


def token_head_strides(*tensors: torch.Tensor) -> list[int]:
    """The token and head strides (dims 0 and 1) of each tensor, in order: a kernel's
    ``s_xt, s_xh`` arguments (for a ``[T, HV]`` tensor, both of its strides)."""
    return [s for t in tensors for s in (t.stride(0), t.stride(1))]


def value_block_programs(rows: int, HV: int, V: int, BV: int, table: str) -> int:
    """The programs of a `value_block_program` grid, ``rows * HV * (V // BV)``: rows of the chunk table
    (``table`` ``"chunk_indices"``) or documents (``"chunk_offsets"``), plus a tail row where the kernel
    has one. ValueError naming ``table`` from 2**31 programs on (a one-axis grid's limit)."""
    programs = rows * HV * (V // BV)
    if programs >= 2**31:
        what = {"chunk_indices": "chunks", "chunk_offsets": "sequences"}[table]
        raise ValueError(f"{table}: at most 2**31 - 1 programs ({what} x heads x value blocks), got {programs}")
    return programs


# ----------------------------------------------------------------------------- launch constants

HOPPER = "sm_90"  # compute capability below 10 (Hopper), the CPU interpreter and meta tensors included
BLACKWELL = "sm_100"  # compute capability 10 and above
FAMILIES = (HOPPER, BLACKWELL)
AOT_TAGS = {HOPPER: "", BLACKWELL: "_2w"}  # suffix of an AOT spec's name in each family's launch setting
_ASSUMED_FAMILY: contextvars.ContextVar[str | None] = contextvars.ContextVar("gdn_triton_family", default=None)


def launch_family(device: torch.device) -> str:
    """The GPU family whose launch constants serve ``device``: ``BLACKWELL`` on compute
    capability >= 10, ``HOPPER`` elsewhere (CPU and meta included), unless `assume_family` says."""
    assumed = _ASSUMED_FAMILY.get()
    if assumed is not None:
        return assumed
    family = gpu_family(device)  # "sm_90", "sm_100", ... or "cpu"
    return BLACKWELL if family.startswith("sm_") and int(family[3:-1]) >= 10 else HOPPER


@contextlib.contextmanager
def assume_family(family: str) -> Iterator[None]:
    """Within the block, `launch_family` answers ``family`` for every device (the AOT specs
    record each family's launch with meta tensors; tests run Blackwell's setting on the CPU)."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    token = _ASSUMED_FAMILY.set(family)
    try:
        yield
    finally:
        _ASSUMED_FAMILY.reset(token)


@dataclass(frozen=True)
class LaunchConfig:
    """Launch constants of one kernel on one GPU family (no autotuner).

    ``num_warps``; ``num_stages`` (None: not passed, Triton's default); ``maxnreg``, a register cap
    (None: none; the launcher says for which input dtypes); ``block_k``, ``block_v``, ``block_t``:
    key channels, value channels, tokens per program or per block, at most (a launcher takes
    ``min(block, dim)``); ``loop_stages``: software-pipelining depth of a chunk loop (a constexpr)."""

    num_warps: int
    num_stages: int | None = None
    maxnreg: int | None = None
    block_k: int | None = None
    block_v: int | None = None
    block_t: int | None = None
    loop_stages: int | None = None

    def options(self, *, cap_registers: bool = True) -> dict[str, int]:
        """The launch options: ``num_warps``, and ``num_stages`` and (with ``cap_registers``)
        ``maxnreg`` where set."""
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        if cap_registers and self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


def family_config(configs: Mapping[str, LaunchConfig], device: torch.device) -> LaunchConfig:
    """``configs[launch_family(device)]``: the launch constants of a kernel whose setting depends
    on the GPU family (``configs`` holds one per family of ``FAMILIES``)."""
    return configs[launch_family(device)]


def sequential_pass(configs: Mapping[str, LaunchConfig], device: torch.device, chunk_offsets: torch.Tensor,
                    V: int) -> tuple[int, int, dict[str, object]]:
    """A state pass's launch over the documents of ``chunk_offsets`` on ``device``: ``(N, BV, kwargs)``,
    the documents, the value channels per program (the family's ``block_v``, at most ``V``) and the
    launch keywords: the chunk loop as a software-pipelined for loop on the GPU (``PIPELINED``,
    ``NUM_STAGES_LOOP``; a while loop in the interpreter, which cannot take runtime bounds in a for
    loop) and the family's options."""
    config = family_config(configs, device)
    kwargs = {"PIPELINED": not interpreting(), "NUM_STAGES_LOOP": config.loop_stages, **config.options()}
    return chunk_offsets.shape[0] - 1, min(config.block_v, V), kwargs


# ----------------------------------------------------------------------------- AOT example tensors


def model_tensors() -> SimpleNamespace:
    """Meta tensors of the model's shapes, the arguments the stages record their ``AOT_SPECS``
    with: K = V = 128, H = 16, HV = 48 (group 3), bf16 inputs, T = 32768 tokens in one document
    (NC = 512 chunks of 64, N = 1).

    ``q``, ``k``, ``v``: head views of the packed row ``[T, (2H + HV) * 128]`` (token stride 10240,
    head stride 128); ``dq_row``, ``dk_row``: the same views of the packed gradient row. Dense:
    ``w``, ``u``, ``v_new``, ``o``, ``do``, ``dv_local``, ``dv``, ``dw`` bf16 ``[T, 48, 128]``; ``f32_hk`` and
    ``f32_hk2`` fp32 ``[T, 48, 128]``; ``beta``, ``dbeta`` bf16 and ``g``, ``g_cum``, ``dg``,
    ``dg_in`` fp32 ``[T, 48]`` (head stride 1); ``A`` fp32 ``[T, 48, 64]``; ``h``, ``dh`` bf16
    ``[NC, 48, 128, 128]``; ``state`` fp32 ``[N, 48, 128, 128]``; ``chunk_indices`` int32
    ``[NC, 3]``, ``chunk_offsets`` int32 ``[N + 1]``; ``segment_rows`` int32 ``[3, 2]`` (a split pass's
    rows, `dsfuse.gdn.split.pass_rows`: the type a compiled kernel sees; the document's 4 segments
    of `dsfuse.gdn.split.RULE` are not spelled out in ``chunk_offsets``); ``scale`` ``128 ** -0.5``."""
    T, H, HV, K = 32768, 16, 48, 128
    NC, N = T // CHUNK, 1
    bf16 = {"device": "meta", "dtype": torch.bfloat16}
    f32 = {"device": "meta", "dtype": torch.float32}
    row = torch.empty(T, 2 * H + HV, K, **bf16)
    grad_row = torch.empty(T, 2 * H + HV, K, **bf16)
    x = SimpleNamespace(q=row[:, :H], k=row[:, H:2 * H], v=row[:, 2 * H:],
                        dq_row=grad_row[:, :H], dk_row=grad_row[:, H:2 * H],
                        A=torch.empty(T, HV, CHUNK, **f32), state=torch.empty(N, HV, K, K, **f32),
                        chunk_indices=torch.empty(NC, 3, device="meta", dtype=torch.int32),
                        chunk_offsets=torch.empty(N + 1, device="meta", dtype=torch.int32),
                        segment_rows=torch.empty(3, 2, device="meta", dtype=torch.int32), scale=K**-0.5)
    for name in ("w", "u", "v_new", "o", "do", "dv_local", "dv", "dw"):
        setattr(x, name, torch.empty(T, HV, K, **bf16))
    for name in ("f32_hk", "f32_hk2"):
        setattr(x, name, torch.empty(T, HV, K, **f32))
    for name in ("beta", "dbeta"):
        setattr(x, name, torch.empty(T, HV, **bf16))
    for name in ("g", "g_cum", "dg", "dg_in"):
        setattr(x, name, torch.empty(T, HV, **f32))
    for name in ("h", "dh"):
        setattr(x, name, torch.empty(NC, HV, K, K, **bf16))
    return x


def record_variants(name: str, launch: Callable, arguments: Callable[[SimpleNamespace, torch.Tensor | None], tuple],
                    *, l2_tags: tuple[str, str] = ("_l2", ""), states: bool = False,
                    per_family: bool = False) -> list[AotSpec]:
    """The ``AOT_SPECS`` of a stage launcher at the model's shapes, one per variant: the in-kernel
    L2 norm on and off, and where asked, without and with the optional states (``states``), in each
    GPU family's launch setting (``per_family``, else Hopper's, which every family uses).

    ``arguments(x, state)`` gives the launcher's positional arguments from `model_tensors` ``x`` and
    ``state`` (None, or ``x.state`` for the with-states variant); ``use_qk_l2norm`` is passed by
    keyword. ``name`` is formatted with ``l2`` (``l2_tags[0]`` with the norm, ``l2_tags[1]``
    without), ``states`` (``"_states"`` or ``""``) and ``family`` (`AOT_TAGS`)."""
    x = model_tensors()
    specs = []
    for family in FAMILIES if per_family else (HOPPER,):
        for l2, l2_tag in zip((True, False), l2_tags):
            for state in (None, x.state) if states else (None,):
                label = name.format(l2=l2_tag, states="" if state is None else "_states", family=AOT_TAGS[family])
                with assume_family(family):
                    specs += record_specs(label, launch, *arguments(x, state), use_qk_l2norm=l2)
    return specs
