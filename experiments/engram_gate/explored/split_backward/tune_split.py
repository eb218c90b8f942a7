"""Time the split-D kernels and chained launches of split_backward.py against the shipped ones.

    python experiments/engram_gate/explored/split_backward/tune_split.py OUT.csv [--rounds R]

Method of ``experiments/engram_gate/tune_blocks.py`` (N = 4096, D = 5120, S = 4, bf16, CUDA
Graph replay, L2 overwritten before each call; each setting checked first: forward against the
fp32 model, backward against the float64 formula from the same saved state). Every setting is
timed in each of ``R`` rounds (3 unless given), the shipped kernels in each round, so drift
between rounds falls on all settings alike. Odd N (1, 3, 4097) are checked first, not timed.
"""

import argparse
import itertools

import split_backward as sb
import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, sweep
from dsfuse.engram_gate import engram_gate_backward_from_saved, engram_gate_reference
from dsfuse.engram_gate.triton import kernels as eg

CLAMP = 1e-6
# forward (design, warps) and backward (design, channels per kernel-1 program, its warps, PDL)
FWD = [("shipped", None)] + [("row", w) for w in (1, 2, 4)] + [("token", w) for w in (4, 8, 16)]
BWD = [("shipped", None, None, None)] + [("split", d, w, pdl) for (d, w), pdl in itertools.product(
    ((512, 2), (512, 4), (1024, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8)), (False, True))]
FWD_PAIR = [("shipped", None), ("row", 2), ("token", 8)]
BWD_PAIR = [BWD[0], ("split", 1024, 4, False), ("split", 1024, 4, True), ("split", 512, 4, True),
            ("split", 2048, 4, True)]


def fwd_label(f) -> str:
    return f"{f[0]}-w{f[1]}"


def bwd_label(b) -> str:
    return "-".join(map(str, b))


# the CSV's (mode, setting) -> the designs it runs
SETTINGS = ({("fwd", fwd_label(f)): (f, None) for f in FWD} | {("bwd", bwd_label(b)): (None, b) for b in BWD}
            | {("fwd+bwd", f"{fwd_label(f)}+{bwd_label(b)}"): (f, b) for f, b in itertools.product(FWD_PAIR, BWD_PAIR)})


def problem(n, dev):
    x, kv, weight, mask, dout, eps = gate_inputs(n, dev)
    streams, dim = x.shape[1:]
    p = dict(x=x, kv=kv, weight=weight, mask=mask, dout=dout, eps=eps, out=torch.empty_like(x),
             saved=torch.empty(n, streams, 4, device=dev), dx=torch.empty_like(x), dkv=torch.empty_like(kv),
             dweight=torch.empty(streams, dim, device=dev),
             workspace=torch.empty(max(sb.workspace_elements(n, streams, dim), eg.workspace_elements(n, streams, dim)),
                                   device=dev))
    p["want_fwd"] = engram_gate_reference(x, kv, weight, mask, eps=eps)
    shipped_forward(p)
    p["want_bwd"] = engram_gate_backward_from_saved(dout, x, kv, weight, p["saved"])
    return p


def shipped_forward(p):
    eg.launch_forward(p["x"], p["kv"], p["weight"], p["mask"], p["out"], p["saved"], eps=p["eps"], clamp=CLAMP)


def fwd_fn(p, design, warps):
    if design != "shipped":
        sb.FWD_TOKEN, sb.FWD_WARPS = design == "token", warps
    launch = eg.launch_forward if design == "shipped" else sb.launch_forward
    return lambda: launch(p["x"], p["kv"], p["weight"], p["mask"], p["out"], p["saved"], eps=p["eps"], clamp=CLAMP)


def bwd_fn(p, design, block_d, warps, pdl):
    if design != "shipped":
        sb.DOT_BLOCK_D, sb.DOT_WARPS, sb.PDL = block_d, warps, pdl
    launch = eg.launch_backward if design == "shipped" else sb.launch_backward
    return lambda: launch(p["dout"], p["x"], p["kv"], p["weight"], p["saved"], p["dx"], p["dkv"], p["dweight"],
                          p["workspace"], clamp=CLAMP)


def build(p, s):
    """(run, outputs, expected) of one setting; the backward's reference from the saved state it runs on."""
    f, b = SETTINGS[(s["mode"], s["setting"])]
    grads = (p["dx"], p["dkv"], p["dweight"])
    if b is None:
        return fwd_fn(p, *f), (p["out"], p["saved"]), p["want_fwd"]
    if f is None:
        shipped_forward(p)  # the saved state of want_bwd
        return bwd_fn(p, *b), grads, p["want_bwd"]
    f1, b1 = fwd_fn(p, *f), bwd_fn(p, *b)
    f1()
    want = engram_gate_backward_from_saved(p["dout"], p["x"], p["kv"], p["weight"], p["saved"])
    return (lambda: (f1(), b1())), grads, want


def check_small(dev, timer):
    """Odd N: each forward and each backward design against the references (no timing)."""
    for n in (1, 3, 4097):
        p = problem(n, dev)
        for (mode, setting) in SETTINGS:
            if mode != "fwd+bwd":
                checked_graph_samples(*build(p, dict(mode=mode, setting=setting)), timer, f"N={n} {mode} {setting}",
                                      n=1)
        print(f"N = {n}: all designs pass", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all settings (default 3)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    timer = Timer(dev, 256 << 20)
    check_small(dev, timer)
    p = problem(4096, dev)
    settings = [dict(mode=mode, setting=setting) for mode, setting in SETTINGS]
    sweep(settings, lambda s: build(p, s), lambda b, s: checked_graph_samples(*b, timer, str(s)), args.out,
          rounds=args.rounds, desc="split-D kernels")


if __name__ == "__main__":
    main()
