"""Where the fused backward's per-chunk kernel spends its time: the same kernel compiled with one part
left out at a time (timing only: the variants' outputs are wrong and not checked).

    python experiments/gdn/explored/chunk_bwd_ablation/chunk_bwd_ablation.py OUT_DIR \
        [--config experiments/gdn/configs/h200-bwd-pair.yaml] [--cases 2] [--samples 5] [--variants base,no_dv]

Each variant is `dsfuse.gdn.cutedsl.chunk_bwd.ChunkBackward` traced with some of the functions it
calls replaced by ones that emit nothing (patched for the trace only, then restored):

- ``base``: as shipped;
- ``no_prefetch``: no L2 prefetch of the next wave's rows;
- ``no_loads``: no loads of the chunk's rows, states or factors (the products run on whatever
  shared memory holds; since the states came by TMA, no wait for them either), and no prefetch;
- ``no_sum``: no sum over the cluster (the cluster's barriers stay), so no dq, dk stores;
- ``no_cluster``: no sum, no cluster barrier and no signal of the partials (since `efe84d1` an
  mbarrier's);
- ``no_dv``: no dv stores;
- ``local_sum``: the cluster's sum as shipped, but every "peer" load goes to the CTA's own shared
  memory (``map_dsmem_ptr`` made the identity: the same ``ld.shared::cluster`` instructions, no
  traffic between SMs), which tells the network's part of the sum from the rest of it.

The difference to ``base`` bounds what making that part free could save; the parts overlap, so the
differences do not add up. Inputs from `dsfuse.bench.gdn.fused_backward_inputs` (the CuTe DSL
forward saving the states, then the reverse chain), each variant replayed from a CUDA Graph with the
L2 overwritten before each call; ``samples.csv`` and ``env.json`` under OUT_DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, graph_part_rows, start_run, write_part_medians

FLUSH_BYTES = 256 << 20


def _nothing(*args, **kwargs) -> None:
    return None


def _own(ptr, rank, **kwargs):
    return ptr


def variants() -> dict[str, list[tuple]]:
    """Each variant's ``(owner, attribute)`` pairs to replace by `_nothing` while it is traced, or
    ``(owner, attribute, replacement)``."""
    from cutlass import cute
    from dsfuse.gdn.cutedsl import chunk, chunk_bwd

    cls = chunk_bwd.ChunkBackward
    loads = [(chunk, "start_prepared_rows"), (chunk, "start_rows"), (cls, "_start_states"), (cls, "_states_landed"),
             (cls, "_prefetch_ahead")]
    return {"base": [], "no_prefetch": [(cls, "_prefetch_ahead")], "no_loads": loads,
            "no_sum": [(cls, "_cluster_sum")],
            "no_cluster": [(cls, "_cluster_sum"), (cls, "_partials_stored"), (cls, "_partials_arrived"),
                           (cute.arch, "cluster_arrive"), (cute.arch, "cluster_arrive_relaxed"),
                           (cute.arch, "cluster_wait")],
            "no_dv": [(chunk_bwd, "store_rows_scaled")],
            "local_sum": [(cute.arch, "map_dsmem_ptr", _own)]}


@contextlib.contextmanager
def patched(pairs):
    saved = [(owner, name, getattr(owner, name)) for owner, name, *_ in pairs]
    try:
        for owner, name, *value in pairs:
            setattr(owner, name, value[0] if value else _nothing)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def case_rows(case, timer: Timer, samples: int, device: torch.device, names: list[str]) -> list[dict]:
    from dsfuse.gdn.cutedsl import chunk_bwd

    p = case.params
    s = gdn.fused_backward_inputs(case, device)
    q, k, v, g, beta, hv, dim = s["q"], s["k"], s["v"], s["g"], s["beta"], p["value_heads"], p["head_dim"]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    ahead = chunk_bwd._clusters_at_once(device, hv // p["heads"])
    args = (q, k, v, s["do"], s["a_round"], s["factors"], s["states"].view(-1, hv, dim), s["dstates"].view(-1, hv, dim),
            s["ci"], dq, dk, dv, dg, dbeta, torch.ones(s["ci"].shape[0], hv, dtype=torch.int32, device=device),
            torch.arange(s["ci"].shape[0], dtype=torch.int32, device=device), float(s["scale"]), ahead, 0)
    l2 = s["l2"]
    parts = []
    for name, pairs in variants().items():
        if name not in names:
            continue
        with patched(pairs):
            fn = chunk_bwd.compile_chunk_backward(q.dtype, p["heads"], hv, dim, dim, l2, "sm_90a")
        parts.append((name, lambda fn=fn: fn(*args)))
    torch.cuda.synchronize(device)
    return graph_part_rows(parts, timer, samples, device, case=case.name, tokens=p["tokens"], value_heads=hv,
                           l2norm=l2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--config", default="experiments/gdn/configs/h200-bwd-pair.yaml", help="experiment config")
    parser.add_argument("--samples", type=int, default=5, help="timed replays per variant (default 5)")
    parser.add_argument("--cases", type=int, default=None, help="only the config's first CASES cases")
    parser.add_argument("--variants", default=None, help="comma-separated variants to time (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("chunk_bwd_ablation.py needs a CUDA GPU: run it on the GPU machine.", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    config = start_run(args.out, args.config, device, gdn.OP)
    timer = Timer(device, FLUSH_BYTES)
    cases = gdn.cases(config | {"modes": ["fwd+bwd"]})[: args.cases]
    names = args.variants.split(",") if args.variants else list(variants())
    if unknown := sorted(set(names) - set(variants())):
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(variants())}")
    rows = [row for case in cases for row in case_rows(case, timer, args.samples, device, names)]
    write_part_medians(args.out, rows, args.samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
