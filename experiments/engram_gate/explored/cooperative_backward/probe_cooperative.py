"""Probe: where the cooperative backward loses time (its kernel with parts switched off).

    python experiments/engram_gate/explored/cooperative_backward/probe_cooperative.py OUT.csv

Variants of ``cooperative_backward.py``'s 3D-tile kernel, chosen by its compile-time switches
``SYNC`` and ``LOCAL_SUMS``: ``full`` (as it is); ``nosync`` (no release count, no wait: the
totals are read whenever they are there, so results are wrong; timing only); ``local`` (nosync,
and each program uses only its own chunk's sum: no cross-program traffic at all). Records
registers and spills per setting. N = 4096, D = 5120, CUDA Graph replay, L2 overwritten before
each call. (The stored data, ``probe-cooperative-sync-cost*.csv``, came from an earlier form of
this probe that built the variants by editing the kernel's source text.)
"""

import argparse

import cooperative_backward as coop
import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, capture_graph, sweep
from dsfuse.engram_gate.triton import kernels as eg

VARIANTS = {"full": (True, False), "nosync": (False, False), "local": (False, True)}  # SYNC, LOCAL_SUMS
SHAPES = [(1, 256, 4), (1, 512, 4), (2, 256, 4), (4, 128, 4), (2, 512, 8), (4, 256, 8)]  # tokens, channels, warps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    x, kv, weight, mask, dout, eps = gate_inputs(4096, dev)
    n, streams, dim = x.shape
    out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device=dev)
    eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=1e-6)
    dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device=dev)
    workspace = torch.empty(64 << 20, device=dev)
    timer = Timer(dev, 256 << 20)

    def build(s):
        coop.GROUPS, coop.BWD_TOKENS, coop.BWD_BLOCK_D, coop.BWD_WARPS, coop.LOOKAHEAD = (
            32, s["tokens"], s["elements"], s["warps"], 2)
        coop.LOOPED, (coop.SYNC, coop.LOCAL_SUMS) = False, VARIANTS[s["variant"]]  # the 3D-tile kernel
        return lambda: coop.launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=1e-6)

    def measure(fn, s):
        fn()  # compiles this variant: the newest entry of the kernel's cache
        torch.cuda.synchronize()
        compiled = list(coop._engram_bwd_kernel.device_caches[torch.cuda.current_device()][0].values())[-1]
        graph, _ = capture_graph(lambda: (fn(),), dev)
        return timer.samples(graph.replay, "evicted", 10, 5), dict(regs=compiled.n_regs, spills=compiled.n_spills)

    settings = [dict(variant=v, tokens=t, elements=d, warps=w) for (t, d, w) in SHAPES for v in VARIANTS]
    try:
        sweep(settings, build, measure, args.out, desc="cooperative probe")
    finally:
        coop.SYNC, coop.LOCAL_SUMS = True, False


if __name__ == "__main__":
    main()
