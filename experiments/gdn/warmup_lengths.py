"""How long the bounded warm-ups of the long-document design would be (`dsfuse.gdn.chunk_maps.warmup_starts`,
`notes/long-document-split.md`, "Next: a warm-up cut where a bound proves the rest negligible") for
the experiment's gates: `dsfuse.bench.gdn.model_gates`, as `make_inputs` draws them (the model's
initialisation), on the CPU, so not the GPU runs' draws. One document of
``T`` tokens cut into segments of 128 chunks (`dsfuse.gdn.split.RULE`'s), the cut at ``2^-24``.

For each (tokens, value heads, seed, segment, value head) it writes the warm-up's length in chunks
and whether it reaches the document's start (then it walks from the true initial state).

    python experiments/gdn/warmup_lengths.py OUT_DIR [--seeds 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "kernels")]

from dsfuse.bench.gdn import model_gates  # noqa: E402
from dsfuse.gdn.chunk_maps import LOG_BOUND, warmup_starts  # noqa: E402
from dsfuse.gdn.split import RULE, segment_offsets  # noqa: E402

CHUNK = 64


def segment_warmups(tokens: int, value_heads: int, seed: int):
    """``(decay, starts, first, a_log, dt)``: each chunk's log decay ``[NC, HV]``, the segments'
    first chunks after the document's first segment (`dsfuse.gdn.split.RULE`), their warm-ups'
    first chunks ``[S, HV]`` (`warmup_starts`), and the gates' parameters."""
    g, _, a_log, dt = model_gates(tokens, value_heads, torch.Generator().manual_seed(seed), torch.device("cpu"))
    decay = g[0].double().view(-1, CHUNK, value_heads).sum(1)
    starts = segment_offsets([0, decay.shape[0]], RULE)[0][1:-1]
    return decay, starts, warmup_starts(decay, starts, LOG_BOUND), a_log, dt


def rows(tokens: int, value_heads: int, seed: int) -> list[dict]:
    decay, starts, first, a_log, dt = segment_warmups(tokens, value_heads, seed)
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
