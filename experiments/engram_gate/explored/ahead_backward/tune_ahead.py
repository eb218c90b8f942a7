"""Time the one-launch backward with coefficient programs running ahead (ahead_backward.py).

    python experiments/engram_gate/explored/ahead_backward/tune_ahead.py OUT.csv

Against the shipped two-kernel backward in the same run, with the method of
``experiments/engram_gate/tune_blocks.py`` (N = 4096, D = 5120, S = 4, bf16, CUDA Graph replay,
L2 overwritten before each call; each setting checked first against the float64 formula from
the same saved state). Modes ``bwd-*`` time the backward alone, ``fwd+bwd-*`` the forward and
the backward back to back; ``setting`` names coefficient programs, their channels per step,
token groups and warps.
"""

import argparse
import itertools

import ahead_backward as ahead
import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, sweep
from dsfuse.engram_gate import engram_gate_backward_from_saved
from dsfuse.engram_gate.triton import kernels as eg

# setting -> (coefficient programs, coefficient channels per step, token groups, warps); None: shipped
DESIGNS = {"two-kernel": None} | {
    f"P{p}-coef{d}-groups{g}-warps{w}": (p, d, g, w)
    for p, d, g, w in itertools.product((66, 132, 198, 264), (512, 1024), (16, 32), (4, 8))}


def settings() -> list[dict]:
    return [dict(mode=f"{what}-{'shipped' if design is None else 'ahead'}", setting=name)
            for name, design in DESIGNS.items() for what in ("bwd", "fwd+bwd")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    x, kv, weight, mask, dout, eps = gate_inputs(4096, dev)
    n, streams, dim = x.shape
    out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device=dev)
    eg.FWD_WARPS = 2
    eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=1e-6)
    want = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
    grads = (torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device=dev))
    workspace = torch.empty(max(ahead.workspace_elements(n, streams, dim), eg.workspace_elements(n, streams, dim)),
                            device=dev)

    def build(s):
        design = DESIGNS[s["setting"]]
        if design is None:
            bwd = lambda: eg.launch_backward(dout, x, kv, weight, saved, *grads, workspace, clamp=1e-6)  # noqa: E731
        else:
            ahead.COEF_PROGRAMS, ahead.COEF_BLOCK_D, ahead.GROUPS, ahead.WARPS = design
            bwd = lambda: ahead.launch(dout, x, kv, weight, saved, *grads, workspace, clamp=1e-6)  # noqa: E731
        if s["mode"].startswith("fwd+bwd"):
            return lambda: (eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=1e-6), bwd())
        return bwd

    timer = Timer(dev, 256 << 20)
    sweep(settings(), build, lambda fn, s: checked_graph_samples(fn, grads, want, timer, str(s)), args.out,
          desc="run-ahead backward")


if __name__ == "__main__":
    main()
