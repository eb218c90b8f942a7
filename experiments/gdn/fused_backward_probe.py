"""Gated DeltaNet on the GPU: the time of the CuTe DSL fused backward's kernels, beside the Triton
backward stages they replace, at the experiment's shape.

    python experiments/gdn/fused_backward_probe.py OUT_DIR [--config experiments/gdn/configs/h200-fwd.yaml]
        [--samples 10]

For each case of the config (its tokens, documents, value heads and L2 norm settings; q, k, v head
views of one packed row, initial state, dO and the final state's gradient): the preparing UT inverse
(``ut_inverse_prepare``: ``round(A Gamma)`` and the rows' factors, which the backward reads), the
reverse state chain (``state_bwd``, `dsfuse.gdn.cutedsl.state_bwd`: ``round(dS')`` of every chunk
and ``dh0``), and the Triton backward's stages it replaces or makes unnecessary (``triton_dv_local``,
``triton_state_backward``: the intra-chunk part of dv_new and the reverse state pass; and
``triton_recompute_h``, which the saved forward states make unnecessary), each replayed from a
CUDA Graph with the L2 overwritten before each call (`dsfuse.bench.harness.Timer`, evicted regime),
after one whole Triton forward and backward on the same inputs. Before timing, the chain's ``dh0``
is checked against the Triton backward's (relative RMS <= 1e-2: two approximations of one float64
result; the float64 checks of ``dh0`` and of every ``round(dS')`` are the GPU tests'). Writes
``samples.csv`` (case, tokens, value heads, l2norm, part, sample, us) and ``env.json`` under
OUT_DIR and prints the medians.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from dsfuse.bench import env as env_mod
from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, capture_graph, load_config, rel_rms, write_csv
from dsfuse.bench.paths import cli_path

DEFAULT_CONFIG = "experiments/gdn/configs/h200-fwd.yaml"
FLUSH_BYTES = 256 << 20


def case_rows(case, timer: Timer, samples: int, device: torch.device) -> list[dict]:
    from dsfuse.gdn import schedule
    from dsfuse.gdn.cutedsl.state_bwd import launch_state_backward
    from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse
    from dsfuse.gdn.packed import packed_grad_row
    from dsfuse.gdn.triton import BACKWARD, FORWARD

    p = case.params
    x = gdn.make_inputs(case, device, seed=0)
    q, k, v = gdn.split_views(x["row"], p["heads"], p["value_heads"])
    l2, scale = p["l2norm"], p["head_dim"] ** -0.5
    common = dict(scale=scale, initial_state=x["initial_state"], cu_seqlens=p["bounds"], use_qk_l2norm=l2)
    fwd_calls, out = schedule.stage_calls(FORWARD, q, k, v, x["g"], x["beta"], output_final_state=True, **common)
    for _, launch in fwd_calls:
        launch()
    _, dq, dk, dv = packed_grad_row(q, k, v)
    bwd_calls, grads = schedule.backward_calls(BACKWARD, q, k, v, x["beta"], out.g_cum, out.A, x["do"], x["dht"],
                                               dq=dq, dk=dk, dv=dv, **common)
    wanted = {"recompute h", "dv_local", "state backward"}
    for name, launch in bwd_calls:
        launch()
    table = schedule.chunk_table(p["bounds"], device)
    ci, co, order = table.indices, table.offsets, table.order
    tokens, hv, dim = q.shape[1], p["value_heads"], p["head_dim"]
    q_, k_, do_ = q[0], k[0], x["do"][0]
    g_, beta_ = x["g"][0], x["beta"][0]

    a_round = torch.empty(tokens, hv, 64, device=device, dtype=q.dtype)
    factors = torch.empty(ci.shape[0] * len(FACTORS), hv, 64, device=device)
    g_cum = torch.empty_like(g_)
    dstates = torch.empty(ci.shape[0], dim, hv, dim, device=device, dtype=q.dtype)
    dh0 = torch.empty_like(x["dht"])

    def inverse():
        launch_ut_inverse(k_, beta_, ci, None, use_qk_l2norm=l2, g=g_, g_cum=g_cum, q=q_, a_round=a_round,
                          factors=factors)

    def chain():
        launch_state_backward(q_, k_, do_, a_round, factors, ci, co, order, x["dht"], dh0, dstates, scale,
                              use_qk_l2norm=l2)

    inverse()
    chain()
    torch.cuda.synchronize(device)
    err = rel_rms(dh0, grads.dh0)
    if not err <= 1e-2:
        raise AssertionError(f"{case.name}: the chain's dh0 differs from the Triton backward's: {err:.2e}")
    print(f"{case.name}: state_bwd dh0, relative RMS against the Triton backward: {err:.1e}")

    parts = [("ut_inverse_prepare", inverse), ("state_bwd", chain)]
    parts += [(f"triton_{name.replace(' ', '_')}", launch) for name, launch in bwd_calls if name in wanted]
    rows = []
    for part, fn in parts:
        graph, _ = capture_graph(lambda fn=fn: (fn(),), device)
        for i, us in enumerate(timer.samples(graph.replay, "evicted", samples, 1)):
            rows.append({"case": case.name, "tokens": p["tokens"], "value_heads": hv, "l2norm": l2, "part": part,
                         "sample": i, "us": us})
        del graph
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"experiment config (default {DEFAULT_CONFIG})")
    parser.add_argument("--samples", type=int, default=10, help="timed replays per part (default 10)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_backward_probe.py needs a CUDA GPU: run it on the GPU machine.", file=sys.stderr)
        return 2
    import pandas as pd

    device = torch.device("cuda")
    config = load_config(cli_path(args.config))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "env.json").write_text(json.dumps(env_mod.collect(device, op=gdn.OP), indent=2) + "\n")
    timer = Timer(device, FLUSH_BYTES)
    rows = [row for case in gdn.cases(config | {"modes": ["fwd+bwd"]})
            for row in case_rows(case, timer, args.samples, device)]
    write_csv(args.out / "samples.csv", rows)
    table = pd.DataFrame(rows).groupby(["case", "part"], sort=False)["us"].median().unstack("part")
    print(f"median us per call, CUDA Graph replay, L2 evicted ({args.samples} samples)")
    print(table.round(1).to_string())
    print(f"wrote {args.out / 'samples.csv'}, {args.out / 'env.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
