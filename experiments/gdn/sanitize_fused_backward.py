"""One small varlen call of the CuTe DSL fused backward (`dsfuse.gdn.cutedsl.backward.fused_backward`:
the preparing UT inverse, the forward saving its states, the reverse state chain, the per-chunk
gradients, the finalising sum), for compute-sanitizer: six documents (an empty and a one-token one
among them, partial chunks) and 7 tokens in no document, (H, HV) = (2, 6), K = V = 128, bf16, L2
norm on, an initial state and a final state's gradient; q, k, v as head views of one packed row.

    compute-sanitizer --tool memcheck --report-api-errors no python3 experiments/gdn/sanitize_fused_backward.py
"""

from __future__ import annotations

import torch
from dsfuse.gdn.cutedsl.backward import fused_backward


def main() -> int:
    torch.manual_seed(0)
    cu = [0, 1, 63, 63, 127, 192, 392]
    t, h, hv, d = cu[-1] + 7, 2, 6, 128
    row = torch.randn(t, (2 * h + hv) * d, device="cuda").bfloat16()  # q, k, v: head views of one packed row
    q, k, v = row[:, : h * d].view(t, h, d), row[:, h * d: 2 * h * d].view(t, h, d), row[:, 2 * h * d:].view(t, hv, d)
    do = torch.randn(t, hv, d, device="cuda").bfloat16()
    g = -torch.rand(t, hv, device="cuda") * 0.3
    beta = torch.rand(t, hv, device="cuda").bfloat16()
    h0, dht = (torch.randn(len(cu) - 1, hv, d, d, device="cuda") * 0.1 for _ in range(2))
    out = fused_backward(q, k, v, g, beta, do, initial_state=h0, dht=dht, cu_seqlens=cu, use_qk_l2norm=True)
    torch.cuda.synchronize()
    print("ok fused backward", {name: round(float(x.float().norm()), 3) for name, x in out.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
