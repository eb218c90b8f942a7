"""Public API of Gated DeltaNet: [`chunk_gdn`][dsfuse.gdn.chunk_gdn].

Keyword-compatible with flash-linear-attention's ``chunk_gated_delta_rule``. A fused backend runs
the chunked forward and backward from its tables (``dsfuse.gdn.schedule``: stage kernels, or a
fused forward with the same outputs), reached through the registry (``BACKENDS``: the packages
under ``dsfuse.gdn``; context parallelism asks for a backend that serves the ``stages`` call), declared
(``dsfuse._common.declare_backend_ops``) as ``dsfuse::gdn_fwd`` and ``dsfuse::gdn_bwd`` (the first
backend's; another backend's carry its name as a suffix): one opaque node each under
``torch.compile``, an ``autograd.Function`` eagerly. The forward keeps ``g_cum`` and
``A`` for the backward, which recomputes ``w``, ``u``, ``h`` and ``v_new`` (the Triton stages), or,
on the ``cutedsl`` backend where its fused backward serves the call, what that backward reads in
``A``'s place (``dsfuse.gdn.cutedsl.backward.saved_views``).
"""

from __future__ import annotations

import torch
import torch.distributed

from dsfuse._common import (
    FLOAT_DTYPES, REFERENCE, check_contiguous, check_dtype, check_same_device, check_same_dtype, check_shape,
    check_tensor, declare_backend_ops, register, tracing,
)
from dsfuse.gdn import cp, cp_local, schedule
from dsfuse.gdn.packed import packed_grad_row
from dsfuse.gdn.reference import CHUNK_SIZE, chunk_gdn_reference

__all__ = ["chunk_gdn"]

BACKENDS = register("gdn")  # the backend packages' tables: dtypes, reasons, stage tables


def _document_bounds(cu_seqlens, batch: int, tokens: int) -> list[int]:
    """``cu_seqlens``: int32/int64 ``[N + 1]``, non-decreasing from 0 to ``T``, with ``B = 1``."""
    _check_cu_seqlens_shape(cu_seqlens, batch)
    bounds = cu_seqlens.tolist()  # one device-to-host copy for a CUDA tensor
    if bounds[0] != 0 or bounds[-1] != tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {tokens}, got {bounds}")
    return bounds


