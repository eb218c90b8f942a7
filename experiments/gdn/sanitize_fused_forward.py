"""One small varlen call of the CuTe DSL fused forward (the UT inverse, then the fused kernel), for
compute-sanitizer: six documents (an empty and a one-token one among them, partial chunks), (H, HV) =
(2, 6), K = V = 64, bf16, L2 norm on, an initial state; the form named by ``--form`` (one of
``dsfuse.gdn.cutedsl.fused_fwd.FORMS``, default ``cuda_core``); with ``--gated`` (a per-head form), the
gating inverse and the kernel reading its gated ``A``, as `chunk_gdn` launches them; with
``--states`` (a prepared form), saving ``round(S)`` of every chunk for a backward. With ``--long``
instead: `chunk_gdn`'s step on the CuTe DSL backend (sm_90) over one document of 16,421 tokens (257
chunks, the last partial), (H, HV) = (1, 2), K = V = 128, so its chain runs in halves and in pieces
(`dsfuse.gdn.cutedsl.forward`: `column_parts`, `pieces`) and the fused backward reads the states the
halves saved; the chain launches are counted, so a run that took neither path fails.

    compute-sanitizer --tool memcheck --report-api-errors no python3 experiments/gdn/sanitize_fused_forward.py [--form head] [--gated] [--states]
    compute-sanitizer --tool racecheck python3 experiments/gdn/sanitize_fused_forward.py --long

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
    parser.add_argument("--long", action="store_true", help="one long document: halves and pieces, then the backward")
    args = parser.parse_args(argv)
    if args.long:
        return long_document()
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


def long_document() -> int:
    """`chunk_gdn`'s forward and backward over one document long enough for the pieces, its chain in
    halves (module docstring); the chain launches' parts are recorded and checked."""
    from dsfuse.gdn import chunk_gdn
    from dsfuse.gdn.cutedsl import forward, fused_fwd

    torch.manual_seed(0)
    t, h, hv, d = 16_421, 1, 2, 128
    q, k = torch.randn(1, t, h, d, device="cuda").bfloat16(), torch.randn(1, t, h, d, device="cuda").bfloat16()
    v = torch.randn(1, t, hv, d, device="cuda").bfloat16()
    g = -torch.rand(1, t, hv, device="cuda") * 0.3
    beta = torch.rand(1, t, hv, device="cuda").bfloat16()
    h0 = torch.randn(1, hv, d, d, device="cuda") * 0.1
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    launches, launch = [], fused_fwd._launch

    def counted(*args, **kwargs):  # the parts of each chain launch (as the halves' GPU test counts them)
        launches.append(args[19] if len(args) > 19 else kwargs.get("parts", 1))
        return launch(*args, **kwargs)

    fused_fwd._launch = counted
    o, ht = chunk_gdn(*inputs[:-1], initial_state=inputs[-1], output_final_state=True,
                      cu_seqlens=torch.tensor([0, t], dtype=torch.int32), use_qk_l2norm_in_kernel=True,
                      backend="cutedsl")
    torch.autograd.backward((o, ht), (torch.randn_like(o), torch.randn_like(ht)))
    torch.cuda.synchronize()
    want = len(forward.pieces(-(-t // 64))) - 1
    if launches != [2] * want:
        print(f"chain launches (their parts) {launches}, not {want} x 2: halves or pieces did not run")
        return 1
    print("ok long", want, "pieces in halves", float(o.detach().float().norm()), float(inputs[0].grad.float().norm()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
