"""Time the one-pass backward (experiments/engram_gate/onepass_backward.py) against the shipped one.

    python experiments/engram_gate/tune_onepass.py OUT.csv [N]

The experiment's gate inputs and the method of tune_blocks.py (N = 4096, D = 5120, S = 4, bf16, CUDA Graph replay,
L2 overwritten before each call); every setting is first checked against the float64 formula
from the same saved state. Modes: ``bwd-shipped`` (dsfuse's backward as it ships) and
``bwd-onepass-P<programs>`` (elements: channels per step; warps).
"""

import itertools
import sys

import torch
from onepass_backward import launch as launch_onepass

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, write_csv
from dsfuse.engram_gate import engram_gate_backward_from_saved
from dsfuse.engram_gate import triton as eg

x, kv, weight, mask, dout, eps = gate_inputs(int(sys.argv[2]) if len(sys.argv) > 2 else 4096, torch.device("cuda"))
n, streams, dim = x.shape
out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device="cuda")
eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=1e-6)
want = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device="cuda")
workspace = torch.empty(max(528 * streams * dim, eg.workspace_elements(n, streams, dim)), device="cuda")
timer = Timer(torch.device("cuda"), 256 << 20)
rows = []


def measure(mode, elements, warps, fn):
    us = checked_graph_samples(fn, (dx, dkv, dweight), want, timer, f"{mode} {elements} {warps}")
    rows.extend({"elements": elements, "warps": warps, "mode": mode, "regime": "evicted", "sample": i,
                 "us": round(u, 3)} for i, u in enumerate(us))


measure("bwd-shipped", eg.TILE_BLOCK_D, eg.TILE_WARPS,
        lambda: eg.launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=1e-6))
for programs, block_d, warps in itertools.product((264, 528), (1024, 2048), (8, 16)):
    measure(f"bwd-onepass-P{programs}", block_d, warps,
            lambda: launch_onepass(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=1e-6,
                                   programs=programs, block_d=block_d, warps=warps))
write_csv(sys.argv[1], rows)
import pandas as pd  # noqa: E402

print(pd.DataFrame(rows).groupby(["mode", "elements", "warps"])["us"].median().unstack("warps").round(1).to_string())
