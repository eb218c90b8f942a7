"""experiments/gdn/split_passes_probe.py's variant on the CPU: the split with every pass over every
segment (its ``every``) gives the bits of the split as shipped, forward and backward (the Triton stages
in the interpreter), so the probe times two forms of one computation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_every_segments_passes_give_the_shipped_splits_bits(monkeypatch):
    from dsfuse.gdn import schedule, split
    from dsfuse.gdn.triton import TABLE

    spec = importlib.util.spec_from_file_location("split_passes_probe", ROOT / "experiments/gdn/split_passes_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stages = TABLE.load()["stages"]
    gen = torch.Generator().manual_seed(0)
    t, h, hv, d, cu = 330, 1, 2, 32, [0, 200, 201, 330]  # documents of 4, 1 and 3 chunks of 64
    q, k = (torch.randn(1, t, h, d, generator=gen) for _ in range(2))
    v = torch.randn(1, t, hv, d, generator=gen)
    g = -torch.rand(1, t, hv, generator=gen) * 0.1
    beta = torch.rand(1, t, hv, generator=gen)
    h0, dht = (torch.randn(3, hv, d, d, generator=gen) for _ in range(2))
    do = torch.randn(1, t, hv, d, generator=gen)
    kwargs = {"scale": d**-0.5, "initial_state": h0, "cu_seqlens": cu, "use_qk_l2norm": True, "segment_chunks": 1}

    def run():
        split._cache.clear()
        fwd = schedule.forward(stages.forward, q, k, v, g, beta, output_final_state=True, **kwargs)
        grads = schedule.backward(stages.backward, q, k, v, beta, fwd.g_cum, fwd.A, do, dht, **kwargs)
        return (fwd.o, fwd.final_state, *grads)

    shipped = run()
    monkeypatch.setattr(split, "pass_rows", module.every_segment)
    try:
        every = run()
        assert split.Segments.of([0, 4, 5, 8], 1, torch.device("cpu")).rows["m"].shape[0] == 8  # every segment
    finally:
        split._cache.clear()  # no table of every segment's rows left for the next test
    for name, a, b in zip(("o", "final state", *schedule.Gradients._fields), shipped, every):
        assert torch.equal(a, b), name
