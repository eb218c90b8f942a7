"""Gated DeltaNet on the GPU: would splitting each chain's value channels between CTAs shorten the
forward's chain at few long documents? The question asked before the kernels took ``parts``.

    python experiments/gdn/column_split_probe.py OUT_DIR [--config experiments/gdn/configs/h200-long-cutedsl.yaml]
        [--samples 6]

The state's columns (value channels) evolve independently: every product of the chain reduces over
K or over a chunk's tokens, never over V. So a value head of V = 128 channels can walk as two chains
of 64 channels each, twice the CTAs for the same chunk count. The existing ``head_ws`` kernel
(V = 64 or 128) can run that today on a view: ``v``, ``o`` and the saved states ``[.., HV, 128]`` are
``[.., 2 HV, 64]`` without a copy (head ``2 hv + p`` is channels ``64 p ..``); the per-head inputs
(``round(A)``, the factors, the gates) are repeated per half (a copy, outside the timing: a kernel
that took the split would index them by ``hv`` instead, as `dsfuse.gdn.cutedsl.fused_fwd.COLUMN_PARTS`
now does), and the initial and final states permuted.

For each case of the config (its document counts and value heads, L2 norm on): the preparing UT
inverse alone, then the chain kernel as `chunk_gdn` runs it (``head_rs``, V = 128) and the two
forms on halves (``head_ws`` at V = 128 for reference, ``head_ws`` on 2 HV heads of 64), each
saving the states as a training forward does; each replayed from a CUDA Graph with the L2 evicted.
Before timing: the halves' ``o``, final state and saved states against ``head_rs``'s, bit for bit
(printed, and in ``bits.csv``). Writes ``samples.csv`` and ``env.json`` under OUT_DIR.
"""

from __future__ import annotations

import sys

import torch
from dsfuse.bench import gdn
from dsfuse.bench.harness import (
    Timer,
    bits,
    graph_part_rows,
    start_probe,
    write_csv,
    write_part_medians,
)

DEFAULT_CONFIG = "experiments/gdn/configs/h200-long-cutedsl.yaml"
PARTS = 2  # value channels 128 = 2 x 64


def halves(x: torch.Tensor, dim: int) -> torch.Tensor:
    """A per-head tensor repeated for both halves of each value head (head ``hv`` -> ``2 hv``, ``2 hv + 1``)."""
    return x.repeat_interleave(PARTS, dim=dim).contiguous()


def case_rows(case, timer: Timer, samples: int, device: torch.device) -> tuple[list[dict], list[dict]]:
    from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward
    from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse
    from dsfuse.gdn.reference import prepare_chunk_indices, prepare_chunk_offsets
    from dsfuse.gdn.schedule import document_order

    p = case.params
    x = gdn.make_inputs(case, device, seed=0)
    q, k, v = (t[0] for t in gdn.split_views(x["row"], p["heads"], p["value_heads"]))
    hv, d, bounds = p["value_heads"], p["head_dim"], p["bounds"]
    n, tokens = len(bounds) - 1, p["tokens"]
    ci = prepare_chunk_indices(bounds).to(device=device, dtype=torch.int32).contiguous()
    co = prepare_chunk_offsets(bounds).to(device=device, dtype=torch.int32).contiguous()
    order = torch.tensor(document_order(bounds), device=device, dtype=torch.int32)
    g, beta, h0 = x["g"][0].contiguous(), x["beta"][0].contiguous(), x["initial_state"].contiguous()
    g_cum = torch.empty_like(g)
    a_round = torch.empty(tokens, hv, 64, device=device, dtype=k.dtype)
    factors = torch.empty(ci.shape[0] * len(FACTORS), hv, 64, device=device)
    scale = d**-0.5

    def inverse():
        launch_ut_inverse(k, beta, ci, None, use_qk_l2norm=True, g=g, g_cum=g_cum, q=q, a_round=a_round,
                          factors=factors)

    inverse()
    nc = ci.shape[0]
    whole = dict(o=torch.empty(tokens, hv, d, device=device, dtype=v.dtype), ht=torch.empty_like(h0),
                 states=torch.empty(nc, d, hv, d, device=device, dtype=v.dtype))
    ws = {name: torch.empty_like(t) for name, t in whole.items()}

    def chain(form: str, out: dict):
        launch_fused_forward(q, k, v, g, beta, None, ci, co, order, h0, out["ht"], out["o"], scale, use_qk_l2norm=True,
                             form=form, g_cum=g_cum, a_round=a_round, factors=factors, states=out["states"])

    # the halves: head 2 hv + p is channels [64 p, 64 p + 64) of head hv
    split = dict(o=torch.empty_like(whole["o"]), states=torch.empty_like(whole["states"]),
                 ht=torch.empty(n, PARTS * hv, d, d // PARTS, device=device))
    h0_split = h0.unflatten(-1, (PARTS, -1)).transpose(2, 3).flatten(1, 2).contiguous()
    g2, beta2, g_cum2 = halves(g, 1), halves(beta, 1), halves(g_cum, 1)
    a_round2, factors2 = halves(a_round, 1), halves(factors, 1)

    def chain_split():
        launch_fused_forward(q, k, v.unflatten(-1, (PARTS, -1)).flatten(1, 2), g2, beta2, None, ci, co, order,
                             h0_split, split["ht"], split["o"].view(tokens, PARTS * hv, -1), scale,
                             use_qk_l2norm=True, form="head_ws", g_cum=g_cum2, a_round=a_round2, factors=factors2,
                             states=split["states"].view(nc, d, PARTS * hv, -1))

    chain("head_rs", whole)
    chain("head_ws", ws)
    chain_split()
    torch.cuda.synchronize(device)
    ht_split = split["ht"].unflatten(1, (hv, PARTS)).transpose(2, 3).flatten(-2)
    bit_rows = []
    for name, got in (("head_ws", ws), ("head_ws_halves", {**split, "ht": ht_split})):
        for t in ("o", "ht", "states"):
            differ = int((bits(got[t]) != bits(whole[t])).sum())
            bit_rows.append(dict(case=case.name, form=name, tensor=t, elements=got[t].numel(), differ=differ))
            print(f"{case.name} {name} {t}: {differ} of {got[t].numel()} elements differ from head_rs")
    parts = [("inverse", inverse), ("head_rs", lambda: chain("head_rs", whole)), ("head_ws", lambda: chain("head_ws", ws)),
             ("head_ws_halves", chain_split)]
    rows = graph_part_rows(parts, timer, samples, device, case=case.name, tokens=tokens, documents=n, value_heads=hv)
    return rows, bit_rows


def main(argv=None) -> int:
    args, device, config, timer = start_probe(__doc__, DEFAULT_CONFIG, 6, "gdn", argv)
    rows, bit_rows = [], []
    for case in gdn.cases(config | {"modes": ["fwd"]}):
        got, got_bits = case_rows(case, timer, args.samples, device)
        rows += got
        bit_rows += got_bits
        torch.cuda.empty_cache()
    write_csv(args.out / "bits.csv", bit_rows)
    write_part_medians(args.out, rows, args.samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
