"""Gated DeltaNet forward (Triton stages) on the GPU: FP64 check, determinism, stage times, FLA control.

    python experiments/gdn/forward_check.py OUT_DIR [--tokens 32768] [--check-tokens 4096]

1. Correctness: ``chunk_gdn(backend="triton")`` against the FP64 naive recurrence at
   ``--check-tokens`` tokens in four documents, (H, HV) = (16, 48), bf16, with an initial state,
   L2 norm off and on: relative RMS of ``o`` and the final state (the contract's 0.005).
2. Determinism: ``--repeats`` forwards at the timing shape, bitwise equal outputs.
3. Time (CUDA Graph replay, L2 overwritten before each call) at ``--tokens`` tokens in five
   documents, (16, 48), bf16, L2 norm off and on: the whole forward, each stage alone, and
   flash-linear-attention's ``chunk_gated_delta_rule`` forward when it is installed (its
   output checked against ours in the same run before it is timed).

Writes ``checks.csv``, ``samples.csv`` and ``env.json`` under OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsfuse.bench import env as env_mod
from dsfuse.bench.harness import Timer, bits, capture_graph, write_csv
from dsfuse.bench.harness import rel_rms as relrms
from dsfuse.gdn import chunk_gdn, gdn_gates, naive_recurrent_gdn
from dsfuse.gdn.api import _validate
from dsfuse.gdn.triton import FORWARD as TRITON_FORWARD
from dsfuse.gdn.schedule import stage_calls

HEADS, VALUE_HEADS, DIM = 16, 48, 128
CONTRACT_RELRMS = 0.005


def documents(tokens: int, count: int) -> torch.Tensor:
    """``count`` documents of unequal lengths (none a multiple of 64) filling ``tokens``: int32 cu_seqlens."""
    weights = torch.tensor([0.27, 0.09, 0.34, 0.18, 0.12][:count] or [1.0])
    lengths = (weights / weights.sum() * tokens).long()
    lengths[-1] = tokens - lengths[:-1].sum()
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)


def inputs(tokens: int, docs: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # keys of norm about 1 (as the model's normalised keys): with the L2 norm off, raw randn keys
    # (norm ~ 11) make the delta rule diverge in the reference too
    q, k = randn(1, tokens, HEADS, DIM), randn(1, tokens, HEADS, DIM) * DIM**-0.5
    v = randn(1, tokens, VALUE_HEADS, DIM)
    g, beta = gdn_gates(randn(1, tokens, VALUE_HEADS), randn(1, tokens, VALUE_HEADS),
                        torch.rand(VALUE_HEADS, generator=gen) * 3, randn(VALUE_HEADS))
    cu = documents(tokens, docs)
    h0 = randn(docs, VALUE_HEADS, DIM, DIM) * 0.1
    bf = lambda t: t.to(device=device, dtype=torch.bfloat16)  # noqa: E731
    return dict(q=bf(q), k=bf(k), v=bf(v), g=g.float().to(device), beta=bf(beta), initial_state=h0.to(device),
                cu_seqlens=cu)


def check_against_fp64(tokens: int) -> list[dict]:
    rows = []
    for l2 in (False, True):
        x = inputs(tokens, 4, "cuda", seed=1)
        o, ht = chunk_gdn(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2, backend="triton")
        ref_o, ref_ht = naive_recurrent_gdn(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                            compute_dtype=torch.float64)
        for name, got, want in (("o", o, ref_o), ("final_state", ht, ref_ht)):
            err = relrms(got, want)
            rows.append(dict(check="fp64", tokens=tokens, l2norm=l2, output=name, relrms=err,
                             passed=err <= CONTRACT_RELRMS))
    return rows


def check_determinism(x: dict, repeats: int) -> list[dict]:
    first = [bits(t) for t in chunk_gdn(**x, output_final_state=True, backend="triton")]
    same = all(all(torch.equal(a, bits(b)) for a, b in zip(first, chunk_gdn(**x, output_final_state=True,
                                                                             backend="triton")))
               for _ in range(repeats))
    return [dict(check="bitwise repeats", tokens=x["q"].shape[1], l2norm=False, output=f"o, final_state x{repeats}",
                 relrms=0.0, passed=same)]


def time_forward(x: dict, timer: Timer, n: int) -> tuple[list[dict], list[dict]]:
    samples, checks = [], []
    _validate(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], x["cu_seqlens"])
    for l2 in (False, True):
        calls, outputs = stage_calls(TRITON_FORWARD, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                     scale=DIM**-0.5, initial_state=x["initial_state"], output_final_state=True,
                                     cu_seqlens=x["cu_seqlens"], use_qk_l2norm=l2)

        def whole(calls=calls):
            for _, launch in calls:
                launch()

        for name, fn in [("forward", whole)] + [(f"stage {name}", fn) for name, fn in calls]:
            graph, _ = capture_graph(lambda fn=fn: (fn(),), timer.device)
            samples += [dict(provider="dsfuse", what=name, l2norm=l2, sample=i, us=us)
                        for i, us in enumerate(timer.samples(graph.replay, "evicted", n, 1))]
        fla = fla_forward(x, l2)
        if fla is not None:
            err = relrms(fla()[0], outputs[0])
            checks.append(dict(check="fla vs dsfuse", tokens=x["q"].shape[1], l2norm=l2, output="o", relrms=err,
                               passed=err <= CONTRACT_RELRMS))
            graph, _ = capture_graph(lambda: fla(), timer.device)
            samples += [dict(provider="fla", what="forward", l2norm=l2, sample=i, us=us)
                        for i, us in enumerate(timer.samples(graph.replay, "evicted", n, 1))]
    return samples, checks


def fla_forward(x: dict, l2: bool):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    cu = x["cu_seqlens"].to(device=x["q"].device, dtype=torch.long)

    def run():
        with torch.no_grad():
            return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                          output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--check-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "env.json").write_text(json.dumps(env_mod.collect(device), indent=1) + "\n")
    checks = check_against_fp64(args.check_tokens)
    x = inputs(args.tokens, 5, device)
    checks += check_determinism(x, args.repeats)
    samples, fla_checks = time_forward(x, Timer(device, 512 * 2**20), args.samples)
    write_csv(args.out / "checks.csv", checks + fla_checks)
    write_csv(args.out / "samples.csv", samples)
    for row in checks + fla_checks:
        print(row)
    import pandas as pd

    print(pd.DataFrame(samples).groupby(["provider", "what", "l2norm"])["us"].median().to_string())
    return 0 if all(r["passed"] for r in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
