"""Gated DeltaNet on the GPU: the Triton stages' split of long documents with its passes spared
against the same split over every segment, paired, in a CUDA Graph and eagerly.

    python experiments/gdn/split_passes_probe.py OUT_DIR [--config experiments/gdn/configs/h200-long.yaml]
        [--samples 8]

For each one-document case of the config (forward and forward + backward, its value heads, L2 norm
on): `chunk_gdn` on the Triton backend (split by `dsfuse.gdn.split.RULE`) in three variants:
``spared`` (as shipped: `dsfuse.gdn.split.pass_rows`, ``E`` over every segment but the last, the
maps over the middle ones beside it on a side stream, the final passes over what the merge leaves,
the first and last segments' outputs written by their first pass), ``spared_in_turn`` (the same
with the map pass before ``E`` on the one stream: `dsfuse.gdn.split.MAPS_BESIDE` off) and ``every``
(`dsfuse.gdn.split.every_segment`: every pass over every segment, the maps and ``E`` in turn: the
split as it ran before, except that its map pass reads no ``u`` and comes first). All give the same
bits (checked before timing, `dsfuse.bench.harness.variant_rows`: o, the final state and every
gradient). Rounds alternate the variants (``--samples`` per variant and round, two rounds), the L2
evicted before each sample (`dsfuse.bench.harness.Timer`).
Writes ``samples.csv`` (case, variant, round, clock, sample, us), ``memory.csv`` (the peak memory a
call allocates above its inputs, `dsfuse.bench.harness.peak_memory_row`, its ``provider`` column the
variant) and ``env.json`` under OUT_DIR and prints the medians.
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import torch
from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, peak_memory_row, start_probe, variant_rows, write_csv

DEFAULT_CONFIG = "experiments/gdn/configs/h200-long.yaml"
ROUNDS = 2


def case_rows(case, timer: Timer, samples: int, device: torch.device) -> tuple[list[dict], list[dict]]:
    from dsfuse.gdn import split

    inputs = gdn.make_inputs(case, device, seed=0)
    build = gdn._build(gdn.split_views, functools.partial(gdn.dsfuse_gdn, backend="triton"))
    variants = {"spared": (split.pass_rows, True), "spared_in_turn": (split.pass_rows, False),
                "every": (split.every_segment, False)}
    shipped = split.pass_rows, split.MAPS_BESIDE
    rows, memory, first = [], [], None
    try:
        for round_ in range(ROUNDS):
            for name, (rule, beside) in variants.items():
                split.pass_rows, split.MAPS_BESIDE = rule, beside
                split._cache.clear()  # the pass rows are made with the segment tables
                run = build(case, inputs)
                if round_ == 0 and (peak := peak_memory_row(case, SimpleNamespace(name=name), run, device)):
                    memory.append(peak)  # the peak a call allocates above its inputs, from a call of its own
                got, found = variant_rows(run, first, f"{case.name}: {name}", timer, samples, device,
                                          case=case.name, variant=name, round=round_)
                first = got if first is None else first
                rows += found
                del got, run
                torch.cuda.empty_cache()
    finally:
        split.pass_rows, split.MAPS_BESIDE = shipped
        split._cache.clear()
    return rows, memory


def main(argv=None) -> int:
    import pandas as pd

    args, device, config, timer = start_probe(__doc__, DEFAULT_CONFIG, 8, "gdn", argv)
    rows, memory = [], []
    for case in gdn.cases(config | {"modes": ["fwd", "fwd+bwd"], "document_counts": [1]}):
        found = case_rows(case, timer, args.samples, device)
        rows += found[0]
        memory += found[1]
        write_csv(args.out / "samples.csv", rows)  # after every case: a run cut short keeps what it finished
        write_csv(args.out / "memory.csv", memory)
    table = pd.DataFrame(rows).groupby(["case", "clock", "variant"], sort=False)["us"].median().unstack("variant")
    for name in ("spared_in_turn", "every"):
        table[f"{name} / spared"] = table[name] / table["spared"]
    print(f"median us, L2 evicted ({args.samples} samples x {ROUNDS} rounds per variant)")
    print(table.round(3).to_string())
    print(pd.DataFrame(memory).round(1).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
