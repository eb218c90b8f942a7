"""experiments/gdn/warmup_lengths.py on a short document: each segment's warm-up is the shortest run of
chunks before it whose log decay reaches the bound (recomputed here from the same gates)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_warm_up_lengths_are_the_shortest_runs_that_reach_the_bound():
    spec = importlib.util.spec_from_file_location("warmup_lengths", ROOT / "experiments/gdn/warmup_lengths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.rows(3 * 128 * 64, 4, seed=1)  # three segments of 128 chunks: two starts, four heads
    assert [(r["segment"], r["head"]) for r in rows] == [(s, h) for s in (1, 2) for h in range(4)]
    for r in rows:
        start, n = 128 * r["segment"], r["warmup_chunks"]
        assert 1 <= n <= start and r["from_start"] == (n == start)
    assert not all(r["from_start"] for r in rows)  # some runs are cut: the check below has work
    # the same gates again: the decay of the run, and of the run one chunk shorter, against the bound
    import math

    import torch

    from dsfuse.gdn import gdn_gates
    from dsfuse.gdn.chunk_maps import LOG_BOUND

    gen = torch.Generator().manual_seed(1)
    a_log = (torch.rand(4, generator=gen) * 15 + 1).log()
    dt = (torch.rand(4, generator=gen) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).exp()
    a, b = (torch.randn(1, 3 * 128 * 64, 4, generator=gen) for _ in range(2))
    g = gdn_gates(a, b, a_log, dt + torch.log(-torch.expm1(-dt)))[0][0].double()
    decay = g.view(-1, 64, 4).sum(1)
    for r in rows:
        start, n, h = 128 * r["segment"], r["warmup_chunks"], r["head"]
        if not r["from_start"]:
            assert decay[start - n:start, h].sum() <= LOG_BOUND < decay[start - n + 1:start, h].sum()
