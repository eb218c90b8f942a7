"""One small varlen call of the CuTe DSL fused forward (the UT inverse, then the fused kernel), for
compute-sanitizer: six documents (an empty and a one-token one among them, partial chunks), (H, HV) =
(2, 6), K = V = 64, bf16, L2 norm on, an initial state; the form named by ``--form`` (one of
``dsfuse.gdn.cutedsl.fused_fwd.FORMS``, default ``cuda_core``); with ``--gated`` (a per-head form), the
gating inverse and the kernel reading its gated ``A``, as `chunk_gdn` launches them; with
``--states`` (a prepared form), saving ``round(S)`` of every chunk for a backward.

    compute-sanitizer --tool memcheck --report-api-errors no python3 experiments/gdn/sanitize_fused_forward.py [--form head] [--gated] [--states]

(``--report-api-errors no``: the runtime's probes of driver entry points are not kernel errors.)
"""

from __future__ import annotations

import argparse
import sys

import torch
from dsfuse.gdn.cutedsl.fused_fwd import FORMS, fused_forward


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", choices=FORMS, default="cuda_core")
    parser.add_argument("--gated", action="store_true", help="the gating inverse and gated launch (per-head forms)")
    parser.add_argument("--states", action="store_true", help="save the states (the prepared forms)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cu = [0, 1, 63, 63, 127, 192, 392]
    t, h, hv, d = cu[-1] + 7, 2, 6, 64
    q, k = torch.randn(t, h, d, device="cuda").bfloat16(), torch.randn(t, h, d, device="cuda").bfloat16()
    dv = 128 if args.form == "head_rs" else d  # head_rs: two warpgroups of 64 value channels
    v = torch.randn(t, hv, dv, device="cuda").bfloat16()
    g = -torch.rand(t, hv, device="cuda") * 0.3
    beta = torch.rand(t, hv, device="cuda").bfloat16()
    h0 = torch.randn(len(cu) - 1, hv, d, dv, device="cuda") * 0.1
    states = None
    if args.states:
        from dsfuse.gdn.reference import prepare_chunk_indices

        states = torch.empty(prepare_chunk_indices(cu).shape[0], d, hv, dv, device="cuda", dtype=v.dtype)
    o, ht, _ = fused_forward(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True,
                             form=args.form, gated=args.gated, states=states)
    torch.cuda.synchronize()
    print("ok", args.form, "gated" if args.gated else "", float(o.float().norm()), float(ht.norm()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
