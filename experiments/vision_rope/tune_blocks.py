"""Sweep the vision RoPE backward's tokens per program and warps.

    python experiments/vision_rope/tune_blocks.py OUT.csv [--tokens T ...]

For each (TOKENS_PER_PROGRAM, NUM_WARPS) the fused backward is
checked bitwise against the eager formula once, then timed by CUDA Graph replay
with the L2 overwritten before each call, on the model's layouts (dk stored HDT)
and, as the cost of the transpose, on a dK already in HTD storage. A plain copy of
the same number of bytes is timed alongside (mode ``copy-same-bytes``), since a
~100 MB copy does not reach the 1 GiB copy bandwidth of the main run.
``dsfuse.bench.harness.sweep`` writes one CSV row per sample (a setting that is not
bitwise is a row with its error); the chosen constants in dsfuse/vision_rope/triton.py
come from here. (The files in raw/tuning/ also swept heads per program and the grid
order, options the kernel had at the commits their README names and no longer has:
neither was faster.)
"""

import argparse
import functools

import torch

from dsfuse.bench.harness import Timer, capture_graph, sweep
from dsfuse.vision_rope.triton import kernels as vr_triton
from dsfuse.vision_rope.reference import vision_rope_backward_reference

HEADS, DIM = 16, 64
TOKENS_PER_PROGRAM, WARPS = (16, 32, 64), (1, 2, 4)


@functools.cache
def problem(tokens: int) -> dict:
    """Inputs of the backward at ``tokens`` (dK in both storages), its expected output, and a copy's buffers."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(tokens)
    dq, dv = (torch.randn(HEADS, tokens, DIM, device=dev, generator=gen).bfloat16() for _ in range(2))
    dk_store = torch.randn(HEADS, DIM, tokens, device=dev, generator=gen).bfloat16()  # [H, D, T] storage
    dk_hdt = dk_store.transpose(1, 2)  # [H, T, D] logical, as the kernel reads it
    angles = torch.rand(tokens, DIM // 2, device=dev, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    out = torch.empty(tokens, 3 * HEADS * DIM, device=dev, dtype=torch.bfloat16)
    nbytes = 2 * out.numel() * out.element_size() + 2 * cos.numel() * 4
    src = torch.zeros(nbytes // 8, dtype=torch.float32, device=dev)
    return dict(dq=dq, dv=dv, dk={"hdt": dk_hdt, "htd": dk_hdt.contiguous()}, cos=cos, sin=sin, out=out,
                want=vision_rope_backward_reference(dq, dk_store, dv, cos, sin), src=src, dst=torch.empty_like(src))


def settings(tokens_list: list[int]) -> list[dict]:
    out = []
    for tokens in tokens_list:
        out.append(dict(elements=0, warps=0, mode=f"copy-same-bytes-T{tokens}", regime="evicted", tokens=tokens,
                        layout="copy"))
        out += [dict(elements=block_t, warps=warps, mode=f"T{tokens}-dk_{layout}", regime="evicted", tokens=tokens,
                     layout=layout)
                for block_t in TOKENS_PER_PROGRAM for warps in WARPS for layout in ("hdt", "htd")]
    return out


def build(s: dict):
    """The CUDA Graph of one setting, after checking the backward bitwise (the copy is not checked)."""
    p = problem(s["tokens"])
    dev = p["out"].device
    if s["layout"] == "copy":  # elementwise, not a memcpy: a captured memcpy may run on a (slower) copy engine
        return capture_graph(lambda: (torch.neg(p["src"], out=p["dst"]),), dev)[0]
    vr_triton.TOKENS_PER_PROGRAM, vr_triton.NUM_WARPS = s["elements"], s["warps"]
    dk = p["dk"][s["layout"]]
    p["out"].fill_(float("nan"))
    vr_triton.launch_backward(p["dq"], dk, p["dv"], p["cos"], p["sin"], p["out"])
    if not torch.equal(p["out"].view(torch.int16), p["want"].view(torch.int16)):
        raise AssertionError(f"{s['mode']} block_t={s['elements']} warps={s['warps']}: not bitwise")
    return capture_graph(lambda: (vr_triton.launch_backward(p["dq"], dk, p["dv"], p["cos"], p["sin"], p["out"]),),
                         dev)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8649, 1521], help="image tokens (default 8649 1521)")
    args = parser.parse_args()
    timer = Timer(torch.device("cuda"), 256 << 20)
    defaults = vr_triton.TOKENS_PER_PROGRAM, vr_triton.NUM_WARPS
    try:
        sweep(settings(args.tokens), build, lambda graph, s: timer.samples(graph.replay, s["regime"], 20, 20),
              args.out, desc="vision RoPE blocks")
    finally:
        vr_triton.TOKENS_PER_PROGRAM, vr_triton.NUM_WARPS = defaults


if __name__ == "__main__":
    main()
