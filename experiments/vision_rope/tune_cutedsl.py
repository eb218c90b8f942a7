"""Sweep the CuTe DSL vision RoPE backward's tile width and heads per CTA.

    python experiments/vision_rope/tune_cutedsl.py OUT.csv [--tokens T ...]

For each (TILE_BYTES, HEADS_PER_CTA) of ``dsfuse.vision_rope.cutedsl`` the kernel is compiled,
checked bitwise against the eager formula once, then timed by CUDA Graph replay with the L2
overwritten before each call, on the model's layouts (16 heads x 64, bf16, dK stored [H, D, T]).
The Triton backward at its shipped constants and a plain elementwise copy of the same number of
bytes (``copy-same-bytes``: the bandwidth a ~100 MB pass can reach) are timed alongside.
``dsfuse.bench.harness.sweep`` writes one CSV row per sample (a setting that fails is a row with
its error, e.g. one whose staged tiles exceed the shared memory); the defaults in
dsfuse/vision_rope/cutedsl.py should come from here.
"""

import argparse
import functools

import torch
from tune_blocks import DIM, HEADS, problem  # the Triton sweep's inputs, same seeds (dK: p["dk"]["hdt"])

from dsfuse.bench.harness import Timer, capture_graph, sweep
from dsfuse.vision_rope.triton import kernels as vr_triton

TILE_BYTES, HEADS_PER_CTA = (64, 128), (1, 2, 4)


def settings(tokens_list: list[int]) -> list[dict]:
    out = []
    for tokens in tokens_list:
        row = {"tile_bytes": 0, "heads_per_cta": 0, "tokens": tokens, "regime": "evicted"}
        out.append({**row, "kernel": "copy-same-bytes"})
        out.append({**row, "kernel": "triton"})
        out += [{**row, "kernel": "cutedsl", "tile_bytes": tile, "heads_per_cta": heads}
                for tile in TILE_BYTES for heads in HEADS_PER_CTA]
    return out


def build(s: dict):
    """The CUDA Graph of one setting, after checking the backward bitwise (the copy is not checked)."""
    from dsfuse.vision_rope.cutedsl import kernels as vr_cutedsl

    p = problem(s["tokens"])
    dev = p["out"].device
    if s["kernel"] == "copy-same-bytes":  # elementwise, not a memcpy: a captured memcpy may use a copy engine
        return capture_graph(lambda: (torch.neg(p["src"], out=p["dst"]),), dev)[0]
    args = (p["dq"], p["dk"]["hdt"], p["dv"], p["cos"], p["sin"], p["out"])
    if s["kernel"] == "triton":
        run = functools.partial(vr_triton.launch_backward, *args)
    else:
        geo = vr_cutedsl.geometry(torch.bfloat16, HEADS, DIM, tile_tokens=s["tile_bytes"] // 2,
                                  heads_per_cta=s["heads_per_cta"])
        fn = vr_cutedsl.compile_backward(torch.bfloat16, HEADS, DIM, True, vr_cutedsl._arch(dev), geo=geo)
        call = (p["dq"], p["dk"]["hdt"].transpose(1, 2), p["dv"], p["cos"], p["sin"], p["out"])  # [H, D, T] storage
        run = functools.partial(fn, *call)
    p["out"].fill_(float("nan"))
    run()
    if not torch.equal(p["out"].view(torch.int16), p["want"].view(torch.int16)):
        raise AssertionError(f"{s}: not bitwise")
    return capture_graph(lambda: (run(),), dev)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8649, 1521], help="image tokens (default 8649 1521)")
    args = parser.parse_args()
    timer = Timer(torch.device("cuda"), 256 << 20)
    sweep(settings(args.tokens), build, lambda graph, s: timer.samples(graph.replay, s["regime"], 20, 20),
          args.out, desc="vision RoPE CuTe DSL tiles")


if __name__ == "__main__":
    main()
