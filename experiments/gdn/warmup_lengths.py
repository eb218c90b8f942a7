"""How long the bounded warm-ups of the long-document design would be (`dsfuse.gdn.chunk_maps.warmup_starts`,
`notes/long-document-split.md`, "Next: a warm-up cut where a bound proves the rest negligible") for
the experiment's gates: drawn as `dsfuse.bench.gdn.make_inputs` draws them (the model's
initialisation: ``A_log = log U(1, 16)``, ``softplus(dt_bias) = dt``, ``dt`` log-uniform in
[1e-3, 1e-1], projections ``N(0, 1)``), on the CPU, so not the GPU runs' draws. One document of
``T`` tokens cut into segments of 128 chunks (`dsfuse.gdn.split.RULE`'s), the cut at ``2^-24``.

For each (tokens, value heads, seed, segment, value head) it writes the warm-up's length in chunks
and whether it reaches the document's start (then it walks from the true initial state).

    python experiments/gdn/warmup_lengths.py OUT_DIR [--seeds 4]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "kernels")]

from dsfuse.gdn import gdn_gates  # noqa: E402
from dsfuse.gdn.chunk_maps import LOG_BOUND, warmup_starts  # noqa: E402
from dsfuse.gdn.split import RULE  # noqa: E402

CHUNK = 64


def rows(tokens: int, value_heads: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    a_log = (torch.rand(value_heads, generator=gen) * 15 + 1).log()
    dt = (torch.rand(value_heads, generator=gen) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    a, b = (torch.randn(1, tokens, value_heads, generator=gen) for _ in range(2))
    g = gdn_gates(a, b, a_log, dt_bias)[0][0].double()  # [T, HV]
    decay = g.view(-1, CHUNK, value_heads).sum(1)  # [NC, HV]: each chunk's log decay
    segment = RULE.segment
    starts = list(range(segment, decay.shape[0], segment))
    first = warmup_starts(decay, starts, LOG_BOUND)
    return [dict(tokens=tokens, value_heads=value_heads, seed=seed, segment=i + 1, head=j,
                 dt=float(dt[j]), a=float(a_log[j].exp()), warmup_chunks=s - int(first[i, j]),
                 from_start=int(first[i, j]) == 0)
            for i, s in enumerate(starts) for j in range(value_heads)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    table = pd.DataFrame([r for t in (32768, 131072) for hv in (48, 32) for seed in range(args.seeds)
                          for r in rows(t, hv, seed)])
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "warmups.csv", index=False)
    summary = table.groupby(["tokens", "value_heads"]).agg(
        pairs=("warmup_chunks", "size"), from_start=("from_start", "mean"),
        median=("warmup_chunks", "median"), p90=("warmup_chunks", lambda x: x.quantile(0.9)),
        longest=("warmup_chunks", "max"))
    print(summary.to_string(float_format="{:.2f}".format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
