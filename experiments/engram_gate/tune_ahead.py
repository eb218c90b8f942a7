"""Time the one-launch backward with coefficient programs running ahead (ahead_backward.py).

    python experiments/engram_gate/tune_ahead.py OUT.csv

Against the shipped two-kernel backward in the same run, with the method of tune_blocks.py
(N = 4096, D = 5120, S = 4, bf16, CUDA Graph replay, L2 overwritten before each call; each
setting checked first against the float64 formula from the same saved state). Modes
``bwd-*`` time the backward alone, ``fwd+bwd-*`` the forward and the backward back to back.
"""

import itertools
import sys

import ahead_backward as ahead
import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, write_csv
from dsfuse.engram_gate import engram_gate_backward_from_saved
from dsfuse.engram_gate import triton as eg

x, kv, weight, mask, dout, eps = gate_inputs(4096, torch.device("cuda"))
n, streams, dim = x.shape
out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device="cuda")
eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=1e-6)
want = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device="cuda")
workspace = torch.empty(max(ahead.workspace_elements(n, streams, dim), eg.workspace_elements(n, streams, dim)),
                        device="cuda")
timer = Timer(torch.device("cuda"), 256 << 20)
rows = []


def measure(mode, setting, bwd):
    for what, fn in (("bwd", bwd), ("fwd+bwd", lambda: (eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps,
                                                                               clamp=1e-6), bwd()))):
        us = checked_graph_samples(fn, (dx, dkv, dweight), want, timer, f"{what}-{mode} {setting}")
        rows.extend({"mode": f"{what}-{mode}", "setting": setting, "sample": i, "us": round(u, 3)}
                    for i, u in enumerate(us))
        print(f"{what}-{mode} {setting}: {sorted(us)[len(us) // 2]:.1f} us", flush=True)


eg.FWD_WARPS = 2
measure("shipped", "two-kernel",
        lambda: eg.launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=1e-6))
for programs, coef_d, groups, warps in itertools.product((66, 132, 198, 264), (512, 1024), (16, 32), (4, 8)):
    ahead.COEF_PROGRAMS, ahead.COEF_BLOCK_D, ahead.GROUPS, ahead.WARPS = programs, coef_d, groups, warps
    measure("ahead", f"P{programs}-coef{coef_d}-groups{groups}-warps{warps}",
            lambda: ahead.launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=1e-6))
write_csv(sys.argv[1], rows)
