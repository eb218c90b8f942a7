"""Host (CPU) time per call of the text RoPE API and its parts, on a small input.

    python experiments/text_rope/host_overhead.py OUT.csv

A [1, 64, 8, 512] bf16 input keeps GPU time far below host time, so the
time per call of a loop without synchronisation is the host cost of enqueueing.
One CSV row per sample (``part``, ``sample``, ``host_us``).
"""

import argparse

import torch
import triton
import triton.language as tl

from dsfuse.bench.harness import host_us_samples, sweep
from dsfuse.text_rope import api, apply_rope, rope_reference
from dsfuse.text_rope.triton import launch_rope


@triton.jit
def _touch(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n), mask=o < n)


def parts(dev: torch.device) -> dict:
    """The API layers (and a trivial Triton launch), each a zero-argument call on the same small input."""
    values = torch.randn(1, 64, 8, 512, device=dev).bfloat16()
    angles = torch.rand(1, 64, 32, device=dev)
    freqs = api._freqs(angles)
    out = torch.empty_like(values)
    return {
        "validate": lambda: api._validate(values, angles, False, None),
        "freqs (torch.polar)": lambda: api._freqs(angles),
        "trivial Triton launch (3 args)": lambda: _touch[(1,)](out, 16, BLOCK=16),
        "torch.empty": lambda: torch.empty(values.shape, dtype=values.dtype, device=values.device),
        "launch_rope (Triton launch)": lambda: launch_rope(values, freqs, out, conj=False),
        "apply_rope": lambda: apply_rope(values, angles),
        "apply_rope out=": lambda: apply_rope(values, angles, out=out),
        "eager reference": lambda: rope_reference(values, angles),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    calls = parts(dev)
    sweep([{"part": name} for name in calls], lambda s: calls[s["part"]],
          lambda fn, s: host_us_samples(fn, dev, calls=500, warmup=50), args.out, value="host_us",
          desc="text RoPE host time")


if __name__ == "__main__":
    main()
