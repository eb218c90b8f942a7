"""Sweep the vision RoPE backward's tokens per program and warps.

    python experiments/vision_rope/tune_blocks.py OUT.csv [T ...]

For each (TOKENS_PER_PROGRAM, NUM_WARPS) the fused backward is
checked bitwise against the eager formula once, then timed by CUDA Graph replay
with the L2 overwritten before each call, on the model's layouts (dk stored HDT)
and, as the cost of the transpose, on a dK already in HTD storage. A plain copy of
the same number of bytes is timed alongside (mode ``copy-same-bytes``), since a
~100 MB copy does not reach the 1 GiB copy bandwidth of the main run. One CSV row
per sample; the chosen constants in dsfuse/vision_rope/triton.py come from here. (The
files in raw/tuning/ also swept heads per program and the grid order, options the kernel
had at the commits their README names and no longer has: neither was faster.)
"""

import itertools
import sys

import torch

from dsfuse.bench.harness import Timer, capture_graph, write_csv
from dsfuse.vision_rope import triton as vr_triton
from dsfuse.vision_rope.reference import vision_rope_backward_reference

HEADS, DIM = 16, 64
tokens_list = [int(t) for t in sys.argv[2:]] or [8649, 1521]
timer = Timer(torch.device("cuda"), 256 << 20)
rows = []


def record(mode, elements, warps, samples):
    rows.extend(dict(elements=elements, warps=warps, mode=mode, regime="evicted", sample=i, us=round(us, 3))
                for i, us in enumerate(samples))


for tokens in tokens_list:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    dq, dv = (torch.randn(HEADS, tokens, DIM, device="cuda", generator=gen).bfloat16() for _ in range(2))
    dk_store = torch.randn(HEADS, DIM, tokens, device="cuda", generator=gen).bfloat16()  # [H, D, T] storage
    dk_hdt = dk_store.transpose(1, 2)  # [H, T, D] logical, as the kernel reads it
    dk_htd = dk_hdt.contiguous()
    angles = torch.rand(tokens, DIM // 2, device="cuda", generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    want = vision_rope_backward_reference(dq, dk_store, dv, cos, sin)
    out = torch.empty(tokens, 3 * HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * out.numel() * out.element_size() + 2 * cos.numel() * 4
    src = torch.zeros(nbytes // 8, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    # an elementwise kernel, not a memcpy: a captured memcpy may run on a (slower) copy engine
    graph, _ = capture_graph(lambda: (torch.neg(src, out=dst),), torch.device("cuda"))
    record(f"copy-same-bytes-T{tokens}", 0, 0, timer.samples(graph.replay, "evicted", 20, 20))
    for block_t, warps in itertools.product((16, 32, 64), (1, 2, 4)):
        vr_triton.TOKENS_PER_PROGRAM, vr_triton.NUM_WARPS = block_t, warps
        for layout, dk in (("hdt", dk_hdt), ("htd", dk_htd)):
            out.fill_(float("nan"))
            vr_triton.launch_backward(dq, dk, dv, cos, sin, out)
            if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                raise AssertionError(f"T={tokens} block_t={block_t} warps={warps} {layout}: not bitwise")
            graph, _ = capture_graph(lambda dk=dk: (vr_triton.launch_backward(dq, dk, dv, cos, sin, out),),
                                     torch.device("cuda"))
            record(f"T{tokens}-dk_{layout}", block_t, warps, timer.samples(graph.replay, "evicted", 20, 20))
write_csv(sys.argv[1], rows)
import pandas as pd  # noqa: E402

df = pd.DataFrame(rows).groupby(["mode", "elements", "warps"])["us"].median().unstack("warps")
print(df.round(1).to_string())
