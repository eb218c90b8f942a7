"""Gated DeltaNet on the GPU: what each of the forward's two changes for few long documents is worth,
alone and together, in a CUDA Graph and eagerly.

    python experiments/gdn/long_forward_probe.py OUT_DIR [--config experiments/gdn/configs/h200-long-cutedsl.yaml]
        [--samples 8]

For each one-document case of the config (forward, its value heads, L2 norm on): `chunk_gdn`'s
forward on the CuTe DSL backend without autograd, in the variants set through
`dsfuse.gdn.cutedsl.forward` (the same bits in all: checked before timing): ``plain`` (whole
chains, the inverse then the chain), ``halves`` (`column_parts`' rule), ``pieces`` (the chain in
pieces after their chunks' inverse, `pieces`; eagerly too, through ``Overlap(eager=True)``),
``both``, and ``default`` (the module's settings as they are). Each timed replayed from a CUDA
Graph and called eagerly, the L2 evicted before each sample (`dsfuse.bench.harness.Timer`). Writes
``samples.csv`` (case, variant, clock, sample, us) and ``env.json`` under OUT_DIR and prints the
medians.
"""

from __future__ import annotations

import sys

import torch
from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, start_probe, variant_rows, write_csv

DEFAULT_CONFIG = "experiments/gdn/configs/h200-long-cutedsl.yaml"


def variants(forward):
    whole = lambda *args: 1  # noqa: E731
    return {"plain": (whole, forward.Overlap(0)), "halves": (forward.column_parts, forward.Overlap(0)),
            "pieces": (whole, forward.Overlap(eager=True)), "both": (forward.column_parts, forward.Overlap(eager=True)),
            "default": (forward.column_parts, forward.OVERLAP)}


def case_rows(case, timer: Timer, samples: int, device: torch.device) -> list[dict]:
    from dsfuse.gdn import chunk_gdn
    from dsfuse.gdn.cutedsl import forward

    p = case.params
    x = gdn.make_inputs(case, device, seed=0)
    q, k, v = gdn.split_views(x["row"], p["heads"], p["value_heads"])

    def run():
        return chunk_gdn(q, k, v, x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
                         cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=True, backend="cutedsl")

    saved = forward.column_parts, forward.OVERLAP
    rows, first = [], None
    try:
        for name, (parts, overlap) in variants(forward).items():
            forward.column_parts, forward.OVERLAP = parts, overlap
            with torch.no_grad():
                got, found = variant_rows(run, first, f"{case.name}: {name}", timer, samples, device,
                                          case=case.name, variant=name)
            first = got if first is None else first
            rows += found
    finally:
        forward.column_parts, forward.OVERLAP = saved
    return rows


def main(argv=None) -> int:
    import pandas as pd

    args, device, config, timer = start_probe(__doc__, DEFAULT_CONFIG, 8, "gdn", argv)
    rows = []
    for case in gdn.cases(config | {"modes": ["fwd"], "document_counts": [1]}):
        rows += case_rows(case, timer, args.samples, device)
        torch.cuda.empty_cache()
    write_csv(args.out / "samples.csv", rows)
    table = pd.DataFrame(rows).groupby(["case", "clock", "variant"], sort=False)["us"].median().unstack("variant")
    print(f"median us per forward, L2 evicted ({args.samples} samples)")
    print(table.round(1).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
