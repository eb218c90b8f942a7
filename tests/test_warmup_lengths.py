"""experiments/gdn/warmup_lengths.py on a short document: each segment's warm-up is the shortest run of
chunks before it whose log decay reaches the bound, read back from the chunk decays the script used."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_warm_up_lengths_are_the_shortest_runs_that_reach_the_bound():
    from dsfuse.gdn.chunk_maps import LOG_BOUND

    spec = importlib.util.spec_from_file_location("warmup_lengths", ROOT / "experiments/gdn/warmup_lengths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokens = 3 * 128 * 64  # three segments of 128 chunks: two starts, four heads
    rows = module.rows(tokens, 4, seed=1)
    decay, starts, _, _, _ = module.segment_warmups(tokens, 4, seed=1)
    assert starts == [128, 256] and decay.shape == (384, 4)
    assert [(r["segment"], r["head"]) for r in rows] == [(s, h) for s in (1, 2) for h in range(4)]
    assert not all(r["from_start"] for r in rows)  # some runs are cut: the check below has work
    for r in rows:
        start, n, h = 128 * r["segment"], r["warmup_chunks"], r["head"]
        assert 1 <= n <= start and r["from_start"] == (n == start)
        if not r["from_start"]:
            assert decay[start - n:start, h].sum() <= LOG_BOUND < decay[start - n + 1:start, h].sum()
