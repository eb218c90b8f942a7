"""Sweep the Engram gate kernels' launch constants at the model's width.

    python experiments/engram_gate/tune_blocks.py OUT.csv [N] [--cooperative] [--looped]

Forward: warps per row program. Backward: the shipped two-kernel design in both token
orders of its tile kernel (also timed after the forward: the target's regime); with
``--cooperative``, the one-kernel experiment (``cooperative_backward.py``) over token
groups, channels per program, tokens per block, warps and lookahead; with ``--looped``, its
looped variant (also after the forward). The whole backward is timed, the dWeight sum
included. Each setting is checked once (relative RMS error <= 2^-8 on every output; forward
against the fp32 model, backward against the float64 formula from the same saved state),
then timed by CUDA Graph replay with the L2 overwritten before each call (N = 4096 unless
given, D = 5120, S = 4, bf16).
One CSV row per sample; the constants in dsfuse/engram_gate/triton.py come from here.
"""

import itertools
import sys

import torch
import cooperative_backward as coop

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, write_csv
from dsfuse.engram_gate import engram_gate_backward_from_saved, engram_gate_reference
from dsfuse.engram_gate import triton as eg

args = [a for a in sys.argv[1:] if not a.startswith("--")]
x, kv, weight, mask, dout, eps = gate_inputs(int(args[1]) if len(args) > 1 else 4096, torch.device("cuda"))
n, streams, dim = x.shape
clamp = 1e-6
want_out, want_saved = engram_gate_reference(x, kv, weight, mask, eps=eps)
out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device="cuda")
dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device="cuda")
# backward settings: token groups, channels per program, tokens per block, warps, lookahead
SETTINGS = list(itertools.product((8, 16, 32), (256, 512), (2, 4, 8), (4, 8), (1, 2)))


def set_constants(groups, block_d, tokens, warps, lookahead):
    coop.GROUPS, coop.BWD_BLOCK_D, coop.BWD_TOKENS, coop.BWD_WARPS, coop.LOOKAHEAD = (groups, block_d, tokens, warps,
                                                                                       lookahead)
    return coop.workspace_elements(n, streams, dim)


COOPERATIVE = "--cooperative" in sys.argv  # the experiment's sweep (slow: 72 settings)
LOOPED = "--looped" in sys.argv  # the experiment's looped kernel: groups, channels, tokens per block, lookahead
LOOPED_SETTINGS = list(itertools.product((16, 32), (256, 512), (4, 8, 16), (4,), (0, 1)))
sizes = [set_constants(*c) for c in SETTINGS] if COOPERATIVE else []
sizes += [set_constants(*c) for c in LOOPED_SETTINGS] if LOOPED else []
workspace = torch.empty(max(sizes + [eg.workspace_elements(n, streams, dim)]), device="cuda")
timer = Timer(torch.device("cuda"), 256 << 20)
rows = []


def fwd():
    eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=clamp)


def bwd():
    eg.launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=clamp)


def measure(mode, elements, warps, fn, outputs, wants):
    us = checked_graph_samples(fn, outputs, wants, timer, f"{mode} {elements} {warps}")
    rows.extend({"elements": elements, "warps": warps, "mode": mode, "regime": "evicted", "sample": i,
                 "us": round(u, 3)} for i, u in enumerate(us))


for warps in (2, 4, 8):
    eg.FWD_WARPS = warps
    measure("fwd-row", 8192, warps, fwd, [out, saved], [want_out, want_saved])
eg.FWD_WARPS = 2
fwd()
grads = [dx, dkv, dweight]
# the backward from this saved state in float64 (small scores make the gradients ill-conditioned
# in the forward's rounding: compare the backward's own arithmetic only)
want_grads = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
for reverse in (False, True):
    eg.TILE_REVERSE = reverse
    measure(f"bwd-two-kernel-reverse{int(reverse)}", eg.TILE_BLOCK_D, eg.TILE_WARPS, bwd, grads, want_grads)
    for warps in (2, 4):  # the target's regime: forward then backward, L2 overwritten before the pair
        eg.FWD_WARPS = warps
        measure(f"fwd+bwd-reverse{int(reverse)}", 8192, warps, lambda: (fwd(), bwd()), grads, want_grads)
    eg.FWD_WARPS = 2
for groups, block_d, tokens, warps, lookahead in SETTINGS if COOPERATIVE else []:
    set_constants(groups, block_d, tokens, warps, lookahead)
    measure(f"bwd-coop-groups{groups}-tokens{tokens}-look{lookahead}", block_d, warps,
            lambda: coop.launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=clamp), grads,
            want_grads)
coop.LOOPED = True
for groups, block_d, tokens, warps, lookahead in LOOPED_SETTINGS if LOOPED else []:
    set_constants(groups, block_d, tokens, warps, lookahead)
    for what, fn in (("bwd", lambda: coop.launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=clamp)),
                     ("fwd+bwd", lambda: (fwd(), coop.launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace,
                                                             clamp=clamp)))):
        measure(f"{what}-looped-groups{groups}-tokens{tokens}-look{lookahead}", block_d, warps, fn, grads, want_grads)
write_csv(args[0], rows)
import pandas as pd  # noqa: E402

df = pd.DataFrame(rows).groupby(["mode", "elements", "warps"])["us"].median().sort_values()
print(df.round(1).head(25).to_string())
