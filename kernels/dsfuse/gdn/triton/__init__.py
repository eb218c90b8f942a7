"""Triton kernels of the chunked Gated DeltaNet, one module per stage; ``TABLE``, the backend's table.

Every module holds its kernel(s), a launcher that writes into given outputs (no validation:
the public function did it) and ``AOT_SPECS`` for the model's specialisations
(``K = V = 128``, ``H = 16``, ``HV = 48``, bf16, chunk ``BT = 64``). Forward stages, in order:

* ``cumsum``: chunk-local cumulative gate ``g_cum`` (``launch_chunk_cumsum``);
* ``wy``: UT transform ``A = (I + L)^-1`` and WY representation ``w``, ``u`` (``launch_wy``);
* ``state``: sequential pass over chunks for the chunk states ``h`` and ``v_new``;
* ``output``: the chunk output ``o``.

Shared layout (packed tokens, documents by ``cu_seqlens``, each chunked from its own start):
``chunk_indices`` int32 ``[NC, 3]`` = (sequence, start token, end token); ``g_cum`` fp32
``[T, HV]``; ``A`` fp32 ``[T, HV, BT]`` (row ``i`` of a chunk's matrix at token
``start + i``); ``w`` ``[T, HV, K]`` and ``u`` ``[T, HV, V]`` in the input dtype.
Tokens in no chunk (past ``cu_seqlens[-1]``: the public function refuses such a ``cu_seqlens``,
the stages are tested with one) are left unwritten by ``cumsum`` and ``wy``; ``state`` and
``output`` write zeros there in ``v_new`` and ``o``.

``TABLE`` (what the registry reads): the dtypes, the head dims and layouts the stages serve, the
stage modules (each with ``AOT_SPECS``) and the stage tables of the schedule
(``dsfuse.gdn.schedule.ForwardStages`` / ``BackwardStages``) under the calls ``"forward"`` and
``"backward"``, and both under ``"stages"`` (the call of what needs the state pass on its own: the
long-document split's tests and context parallelism), built on first use (also as ``FORWARD`` and
``BACKWARD`` of this package).
"""

from __future__ import annotations

import torch

from dsfuse._common.backends import KERNEL_DTYPES, BackendTable

HEAD_DIMS = (16, 32, 64, 128)  # the head dims the Triton stages are written for
STAGE_MODULES = ("cumsum", "wy", "state", "output", "state_bwd", "dqkwg", "wy_bwd", "finalize")


def _reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = False) -> list[str]:
    """What the stages ask beyond the op's validation: a head dim they are written for, unit-stride
    channels of q, k and v, and beta in q's dtype."""
    reasons = []
    for name, dim in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if dim not in HEAD_DIMS:
            reasons.append(f"head dim {name} = {dim} is not one of {HEAD_DIMS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            reasons.append(f"{name} has channel stride {t.stride(-1)} (the kernels read unit-stride channels)")
    if beta.dtype != q.dtype:
        reasons.append("beta's dtype differs from q's")
    return reasons


def _load() -> dict:
    from dsfuse.gdn import schedule
    from dsfuse.gdn.triton import (
        cumsum,
        dqkwg,
        finalize,
        output,
        state,
        state_bwd,
        wy,
        wy_bwd,
    )

    forward = schedule.ForwardStages(cumsum=cumsum.launch_chunk_cumsum, wy=wy.launch_wy,
                                     state=state.launch_state_pass, output=output.launch_output)
    backward = schedule.BackwardStages(w_u=wy.launch_w_u, state=state.launch_state_pass,
                                       dv_local=state_bwd.launch_dv_local,
                                       state_backward=state_bwd.launch_state_backward,
                                       dqkwg=dqkwg.launch_dqkwg, wy_backward=wy_bwd.launch_wy_backward,
                                       finalize=finalize.launch_qk_finalize)
    return {"forward": forward, "backward": backward, "stages": schedule.StageTables(forward, backward)}


TABLE = BackendTable("triton", dtypes=KERNEL_DTYPES,
                     calls={"forward": _reasons, "backward": _reasons, "stages": _reasons},
                     kernels=tuple(f"dsfuse.gdn.triton.{m}" for m in STAGE_MODULES), load=_load)


def __getattr__(name: str):
    """``FORWARD`` / ``BACKWARD``: the stage tables (experiments time the stages one by one)."""
    if name in ("FORWARD", "BACKWARD"):
        return TABLE.launchers()[name.lower()]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
