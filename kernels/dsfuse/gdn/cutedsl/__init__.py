"""The CuTe DSL backend of the Gated DeltaNet: the fused forward on Hopper, and the fused backward where
the forward ran ``head_rs`` (the Triton stages' backward elsewhere).

``TABLE`` serves two calls of `chunk_gdn`:

* ``forward``: `dsfuse.gdn.cutedsl.forward.FusedForward`, the gating UT inverse (which also writes
  the chunk-local cumulative gate and the gated ``A`` the backward reads) and the fused per-head
  kernel (``head_rs`` on sm_90a at V = 128, ``head_ws`` at other V) that reads them; ``auto`` takes it first on Hopper (sm_90) where the ``cutedsl`` extra is
  installed and the call is one it serves (`dsfuse.gdn.cutedsl.forward.reasons`: an sm_90a or
  sm_100a GPU, K and V of 64 or 128, bf16, or fp16 without the L2 norm, beta in q's dtype, rows
  16-byte aligned), else Triton; on Blackwell it serves only calls that name it (``head`` form,
  not measured there);
* ``backward``: `dsfuse.gdn.cutedsl.backward.FusedBackward`: where the saving forward ran ``head_rs``
  at K = 128 (`dsfuse.gdn.cutedsl.backward.serves`: sm_90a, K = V = 128, bf16 or fp16, at most 8
  value heads per qk head), the fused backward from what it kept (``round(A Gamma)``, the rows'
  factors, ``round(S)`` of every chunk): the reverse state chain, then the per-chunk gradients with
  the value heads' sum and the L2 norm's backward; elsewhere the Triton stages
  (`dsfuse.gdn.triton`) from the fp32 ``A`` the forward kept for them.

It does not serve ``stages`` (the state-pass split of long documents and context parallelism's
passes): a ``cp_group`` call under ``auto`` runs the Triton stages. Kernel modules (``KERNELS``,
compiled for sm_90a and sm_100a by the CPU tests through their ``AOT_SPECS``):

* ``ut_inverse``: the ungated UT inverse ``(I + diag(beta) strictly_lower(k k^T))^-1`` of every
  chunk and value head (one CTA per chunk and qk head, ``k k^T`` once on tensor cores), or in its
  gating form that inverse times ``Gamma`` with the cumulative gate; checked
  against the reference on a GPU by ``tests/gdn/test_gdn_cutedsl_ut_inverse.py``.
* ``fused_fwd``: the fused chunked forward from ``ut_inverse``'s ``A0`` (or its gated ``A``), in the ``FORMS`` of the
  plan's green steps: ``cuda_core`` (fp32, the reference-grade kernel the others are checked
  against), ``tensor_core`` (``fused_fwd_tc``: products on ``mma.sync``), ``head`` and ``head_wgmma``
  (``fused_fwd_head``: one CTA per document and value head, the state and the products' results in
  registers; on ``mma.sync`` or on wgmma), ``head_ws`` (``fused_fwd_ws``: the same with its warps
  split into a state team and an output team meeting at named barriers), ``head_rs`` (``fused_fwd_rs``:
  ``head_ws`` with the state kept transposed, every product of its chain taking A from registers,
  V = 128); checked by ``tests/gdn/test_gdn_cutedsl_fused_forward.py``,
  timed by ``experiments/gdn/fused_forward_probe.py``.
* ``state_bwd``: the fused backward's reverse state chain (kernel 2 of
  ``experiments/gdn/notes/fused-backward-design.md``): ``round(dS')``
  of every chunk and ``dh0`` from the preparing inverse's ``round(A Gamma)`` and factors, ``dO`` and
  the final state's gradient, sm_90a; checked against the design's float64 chain by
  ``tests/gdn/test_gdn_cutedsl_state_backward.py``.
* ``chunk_bwd``: the fused backward's per-chunk gradients (kernel 3 of the same note): dv, dg, dbeta,
  and dq, dk summed over a qk head's value heads by a cluster of their CTAs (distributed shared
  memory, head order) with the L2 norm's backward, from the forward's saved states and the chain's
  ``round(dS')``, one CTA per chunk and value head, sm_90a; ``backward.fused_backward`` strings the
  forward and the two backward kernels together, checked against the float64 reference by
  ``tests/gdn/test_gdn_cutedsl_chunk_backward.py``.
* ``chunk``: what those kernels do to a chunk alike (loads, L2-norm scales, cumulative gate, gate
  vectors) and the fused forwards' signature and grid (``ChainKernel``).
* ``mma`` and ``wgmma``: tensor-core products of shared-memory tiles (``mma.sync`` 16x8x16; sm_90a
  warpgroup products reading 128-byte-swizzled tiles by descriptor), fp32 accumulation; checked by
  ``tests/gdn/test_gdn_cutedsl_mma.py`` and ``tests/gdn/test_gdn_cutedsl_wgmma.py``.
* ``forward``: the ``forward`` call (above).
"""

from __future__ import annotations

import collections
import threading

import torch

from dsfuse._common.backends import BackendTable

KERNELS = ("dsfuse.gdn.cutedsl.ut_inverse", "dsfuse.gdn.cutedsl.fused_fwd", "dsfuse.gdn.cutedsl.state_bwd",
           "dsfuse.gdn.cutedsl.chunk_bwd", "dsfuse.gdn.cutedsl.mma", "dsfuse.gdn.cutedsl.wgmma")


_REASONS: collections.OrderedDict = collections.OrderedDict()  # the last calls' arguments -> their reasons
_REASONS_KEPT = 8
_REASONS_LOCK = threading.Lock()


def _key(x):
    """What `forward.reasons` reads of an argument: a tensor's shape, strides, dtype, device and address."""
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype, x.device, x.data_ptr()
    return x


def _forward_reasons(*args) -> list[str]:
    """`dsfuse.gdn.cutedsl.forward.reasons`, remembered for the last few argument lists: an eager call
    asks twice (``auto``'s choice, then the declared op's run-time check) with the same tensors, and
    the reasons are a function of what `_key` reads alone."""
    key = tuple(map(_key, args))
    with _REASONS_LOCK:
        found = _REASONS.get(key)
        if found is not None:
            _REASONS.move_to_end(key)
            return list(found)
    from dsfuse.gdn.cutedsl import forward

    found = tuple(forward.reasons(*args))
    with _REASONS_LOCK:
        _REASONS[key] = found
        if len(_REASONS) > _REASONS_KEPT:
            _REASONS.popitem(last=False)
    return list(found)


def _backward_reasons(*args) -> list[str]:
    from dsfuse.gdn import triton

    return triton.TABLE.calls["backward"](*args)


def _load() -> dict:
    from dsfuse.gdn import triton
    from dsfuse.gdn.cutedsl import backward, forward

    return {"forward": forward.FusedForward(), "backward": backward.FusedBackward(triton.TABLE.launchers()["backward"])}


TABLE = BackendTable("cutedsl", dtypes=(torch.bfloat16, torch.float16),
                     calls={"forward": _forward_reasons, "backward": _backward_reasons}, kernels=KERNELS,
                     load=_load, auto={"sm_90": 0, "sm_100": None})
