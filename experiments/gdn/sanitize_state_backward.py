"""One small varlen call of the fused backward's reverse state chain (`dsfuse.gdn.cutedsl.state_bwd`,
after the preparing UT inverse it reads), for compute-sanitizer: six documents (an empty and a
one-token one among them, partial chunks), (H, HV) = (2, 6), K = V = 128, bf16, L2 norm on, a final
state's gradient; q and k as head views of one packed row.

    compute-sanitizer --tool memcheck --report-api-errors no python3 experiments/gdn/sanitize_state_backward.py
"""

from __future__ import annotations

import sys

import torch
from dsfuse.gdn.cutedsl.state_bwd import launch_state_backward
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse
from dsfuse.gdn.reference import prepare_chunk_indices, prepare_chunk_offsets
from dsfuse.gdn.schedule import document_order


def main() -> int:
    torch.manual_seed(0)
    cu = [0, 1, 63, 63, 127, 192, 392]
    t, h, hv, d = cu[-1] + 7, 2, 6, 128
    row = torch.randn(t, 2 * h * d + 8, device="cuda").bfloat16()  # q and k: head views of one packed row
    q, k = row[:, : h * d].view(t, h, d), row[:, h * d: 2 * h * d].view(t, h, d)
    do = torch.randn(t, hv, d, device="cuda").bfloat16()
    g = -torch.rand(t, hv, device="cuda") * 0.3
    beta = torch.rand(t, hv, device="cuda").bfloat16()
    dht = torch.randn(len(cu) - 1, hv, d, d, device="cuda") * 0.1
    ci = prepare_chunk_indices(cu).to(device="cuda", dtype=torch.int32).contiguous()
    co = prepare_chunk_offsets(cu).to(device="cuda", dtype=torch.int32).contiguous()
    order = torch.tensor(document_order(cu), device="cuda", dtype=torch.int32)
    a_round = torch.empty(t, hv, 64, device="cuda", dtype=q.dtype)
    factors = torch.empty(ci.shape[0] * len(FACTORS), hv, 64, device="cuda")
    launch_ut_inverse(k, beta, ci, None, use_qk_l2norm=True, g=g, g_cum=torch.empty_like(g), q=q, a_round=a_round,
                      factors=factors)
    dstates = torch.empty(ci.shape[0], d, hv, d, device="cuda", dtype=q.dtype)
    dh0 = torch.empty_like(dht)
    launch_state_backward(q, k, do, a_round, factors, ci, co, order, dht, dh0, dstates, d**-0.5, use_qk_l2norm=True)
    torch.cuda.synchronize()
    print("ok state_bwd", float(dstates.float().norm()), float(dh0.norm()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
