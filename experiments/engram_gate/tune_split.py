"""Time the split-D kernels and chained launches of split_backward.py against the shipped ones.

    python experiments/engram_gate/tune_split.py OUT.csv

Method of tune_blocks.py (N = 4096, D = 5120, S = 4, bf16, CUDA Graph replay, L2 overwritten
before each call; each setting checked first: forward against the fp32 model, backward against
the float64 formula from the same saved state). Every setting is timed in ``ROUNDS`` rounds,
the shipped kernels in each round, so drift between rounds falls on all settings alike.
Odd N (1, 3, 4097) are checked, not timed.
"""

import itertools
import sys

import split_backward as sb
import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, write_csv
from dsfuse.engram_gate import engram_gate_backward_from_saved, engram_gate_reference
from dsfuse.engram_gate import triton as eg

ROUNDS = 3
dev = torch.device("cuda")
timer = Timer(dev, 256 << 20)
clamp = 1e-6


def problem(n):
    x, kv, weight, mask, dout, eps = gate_inputs(n, dev)
    streams, dim = x.shape[1:]
    p = dict(x=x, kv=kv, weight=weight, mask=mask, dout=dout, eps=eps, out=torch.empty_like(x),
             saved=torch.empty(n, streams, 4, device=dev), dx=torch.empty_like(x), dkv=torch.empty_like(kv),
             dweight=torch.empty(streams, dim, device=dev),
             workspace=torch.empty(max(sb.workspace_elements(n, streams, dim), eg.workspace_elements(n, streams, dim)),
                                   device=dev))
    p["want_fwd"] = engram_gate_reference(x, kv, weight, mask, eps=eps)
    eg.launch_forward(x, kv, weight, mask, p["out"], p["saved"], eps=eps, clamp=clamp)
    p["want_bwd"] = engram_gate_backward_from_saved(dout, x, kv, weight, p["saved"])
    return p


def fwd_fn(p, design):
    launch = eg.launch_forward if design == "shipped" else sb.launch_forward
    return lambda: launch(p["x"], p["kv"], p["weight"], p["mask"], p["out"], p["saved"], eps=p["eps"], clamp=clamp)


def bwd_fn(p, design):
    launch = eg.launch_backward if design == "shipped" else sb.launch_backward
    return lambda: launch(p["dout"], p["x"], p["kv"], p["weight"], p["saved"], p["dx"], p["dkv"], p["dweight"],
                          p["workspace"], clamp=clamp)


FWD = [("shipped", None)] + [("row", w) for w in (1, 2, 4)] + [("token", w) for w in (4, 8, 16)]
BWD = [("shipped", None, None, None)] + [("split", d, w, pdl) for (d, w), pdl in itertools.product(
    ((512, 2), (512, 4), (1024, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8)), (False, True))]
FWD_PAIR = [("shipped", None), ("row", 2), ("token", 8)]
BWD_PAIR = [BWD[0], ("split", 1024, 4, False), ("split", 1024, 4, True), ("split", 512, 4, True),
            ("split", 2048, 4, True)]


def set_fwd(design, warps):
    if design != "shipped":
        sb.FWD_TOKEN, sb.FWD_WARPS = design == "token", warps
    return "shipped" if design == "shipped" else "split"


def set_bwd(design, block_d, warps, pdl):
    if design != "shipped":
        sb.DOT_BLOCK_D, sb.DOT_WARPS, sb.PDL = block_d, warps, pdl
    return design


def check_small():
    """Odd N: each forward and each backward design against the references (no timing)."""
    for n in (1, 3, 4097):
        p = problem(n)
        for f in FWD:
            checked_graph_samples(fwd_fn(p, set_fwd(*f)), (p["out"], p["saved"]), p["want_fwd"], timer, f"N={n} {f}",
                                  n=1)
        eg.launch_forward(p["x"], p["kv"], p["weight"], p["mask"], p["out"], p["saved"], eps=p["eps"], clamp=clamp)
        for b in BWD:
            checked_graph_samples(bwd_fn(p, set_bwd(*b)), (p["dx"], p["dkv"], p["dweight"]), p["want_bwd"], timer,
                                  f"N={n} {b}", n=1)
        print(f"N = {n}: all designs pass", flush=True)


check_small()
p = problem(4096)
rows = []


def measure(what, setting, fn, outputs, wants, rnd):
    us = checked_graph_samples(fn, outputs, wants, timer, f"{what} {setting}")
    rows.extend({"mode": what, "setting": setting, "round": rnd, "sample": i, "us": round(u, 3)}
                for i, u in enumerate(us))
    print(f"round {rnd} {what} {setting}: {sorted(us)[len(us) // 2]:.1f} us", flush=True)


grads = (p["dx"], p["dkv"], p["dweight"])
for rnd in range(ROUNDS):
    for f in FWD:
        measure("fwd", f"{f[0]}-w{f[1]}", fwd_fn(p, set_fwd(*f)), (p["out"], p["saved"]), p["want_fwd"], rnd)
    eg.launch_forward(p["x"], p["kv"], p["weight"], p["mask"], p["out"], p["saved"], eps=p["eps"], clamp=clamp)
    for b in BWD:
        measure("bwd", "-".join(map(str, b)), bwd_fn(p, set_bwd(*b)), grads, p["want_bwd"], rnd)
    # forward then backward (the target's regime), checked against the backward from that forward's saved state
    for f, b in itertools.product(FWD_PAIR, BWD_PAIR):
        f1, b1 = fwd_fn(p, set_fwd(*f)), bwd_fn(p, set_bwd(*b))
        f1()
        want = engram_gate_backward_from_saved(p["dout"], p["x"], p["kv"], p["weight"], p["saved"])
        measure("fwd+bwd", f"{f[0]}-w{f[1]}+" + "-".join(map(str, b)), lambda: (f1(), b1()), grads, want, rnd)
write_csv(sys.argv[1], rows)
import pandas as pd  # noqa: E402

df = pd.DataFrame(rows).groupby(["mode", "setting"])["us"].median().sort_values()
print(df.round(1).to_string())