def _check_cu_seqlens_shape(cu_seqlens, batch: int) -> None:
    check_tensor("cu_seqlens", cu_seqlens)
    check_dtype("cu_seqlens", cu_seqlens, (torch.int32, torch.int64))
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: documents are packed in one row, expected B = 1, got B = {batch}")


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
    if cu_seqlens is None:
        bounds, num_seqs = None, batch
    elif tracing(cu_seqlens):  # no values while torch.compile traces: the op checks them when it runs
        _check_cu_seqlens_shape(cu_seqlens, batch)
        bounds, num_seqs = None, cu_seqlens.shape[0] - 1
    else:
        bounds = _document_bounds(cu_seqlens, batch, tokens)
        num_seqs = len(bounds) - 1
    if initial_state is not None:
        check_dtype("initial_state", initial_state, (torch.float32,))
        check_shape("initial_state", initial_state, (num_seqs, heads_v, dim_k, v.shape[3]), "[N, HV, K, V]")
        check_contiguous("initial_state", initial_state, "[N, HV, K, V]")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale: expected a float > 0 or None (K ** -0.5), got {scale!r}")
    return bounds


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
    cp_group: torch.distributed.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet, chunked: the output ``o`` and the final state (None unless asked for).

    Keyword-compatible with flash-linear-attention's ``chunk_gated_delta_rule``. Gradients reach
    ``q``, ``k``, ``v``, ``g``, ``beta`` and ``initial_state`` (through ``o`` and the final state),
    deterministic (fixed reduction orders, no atomics). When ``q``, ``k``, ``v`` are head views of
    one packed row ([`packed_qkv_views`][dsfuse.gdn.packed_qkv_views], or plain split views of such
    a row), the backward writes ``dq``, ``dk``, ``dv`` into one packed gradient row.

    A fused backend runs the forward and the backward from its tables (``dsfuse.gdn.schedule``:
    stage kernels, or a fused forward with the same outputs), declared as the ops
    ``dsfuse::gdn_fwd`` and ``dsfuse::gdn_bwd``: one opaque node each under ``torch.compile``, an
    ``autograd.Function`` eagerly. The forward keeps the chunk-local cumulative gate and ``A`` for
    the backward, which recomputes ``w``, ``u``, ``h`` and ``v_new``; the ``cutedsl`` backend's
    forward on Hopper at K = V = 128 keeps instead what its fused backward reads (the rounded gated
    ``A``, the rows' factors and the rounded state at every chunk's start).

    Long documents: the Triton stages cut a document of more than 16,384 tokens (256 chunks) into
    segments of 8,192 tokens, run the segments' state passes side by side and merge their state
    maps in fp64 in a fixed order (`dsfuse.gdn.split.RULE`, forward and backward). The rule reads
    the documents' lengths alone, so a call gives the same bits on every GPU of a family and with or
    without autograd; a split document's outputs differ from an unsplit pass in their last bits
    (within the contract), and the documents left whole keep the bits they have in any other call.
    The ``cutedsl`` forward and its fused backward do not split: each document is one chain (where
    the fused backward does not serve, the Triton backward that runs instead splits by the rule).
    Where the forward's ``head_rs`` kernel serves (sm_90a, V = 128), twice its chains (value heads
    x documents) fit the SMs at once and its overlap plans no lead stage
    (``dsfuse.gdn.cutedsl.forward.chain_parts``), it walks each chain on two CTAs of 64 value
    channels; the chain of a sole document of 256 chunks or more runs in pieces, each launched once
    the inverse has made its chunks. Both give the same bits as one whole chain.

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
            non-decreasing from 0 to ``T``, on any device; read on the host once per call (a
            CUDA tensor costs one device-to-host copy). Each new document layout's chunk table
            is copied to the GPU once and cached, so a call can be captured in a CUDA Graph when
            ``cu_seqlens`` is a CPU tensor (or absent) and the same layout was called before.
        use_qk_l2norm_in_kernel: normalise q and k over the head dim first
            (``x * rsqrt(sum(x^2) + 1e-6)``).
        backend: ``"auto"``, ``"triton"``, ``"cutedsl"`` or ``"reference"``. ``auto`` takes the CuTe
            DSL forward on Hopper where it serves the call (its backward the fused CuTe DSL one at
            K = V = 128, the Triton stages' elsewhere),
            the Triton stages elsewhere on a GPU, the reference on the CPU; with ``cp_group``,
            the Triton stages (the backend that serves context parallelism's passes). Under
            ``torch.compile`` ``auto`` does not take the CuTe DSL forward (its reasons need data
            addresses), so a compiled and an eager call on Hopper may differ in their last bits
            (both within the contract); name the backend for the same kernels in both.
        cp_group: a ``torch.distributed`` process group for context parallelism, or None. With a
            group, ``cu_seqlens`` (required, ``B = 1``) are the *global* document offsets of a row
            of ``T`` tokens, the same on every rank, and ``q``, ``k``, ``v``, ``g``, ``beta`` hold
            this rank's share of it, tokens ``shard.start:shard.end`` of
            [`cp_shards`][dsfuse.gdn.cp_shards] (``floor(r T / W)`` to ``floor((r + 1) T / W)``);
            ``initial_state`` (if any) is the global ``[N, HV, K, V]`` on every rank, and the final
            state is returned whole on every rank. Gradients are those of the sum of every rank's
            loss: each rank gets its share's ``dq``, ``dk``, ``dv``, ``dg``, ``dbeta``, and
            ``initial_state``'s gradient in the rows of the documents that start in its share
            (zeros elsewhere: sum it over the ranks). Every rank must make the same call (same
            ``cu_seqlens``, flags and shapes but ``T``). Eager only (not under ``torch.compile``);
            deterministic for a given world size (``dsfuse.gdn.cp``).

    Returns:
        o: ``[B, T, HV, V]``, the dtype of ``v``.
        final_state: ``[N, HV, K, V]`` fp32 (fp64 for fp64 inputs) when ``output_final_state``, else
            None.
    """
    if cp_group is not None:
        return _chunk_gdn_cp(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                             use_qk_l2norm_in_kernel, backend, cp_group)
    bounds = _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    which, scale = _choose(backend, "forward", q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)
    if which == REFERENCE:
        compute = torch.float64 if v.dtype == torch.float64 else torch.float32
        return chunk_gdn_reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                   use_qk_l2norm_in_kernel, compute_dtype=compute)
    if bounds is not None:  # validated on the host: the op reads this copy (no second device read)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int64)
    # whether the backward will run: a forward without it need not keep A (the same o and final state)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, g, beta, initial_state))
    o, final_state, _, _ = forward_ops[which](q, k, v, g, beta, initial_state, cu_seqlens, float(scale),
                                              output_final_state, use_qk_l2norm_in_kernel, save)
    return o, final_state if output_final_state else None


def _choose(backend, call, q, k, v, g, beta, initial_state, scale, use_qk_l2norm) -> tuple[str, float]:
    """The backend that serves ``call`` (``"forward"``; ``"stages"`` for context parallelism), and the
    scale (default ``K ** -0.5``)."""
    which = BACKENDS.choose(backend, v.device, v.dtype, call=call,
                            args=(q, k, v, g, beta, initial_state, use_qk_l2norm))
    return which, q.shape[-1] ** -0.5 if scale is None else scale


def _chunk_gdn_cp(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                  backend, group):
    """`chunk_gdn` over the ranks of ``group`` (validation, then ``dsfuse.gdn.cp.chunk_gdn_cp``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("cp_group: torch.distributed is not initialised (call init_process_group first)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"cp_group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    if tracing(q, k, v, g, beta):
        raise RuntimeError("cp_group: context parallelism runs eagerly; call chunk_gdn outside torch.compile "
                           "(or mark the call with torch.compiler.disable)")
    if cu_seqlens is None:
        raise ValueError("cp_group: cu_seqlens (the global document offsets) is required with context parallelism")
    if q.ndim == 4 and q.shape[0] != 1:
        raise ValueError(f"cp_group: documents are packed in one row, expected B = 1, got B = {q.shape[0]}")
    if dist.get_rank(group) < 0:
        raise ValueError("cp_group: this process is not a member of the group")
    shards = cp.cp_shards(cu_seqlens, dist.get_world_size(group))
    me = shards[dist.get_rank(group)]
    if q.ndim == 4 and q.shape[1] != me.tokens:
        raise ValueError(f"cp_group: rank {me.rank} of {me.world_size} holds tokens {me.start}:{me.end} of the "
                         f"T = {shards[-1].end} in cu_seqlens ({me.tokens} tokens; see dsfuse.gdn.cp_shards), "
                         f"got q with T = {q.shape[1]}")
    _validate(q, k, v, g, beta, scale, None, me.cu_seqlens)
    num_docs = cu_seqlens.numel() - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        check_same_device(q=q, initial_state=initial_state)
        check_dtype("initial_state", initial_state, (torch.float32,))
        check_shape("initial_state", initial_state, (num_docs, v.shape[2], k.shape[3], v.shape[3]),
                    "[N, HV, K, V] for the N documents of the global cu_seqlens")
        check_contiguous("initial_state", initial_state, "[N, HV, K, V]")
    which, scale = _choose(backend, "stages", q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    if which == REFERENCE:
        compute = torch.float64 if v.dtype == torch.float64 else torch.float32
        passes = cp_local.reference_passes(float(scale), use_qk_l2norm, compute)
    else:
        stages = BACKENDS.load(which)["stages"]
        passes = cp_local.fused_passes(stages.forward, stages.backward, float(scale), use_qk_l2norm)
    o, final_state = cp.chunk_gdn_cp(q, k, v, g, beta, initial_state, output_final_state, passes, shards, group)
    return o, final_state


# -- declared ops ---------------------------------------------------------------------------------------


def _bounds(cu_seqlens: torch.Tensor | None, batch: int, tokens: int) -> list[int] | None:
    """The document bounds inside an op (a host copy when the API validated them; checked here
    when the op runs after torch.compile traced it without values)."""
    return None if cu_seqlens is None else _document_bounds(cu_seqlens, batch, tokens)


def _forward(backend: str):
    def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
                 output_final_state: bool, use_qk_l2norm: bool, save: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(o, final_state or an empty tensor, g_cum, A)`` of validated inputs (``A`` may be empty
        without ``save``: `dsfuse.gdn.schedule.stage_calls`)."""
        BACKENDS.check_at_run_time(backend, "forward", (q, k, v, g, beta, initial_state, use_qk_l2norm))
        out = schedule.forward(BACKENDS.load(backend)["forward"], q, k, v, g, beta, scale=scale,
                               initial_state=initial_state, output_final_state=output_final_state,
                               cu_seqlens=_bounds(cu_seqlens, *q.shape[:2]), use_qk_l2norm=use_qk_l2norm, save=save)
        final_state = out.final_state if out.final_state is not None else v.new_empty(0, dtype=torch.float32)
        return out.o, final_state, out.g_cum, out.A

    def _forward_grad(ctx, do, dht, *_):
        """``q``, ``k``, ``v``, ``g``, ``beta`` and ``initial_state`` get gradients; ``o``'s and the
        final state's gradients come in (``g_cum`` and ``A`` are internal)."""
        q, k, v, beta, initial_state, cu_seqlens, g_cum, A = ctx.saved_tensors
        if do is None:  # o unused (`_save`: no zeros made for an absent gradient)
            do = torch.zeros_like(v, memory_format=torch.contiguous_format)
        if dht is not None and dht.numel() == 0:
            dht = None
        if tracing(q, do):
            dq, dk, dv, dg, dbeta, dh0 = backward_ops[backend](q, k, v, beta, g_cum, A, do, dht, initial_state,
                                                               cu_seqlens, ctx.scale, ctx.use_qk_l2norm)
        else:
            dq, dk, dv, dg, dbeta, dh0 = _run_backward(backend, q, k, v, beta, g_cum, A, do, dht, initial_state,
                                                       cu_seqlens, ctx.scale, ctx.use_qk_l2norm, packed=True)
        return dq, dk, dv, dg, dbeta, dh0 if initial_state is not None else None

    def _fake(*args):
        return _forward_fake(backend, *args)

    return _forward, {"backward": _forward_grad, "fake": _fake}


def _forward_fake(backend, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm,
                  save):
    batch, tokens, heads_v, dim_v = v.shape
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state_shape = (num_seqs, heads_v, k.shape[-1], dim_v) if output_final_state else (0,)
    rows = batch * tokens if save else 0  # A for the Triton stages' backward
    if save and backend == "cutedsl":  # what its fused backward reads, where it serves the call
        from dsfuse.gdn.cutedsl import backward as fused

        if fused.serves(v.device, k.shape[-2], heads_v, k.shape[-1], dim_v, v.dtype):
            rows = fused.saved_rows(batch * tokens, num_seqs, k.shape[-1], dim_v)
    return (v.new_empty(v.shape), v.new_empty(state_shape, dtype=torch.float32),
            v.new_empty((batch * tokens, heads_v), dtype=torch.float32),
            v.new_empty((rows, heads_v, CHUNK_SIZE), dtype=torch.float32))


def _run_backward(backend, q, k, v, beta, g_cum, A, do, dht, initial_state, cu_seqlens, scale, use_qk_l2norm,
                  packed: bool) -> schedule.Gradients:
    """``backend``'s backward stages; ``packed``: write ``dq``, ``dk``, ``dv`` into one gradient row
    when ``q``, ``k``, ``v`` are head views of one packed row (eager only: a custom op's outputs may
    not alias each other)."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    if dht is not None:
        dht = dht.contiguous() if dht.numel() else None
    views = packed_grad_row(q, k, v) if packed else None
    dq, dk, dv = (None, None, None) if views is None else views[1:]
    return schedule.backward(BACKENDS.load(backend)["backward"], q, k, v, beta, g_cum, A, do, dht, scale=scale,
                             initial_state=initial_state, cu_seqlens=_bounds(cu_seqlens, *q.shape[:2]),
                             use_qk_l2norm=use_qk_l2norm, dq=dq, dk=dk, dv=dv)


def _backward(backend: str):
    def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor,
                  A: torch.Tensor, do: torch.Tensor, dht: torch.Tensor | None, initial_state: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv, dg, dbeta, dh0 or an empty tensor)`` in new tensors."""
        grads = _run_backward(backend, q, k, v, beta, g_cum, A, do, dht, initial_state, cu_seqlens, scale,
                              use_qk_l2norm, packed=False)
        dh0 = grads.dh0 if grads.dh0 is not None else v.new_empty(0, dtype=torch.float32)
        return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, dh0

    return _backward


def _backward_fake(q, k, v, beta, g_cum, A, do, dht, initial_state, cu_seqlens, scale, use_qk_l2norm):
    f32 = torch.float32
    dh0 = initial_state.new_empty(initial_state.shape) if initial_state is not None else v.new_empty(0, dtype=f32)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), v.new_empty(beta.shape, dtype=f32),
            beta.new_empty(beta.shape), dh0)


backward_ops = declare_backend_ops(BACKENDS, "gdn_bwd", "backward", _backward, fake=_backward_fake)


def _save(ctx, inputs, output):
    q, k, v, _, beta, initial_state, cu_seqlens, scale, _, use_qk_l2norm, _ = inputs
    ctx.save_for_backward(q, k, v, beta, initial_state, cu_seqlens, output[2], output[3])
    ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
    # g_cum and A never get a gradient: without this, autograd would hand the backward zeros the size of
    # A (a gigabyte at the experiment's shape, the fused backward's saved buffer) and of g_cum
    ctx.set_materialize_grads(False)


forward_ops = declare_backend_ops(BACKENDS, "gdn_fwd", "forward", _forward, setup=_save, non_differentiable=(2, 3))
