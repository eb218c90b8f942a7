"""How fast can the in-place text RoPE's access pattern go at all? Controls for its bandwidth target.

    python experiments/text_rope/strided_floor.py OUT.csv [--samples 30]
    python experiments/text_rope/strided_floor.py --render RAW.csv OUT.md

The in-place rotation of q [1, 4096, 64, 512] bf16 touches the last 64 channels of every
(token, head) row: 128 contiguous bytes out of each 1,024-byte row, read and written back. This
script times, on the same tensor and in the same run (CUDA Graph replay, L2 overwritten before each
replay, ``dsfuse.bench.harness.Timer``):

* ``rope_inplace``: the shipped kernel (``launch_rope(..., copy=False)``);
* ``identity_<rows>x<warps>``: a Triton kernel with the same access pattern and no arithmetic (each
  row's 64 channels loaded and stored back unchanged), over rows per program and warps: the
  pattern's own ceiling for this kind of kernel;
* ``torch_strided_mul``: ``q[..., 448:].mul_(1)`` (PyTorch's strided elementwise kernel, same bytes);
* ``dense_inplace``: ``mul_(1)`` of a contiguous tensor of the same number of elements (the same bytes
  read and written, dense);
* ``dense_copy``: ``dst.copy_(src)`` of that many bytes (the copy bandwidth the targets are stated in).

Rows: ``variant, sample, us, bytes`` (bytes read + written by the variant).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from dsfuse.bench.harness import Timer, capture_graph, write_csv
from dsfuse.text_rope.triton import kernels as rope_triton

SHAPE = (1, 4096, 64, 512)
ROTARY = 64


@triton.jit
def _identity_kernel(x_ptr, n_rows, row_stride, start, BLOCK_R: tl.constexpr, WIDTH: tl.constexpr):
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = tl.arange(0, WIDTH)
    m = (o_r < n_rows)[:, None]
    p = x_ptr + o_r.to(tl.int64)[:, None] * row_stride + start + o_c[None, :]
    tl.store(p, tl.load(p, mask=m), mask=m)


def render(raw: Path) -> str:
    """The medians of a run's CSV as a Markdown table (bandwidth as a fraction of the same run's copy)."""
    import pandas as pd

    samples = pd.read_csv(raw)
    table = samples.groupby("variant", sort=False).agg(us=("us", "median"), nbytes=("bytes", "first"))
    table["tbs"] = table["nbytes"] / table["us"] / 1e6
    copy = table.loc["dense_copy", "tbs"]
    lines = [f"Run `{raw.parent.name}`: median of {samples.groupby('variant').size().min()} CUDA Graph replays, "
             "L2 overwritten before each; bytes read + written.", "",
             "| variant | median us | MB moved | TB/s | of the same-size copy |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in table.iterrows():
        lines.append(f"| `{name}` | {r['us']:.1f} | {r['nbytes'] / 1e6:.1f} | {r['tbs']:.2f} | {r['tbs'] / copy:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["--render"]:
        Path(sys.argv[3]).write_text(render(Path(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    dev = torch.device("cuda")
    q = torch.randn(SHAPE, device=dev).bfloat16()
    freqs = torch.view_as_real(torch.polar(torch.ones(1, SHAPE[1], ROTARY // 2, device=dev),
                                           torch.rand(1, SHAPE[1], ROTARY // 2, device=dev)))
    rows = SHAPE[0] * SHAPE[1] * SHAPE[2]
    touched = rows * ROTARY * q.element_size() * 2  # read + written
    dense = torch.randn(rows * ROTARY, device=dev).bfloat16()
    src, dst = torch.randn(rows * ROTARY // 2, device=dev).bfloat16(), torch.empty(rows * ROTARY // 2, device=dev,
                                                                                 dtype=torch.bfloat16)
    variants = {
        "rope_inplace": lambda: rope_triton.launch_rope(q, freqs, q, conj=False, copy=False),
        "torch_strided_mul": lambda: q[..., -ROTARY:].mul_(1),
        "dense_inplace": lambda: dense.mul_(1),
        "dense_copy": lambda: dst.copy_(src),
    }
    for block_r in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            def identity(block_r=block_r, warps=warps):
                _identity_kernel[(triton.cdiv(rows, block_r),)](q, rows, SHAPE[-1], SHAPE[-1] - ROTARY,
                                                                  BLOCK_R=block_r, WIDTH=ROTARY, num_warps=warps)
            variants[f"identity_{block_r}x{warps}"] = identity
    timer = Timer(dev, 256 << 20)
    out = []
    for name, fn in variants.items():
        graph, _ = capture_graph(lambda fn=fn: (fn(),), dev)
        nbytes = touched if name != "dense_copy" else 2 * src.numel() * src.element_size()
        out += [dict(variant=name, sample=i, us=us, bytes=nbytes)
                for i, us in enumerate(timer.samples(graph.replay, "evicted", args.samples, 1))]
        del graph
    write_csv(args.out, out)
    import pandas as pd

    table = pd.DataFrame(out).groupby("variant", sort=False).agg(us=("us", "median"), bytes=("bytes", "first"))
    table["TB/s"] = table["bytes"] / table["us"] / 1e6
    table["of dense copy"] = table["TB/s"] / table.loc["dense_copy", "TB/s"]
    print(table.round(3).to_string())


if __name__ == "__main__":
    main()
