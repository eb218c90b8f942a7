"""Sweep the Engram gate kernels' launch constants at the model's width.

    python experiments/engram_gate/tune_blocks.py OUT.csv [N]

Forward: warps per row program. Backward: channels per step and warps of
the coefficient kernel; token groups (dWeight partials), channels per program and
warps of the tile kernel (the whole backward is timed). Each setting is checked
once (relative RMS error <= 2^-8 on every output; forward against the fp32 model,
backward against the float64 formula from the same saved state), then timed by CUDA Graph replay with the L2
overwritten before each call (N = 4096 unless given, D = 5120, S = 4, bf16).
One CSV row per sample; the constants in dsfuse/engram_gate/triton.py come from here.
"""

import itertools
import sys

import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, capture_graph, write_csv
from dsfuse.engram_gate import engram_gate_backward_from_saved, engram_gate_reference
from dsfuse.engram_gate import triton as eg

x, kv, weight, mask, dout, eps = gate_inputs(int(sys.argv[2]) if len(sys.argv) > 2 else 4096, torch.device("cuda"))
n, streams, dim = x.shape
clamp = 1e-6
want_out, want_saved = engram_gate_reference(x, kv, weight, mask, eps=eps)
out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device="cuda")
dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device="cuda")
eg.GROUPS = 128  # the largest group count swept: the workspace fits every setting
workspace = torch.empty(eg.workspace_elements(n, streams, dim), device="cuda")
timer = Timer(torch.device("cuda"), 256 << 20)
rows = []


def check(got, want, what):
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    if not err <= 2**-8:
        raise AssertionError(f"{what}: relative RMS error {err:.2e}")


def fwd():
    eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=clamp)


def bwd():
    eg.launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=clamp)


def measure(mode, elements, warps, fn, outputs, wants):
    for t in outputs:
        t.fill_(float("nan"))
    fn()
    for t, w, name in zip(outputs, wants, ("a", "b", "c")):
        check(t, w, f"{mode} {elements} {warps} output {name}")
    graph, _ = capture_graph(lambda: (fn(),), torch.device("cuda"))
    for i, us in enumerate(timer.samples(graph.replay, "evicted", 20, 10)):
        rows.append(dict(elements=elements, warps=warps, mode=mode, regime="evicted", sample=i, us=round(us, 3)))


for warps in (2, 4, 8):
    eg.FWD_WARPS = warps
    measure("fwd-row", 8192, warps, fwd, [out, saved], [want_out, want_saved])
eg.FWD_WARPS = 4
fwd()
grads = [dx, dkv, dweight]
# the backward from this saved state in float64 (small scores make the gradients ill-conditioned
# in the forward's rounding: compare the backward's own arithmetic only)
want_grads = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
for coef, warps in itertools.product((1024, 2048), (4, 8, 16)):  # the tile kernel at its defaults
    eg.COEF_BLOCK_D, eg.COEF_WARPS = coef, warps
    measure(f"bwd-coef-tile{eg.TILE_BLOCK_D}x{eg.TILE_WARPS}-groups{eg.GROUPS}", coef, warps, bwd, grads, want_grads)
eg.COEF_BLOCK_D, eg.COEF_WARPS = 1024, 4
for groups, block_d, warps in itertools.product((32, 64, 128), (128, 256, 512), (2, 4, 8)):
    eg.GROUPS, eg.TILE_BLOCK_D, eg.TILE_WARPS = groups, block_d, warps
    measure(f"bwd-tile-groups{groups}-coef1024x4", block_d, warps, bwd, grads, want_grads)
write_csv(sys.argv[1], rows)
import pandas as pd  # noqa: E402

df = pd.DataFrame(rows).groupby(["mode", "elements", "warps"])["us"].median().unstack("warps")
print(df.round(1).to_string())
