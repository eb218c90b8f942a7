"""Sweep the text RoPE kernel's work per program and warp count on the q shape.

    python experiments/text_rope/tune_blocks.py OUT.csv

Times forward (values -> out), backward-mode (conjugate + gradient sum) and
in-place launches for each (ELEMENTS_PER_PROGRAM, NUM_WARPS) on q [1, 4096, 64, 512]
bf16, CUDA Graph replay with the L2 overwritten before each call;
``dsfuse.bench.harness.sweep`` writes one CSV row per sample. The chosen constants in
dsfuse/text_rope/triton.py come from this sweep (raw data: experiments/text_rope/raw/tuning/).
"""

import argparse

import torch

from dsfuse.bench.harness import Timer, capture_graph, sweep
from dsfuse.text_rope.triton import kernels as rope_triton

SETTINGS = {"elements": [1024, 2048, 4096, 8192, 16384], "warps": [1, 2, 4, 8], "mode": ["fwd", "bwd", "inplace"],
            "regime": ["evicted"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    shape = (1, 4096, 64, 512)
    values = torch.randn(shape, device=dev).bfloat16()
    freqs = torch.view_as_real(torch.polar(torch.ones(1, 4096, 32, device=dev), torch.rand(1, 4096, 32, device=dev)))
    out = torch.empty_like(values)
    modes = {
        "fwd": lambda: rope_triton.launch_rope(values, freqs, out, conj=False),
        "bwd": lambda: rope_triton.launch_rope(values, freqs, out, conj=True, grad_sum=True),
        "inplace": lambda: rope_triton.launch_rope(out, freqs, out, conj=False, copy=False),
    }
    defaults = rope_triton.ELEMENTS_PER_PROGRAM, rope_triton.NUM_WARPS
    timer = Timer(dev, 256 << 20)

    def build(s):
        rope_triton.ELEMENTS_PER_PROGRAM, rope_triton.NUM_WARPS = s["elements"], s["warps"]
        launch = modes[s["mode"]]
        graph, _ = capture_graph(lambda: (launch(),), dev)
        return graph

    try:
        sweep(SETTINGS, build, lambda graph, s: timer.samples(graph.replay, s["regime"], 20, 20), args.out,
              desc="text RoPE blocks")
    finally:
        rope_triton.ELEMENTS_PER_PROGRAM, rope_triton.NUM_WARPS = defaults


if __name__ == "__main__":
    main()
