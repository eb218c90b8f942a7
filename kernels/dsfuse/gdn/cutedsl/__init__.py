"""The CuTe DSL backend of the Gated DeltaNet, under construction: it serves no call yet.

``TABLE`` lists its kernel modules, so the CPU tests compile them for sm_90a and sm_100a (their
``AOT_SPECS``), and no call: `chunk_gdn` never reaches them, ``auto`` never picks them, and the
op's contract tests (which run on the backends that serve a call) do not run them. The modules:

* ``ut_inverse``: the ungated UT inverse ``(I + diag(beta) strictly_lower(k k^T))^-1`` of every
  chunk and value head (one CTA per chunk and qk head, ``k k^T`` once on tensor cores) (the first step of the fused forward planned on the GDN page); checked
  against the reference on a GPU by ``tests/gdn/test_gdn_cutedsl_ut_inverse.py``.
* ``fused_fwd``: the fused chunked forward, one CTA per (document, value head, value tile) walking
  its chunks with the fp32 state on chip, from ``ut_inverse``'s ``A`` (fp32 CUDA-core arithmetic:
  the reference-grade second step, before tensor cores and warp specialisation); checked by
  ``tests/gdn/test_gdn_cutedsl_fused_forward.py``, timed by ``experiments/gdn/fused_forward_probe.py``.
  Its ``form`` picks a later step: ``tensor_core`` (``fused_fwd_tc``: every product on ``mma.sync``
  through ``mma``, operands rounded to the input dtype) or ``head`` (``fused_fwd_head``: one CTA per
  document and value head with all value channels, the state and the products' results in
  registers).
* ``chunk``: what those kernels do to a chunk alike (loads, L2-norm scales, cumulative gate, gate
  vectors) and the fused forwards' signature and grid (``ChainKernel``).
* ``mma``: tensor-core products of shared-memory tiles (``mma.sync`` 16x8x16, fp32 accumulation,
  operands in any stored orientation), the building block of the fused forward's tensor-core form;
  checked by ``tests/gdn/test_gdn_cutedsl_mma.py``.
* ``wgmma``: warpgroup tensor-core products (sm_90a), operands read from 128-byte-swizzled shared
  tiles by descriptor, the building block of the per-head form's next step; compiled by
  ``tests/gdn/test_gdn_cutedsl_wgmma.py`` (its GPU test not yet run).
"""

from __future__ import annotations

from dsfuse._common.backends import KERNEL_DTYPES, BackendTable

KERNELS = ("dsfuse.gdn.cutedsl.ut_inverse", "dsfuse.gdn.cutedsl.fused_fwd", "dsfuse.gdn.cutedsl.mma",
           "dsfuse.gdn.cutedsl.wgmma")

TABLE = BackendTable("cutedsl", dtypes=KERNEL_DTYPES, calls={}, kernels=KERNELS, load=dict,
                     auto={"sm_90": None, "sm_100": None})
