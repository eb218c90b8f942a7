"""Sweep the shipped Engram gate kernels' launch constants at the model's width.

    python experiments/engram_gate/tune_blocks.py OUT.csv [--n N]

Forward: warps per row program. Backward: the two-kernel design in both token orders of its
tile kernel, alone and after the forward (forward warps 2 / 4: the target's regime). The
whole backward is timed, the dWeight sum included. Each setting is checked once (relative RMS
error <= 2^-8 on every output; forward against the fp32 model, backward against the float64
formula from the same saved state), then timed by CUDA Graph replay with the L2 overwritten
before each call (N = 4096 unless given, D = 5120, S = 4, bf16); ``dsfuse.bench.harness.sweep``
writes one CSV row per sample (a setting that fails its check is a row with its error). The
constants in dsfuse/engram_gate/triton.py come from here; the rejected backward designs and
their sweeps are under ``explored/``.
"""

import argparse

import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, sweep
from dsfuse.engram_gate import engram_gate_backward_from_saved, engram_gate_reference
from dsfuse.engram_gate.triton import kernels as eg

CLAMP = 1e-6


def settings() -> list[dict]:
    """Forward warps; the backward in both tile orders, alone and after the forward."""
    out = [dict(mode="fwd-row", elements=8192, warps=w, regime="evicted") for w in (2, 4, 8)]
    for reverse in (0, 1):
        out.append(dict(mode=f"bwd-two-kernel-reverse{reverse}", elements=eg.TILE_BLOCK_D, warps=eg.TILE_WARPS,
                        regime="evicted", reverse=reverse))
        out += [dict(mode=f"fwd+bwd-reverse{reverse}", elements=8192, warps=w, regime="evicted", reverse=reverse)
                for w in (2, 4)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    parser.add_argument("--n", type=int, default=4096, help="tokens (default 4096)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    x, kv, weight, mask, dout, eps = gate_inputs(args.n, dev)
    n, streams, dim = x.shape
    want_fwd = engram_gate_reference(x, kv, weight, mask, eps=eps)
    out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device=dev)
    grads = (torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device=dev))
    workspace = torch.empty(eg.workspace_elements(n, streams, dim), device=dev)

    def fwd():
        eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=CLAMP)

    def bwd():
        eg.launch_backward(dout, x, kv, weight, saved, *grads, workspace, clamp=CLAMP)

    # the backward from the shipped forward's saved state in float64 (small scores make the gradients
    # ill-conditioned in the forward's rounding: compare the backward's own arithmetic only)
    eg.FWD_WARPS = 2
    fwd()
    want_bwd = engram_gate_backward_from_saved(dout, x, kv, weight, saved)

    def build(s):
        eg.FWD_WARPS, eg.TILE_REVERSE = 2, True
        if s["mode"] == "fwd-row":
            eg.FWD_WARPS = s["warps"]
            return fwd, (out, saved), want_fwd
        eg.TILE_REVERSE = bool(s["reverse"])
        if s["mode"].startswith("fwd+bwd"):
            eg.FWD_WARPS = s["warps"]
            return (lambda: (fwd(), bwd())), grads, want_bwd
        return bwd, grads, want_bwd

    timer = Timer(dev, 256 << 20)
    sweep(settings(), build, lambda b, s: checked_graph_samples(*b, timer, str(s)), args.out, desc="engram blocks")
    eg.FWD_WARPS, eg.TILE_REVERSE = 2, True


if __name__ == "__main__":
    main()
