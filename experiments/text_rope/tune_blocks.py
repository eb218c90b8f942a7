"""Sweep the text RoPE kernel's work per program and warp count on the q shape.

    python experiments/text_rope/tune_blocks.py OUT.csv

Times forward (values -> out), backward-mode (conjugate + gradient sum) and
in-place launches for each (ELEMENTS_PER_PROGRAM, NUM_WARPS) on q [1, 4096, 64, 512]
bf16, CUDA Graph replay with the L2 overwritten before each call, and writes
one CSV row per sample. The chosen constants in dsfuse/text_rope/triton.py
come from this sweep (experiments/text_rope/raw/<run-id>/tune_blocks.csv).
"""

import sys

import torch

from dsfuse.bench.harness import Timer, capture_graph, write_csv
from dsfuse.text_rope import triton as rope_triton

shape = (1, 4096, 64, 512)
values = torch.randn(shape, device="cuda").bfloat16()
freqs = torch.view_as_real(torch.polar(torch.ones(1, 4096, 32, device="cuda"), torch.rand(1, 4096, 32, device="cuda")))
out = torch.empty_like(values)
timer = Timer(torch.device("cuda"), 256 << 20)
rows = []
modes = {
    "fwd": lambda: rope_triton.launch_rope(values, freqs, out, conj=False),
    "bwd": lambda: rope_triton.launch_rope(values, freqs, out, conj=True, grad_sum=True),
    "inplace": lambda: rope_triton.launch_rope(out, freqs, out, conj=False, copy=False),
}
for elements in (1024, 2048, 4096, 8192, 16384):
    for warps in (1, 2, 4, 8):
        rope_triton.ELEMENTS_PER_PROGRAM, rope_triton.NUM_WARPS = elements, warps
        for mode, launch in modes.items():
            graph, _ = capture_graph(lambda: (launch(),), torch.device("cuda"))
            for regime in ("evicted",):
                for i, us in enumerate(timer.samples(graph.replay, regime, 20, 20)):
                    rows.append(dict(elements=elements, warps=warps, mode=mode, regime=regime, sample=i,
                                     us=round(us, 3)))
write_csv(sys.argv[1], rows)
import pandas as pd  # noqa: E402

df = pd.DataFrame(rows).groupby(["mode", "regime", "elements", "warps"])["us"].median().unstack("warps")
print(df.round(1).to_string())
