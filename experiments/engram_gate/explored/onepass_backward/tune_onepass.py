"""Time the one-pass backward (onepass_backward.py) against the shipped one.

    python experiments/engram_gate/explored/onepass_backward/tune_onepass.py OUT.csv [--n N]

The experiment's gate inputs and the method of ``experiments/engram_gate/tune_blocks.py``
(N = 4096, D = 5120, S = 4, bf16, CUDA Graph replay, L2 overwritten before each call); every
setting is first checked against the float64 formula from the same saved state. Modes:
``bwd-shipped`` (dsfuse's backward as it ships) and ``bwd-onepass-P<programs>`` (elements:
channels per step; warps).
"""

import argparse

import torch
from onepass_backward import launch as launch_onepass

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, sweep
from dsfuse.engram_gate import engram_gate_backward_from_saved
from dsfuse.engram_gate.triton import kernels as eg

PROGRAMS, BLOCK_D, WARPS = (264, 528), (1024, 2048), (8, 16)


def settings() -> list[dict]:
    out = [dict(mode="bwd-shipped", elements=eg.TILE_BLOCK_D, warps=eg.TILE_WARPS, regime="evicted")]
    out += [dict(mode=f"bwd-onepass-P{p}", elements=d, warps=w, regime="evicted", programs=p)
            for p in PROGRAMS for d in BLOCK_D for w in WARPS]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    parser.add_argument("--n", type=int, default=4096, help="tokens (default 4096)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    x, kv, weight, mask, dout, eps = gate_inputs(args.n, dev)
    n, streams, dim = x.shape
    out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device=dev)
    eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=1e-6)
    want = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
    grads = (torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device=dev))
    workspace = torch.empty(max(max(PROGRAMS) * streams * dim, eg.workspace_elements(n, streams, dim)), device=dev)

    def build(s):
        if s["mode"] == "bwd-shipped":
            return lambda: eg.launch_backward(dout, x, kv, weight, saved, *grads, workspace, clamp=1e-6)
        return lambda: launch_onepass(dout, x, kv, weight, saved, *grads, workspace, clamp=1e-6,
                                      programs=s["programs"], block_d=s["elements"], warps=s["warps"])

    timer = Timer(dev, 256 << 20)
    sweep(settings(), build, lambda fn, s: checked_graph_samples(fn, grads, want, timer, str(s)), args.out,
          desc="one-pass backward")


if __name__ == "__main__":
    main()
