"""Is the fused-trig in-place RoPE bitwise equal to the model, and how fast? (GPU)

    python experiments/text_rope/explored/fused_trig/probe.py OUT_DIR

1. Bitwise: q [1, 4096, 64, 512] bf16 (random values, and a block of special values) rotated in place
   by the model's form (``apply_rotary_emb_`` with ``torch.polar`` frequencies) and by this kernel, for
   the model's angles (positions x YaRN frequencies) and for special angles (+-0, +-inf, NaN, 1e30,
   denormals, multiples of pi), forward and conjugate. Writes ``bitwise.csv``.
2. Time (CUDA Graph replay, L2 overwritten before each, 30 samples): the shipped API
   (``apply_rope(q, angles, inplace=True)``: fill + polar + rotation), the shipped kernel alone on
   precomputed frequencies, and this kernel over head blocks and warps. Writes ``times.csv``.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fused_trig import rope_angles_inplace  # noqa: E402

from dsfuse.bench.harness import Timer, capture_graph, write_csv  # noqa: E402
from dsfuse.text_rope import apply_rope, rope_angles, yarn_inv_freq  # noqa: E402
from dsfuse.text_rope import triton as rope_triton  # noqa: E402
from dsfuse.text_rope.reference import apply_rotary_emb_, rope_freqs  # noqa: E402


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    shape = (1, 4096, 64, 512)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(shape, device=dev, generator=gen).bfloat16()
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3e38, -1.0], device=dev)
    q[0, :8, :4, -64:] = specials.bfloat16().repeat(8 * 4 * 64 // specials.numel()).view(8, 4, 64)
    positions = torch.arange(shape[1], device=dev)
    inv_freq = yarn_inv_freq(64, 160000.0, factor=16, original_max_position=65536)  # the model's YaRN layers
    model = rope_angles(positions, inv_freq)[None].contiguous()  # [1, S, 32]
    special = model.clone()
    vals = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 1e-40, -1e-40,
                         3.14159265, 6.2831853, 1e4, 12345.678, -7.5, 1e-8, 2.0**20], device=dev)
    special[0, : vals.numel(), :] = vals[:, None]
    rows = []
    for name, angles in (("model", model), ("special", special)):
        for conj in (False, True):
            want = q.clone()
            apply_rotary_emb_(want[..., -64:], rope_freqs(angles), inverse=conj)
            got = rope_angles_inplace(q.clone(), angles, conj=conj)
            diff = (got.view(torch.int16) != want.view(torch.int16))
            rows.append(dict(angles=name, conj=conj, elements=diff.numel(), differing=int(diff.sum())))
            # the trig alone: libdevice vs torch.polar
    write_csv(out / "bitwise.csv", rows)
    print(rows)

    timer = Timer(dev, 256 << 20)
    freqs = torch.view_as_real(rope_freqs(model))
    variants = {"api_inplace (fill + polar + rotation)": lambda: apply_rope(q, model, inplace=True, backend="triton"),
                "kernel_only (precomputed freqs)": lambda: rope_triton.launch_rope(q, freqs, q, conj=False, copy=False)}
    for block_h in (16, 32, 64):
        for warps in (2, 4, 8):
            variants[f"fused_trig h{block_h} w{warps}"] = (
                lambda block_h=block_h, warps=warps: rope_angles_inplace(q, model, block_h=block_h, num_warps=warps))
    times = []
    for name, fn in variants.items():
        fn()
        graph, _ = capture_graph(lambda fn=fn: (fn(),), dev)
        times += [dict(variant=name, sample=i, us=us) for i, us in enumerate(timer.samples(graph.replay, "evicted", 30, 1))]
        del graph
    write_csv(out / "times.csv", times)
    import pandas as pd

    print(pd.DataFrame(times).groupby("variant", sort=False)["us"].median().round(2).to_string())


if __name__ == "__main__":
    main()
