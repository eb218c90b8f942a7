"""Gated DeltaNet on the GPU: the time of each Triton stage, and each provider's peak memory.

    python experiments/gdn/stage_times.py OUT_DIR [--config experiments/gdn/configs/h200.yaml]
        [--samples 30] [--modes fwd+bwd ckpt]

At the experiment's shape (the config's tokens, documents and geometry: by default the H200
config, T = 32,768 tokens in five documents, (H, HV) = (16, 48), head dim 128, bf16, initial and
final state), L2 norm on and off (the config's ``l2norm``):

1. Stage times: every forward stage call of :func:`dsfuse.gdn.schedule.stage_calls` and every
   backward stage call of :func:`dsfuse.gdn.schedule.backward_calls` (Triton stages,
   ``dsfuse.gdn.triton.FORWARD`` / ``BACKWARD``; q, k, v head views of one packed row
   and dq, dk, dv written into one packed gradient row, as ``chunk_gdn`` does for them), each
   captured alone in a CUDA Graph and replayed with the L2 overwritten before each call
   (:class:`dsfuse.bench.harness.Timer`, evicted regime); also the whole forward and the whole
   backward, each one graph. The stages are replayed after one full forward and backward, on their
   buffers (a stage replayed alone rewrites its outputs from the same inputs; the timing does not
   depend on values). Rows: ``l2norm``, ``pass`` (forward/backward), ``stage``, ``sample``, ``us``.
2. Peak memory: each provider's step of the experiment (``dsfuse.bench.gdn``; ``--modes``,
   default ``fwd+bwd``) after a warm-up call: ``torch.cuda.max_memory_allocated()`` during one
   call minus the memory allocated before it (inputs and the provider's state excluded; the
   outputs and gradients it returns included), and ``retained_mib``: what the call left allocated
   (its outputs). Each provider's outputs are checked against the FP64 reference as in the
   experiment (``check`` column: pass, or the failure); a provider that does not apply
   (flash-linear-attention not installed) is a row with its reason.

Writes ``stage_times.csv``, ``peak_memory.csv`` and ``env.json`` (:func:`dsfuse.bench.env.collect`)
under OUT_DIR, and prints both as tables. Needs a CUDA GPU (it refuses to run on the CPU).

    python experiments/gdn/stage_times.py --render RAW_DIR OUT.md

renders those raw files (on any machine) as the Markdown tables the docs include: each stage's
median, its share of its pass, and the peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, capture_graph, compare, start_run, write_csv

DEFAULT_CONFIG = "experiments/gdn/configs/h200.yaml"
FLUSH_BYTES = 512 << 20  # overwritten before each timed replay: over 2x the L2 of an H200 or a B200


def experiment_case(config: dict, mode: str, l2: bool):
    """The experiment's case of ``mode`` with the L2 norm ``l2`` at the config's shape."""
    return gdn.cases(config | {"modes": [mode], "l2norm": [l2]})[0]


def stage_rows(config: dict, l2: bool, timer: Timer, samples: int, device: torch.device) -> list[dict]:
    """Per-stage and whole-pass samples of the Triton forward and backward at the experiment's shape."""
    from dsfuse.gdn import schedule
    from dsfuse.gdn.triton import BACKWARD as TRITON_BACKWARD
    from dsfuse.gdn.triton import FORWARD as TRITON_FORWARD
    from dsfuse.gdn.packed import packed_grad_row

    case = experiment_case(config, "fwd+bwd", l2)
    p = case.params
    x = gdn.make_inputs(case, device, seed=0)
    q, k, v = gdn.split_views(x["row"], p["heads"], p["value_heads"])
    common = dict(scale=p["head_dim"] ** -0.5, initial_state=x["initial_state"], cu_seqlens=p["bounds"],
                  use_qk_l2norm=l2)
    fwd_calls, out = schedule.stage_calls(TRITON_FORWARD, q, k, v, x["g"], x["beta"], output_final_state=True,
                                          **common)
    for _, launch in fwd_calls:
        launch()
    _, dq, dk, dv = packed_grad_row(q, k, v)
    bwd_calls, _ = schedule.backward_calls(TRITON_BACKWARD, q, k, v, x["beta"], out.g_cum, out.A, x["do"], x["dht"],
                                           dq=dq, dk=dk, dv=dv, **common)
    for _, launch in bwd_calls:
        launch()
    torch.cuda.synchronize(device)
    rows = []
    for what, calls in (("forward", fwd_calls), ("backward", bwd_calls)):
        def whole(calls=calls):
            for _, launch in calls:
                launch()

        for stage, fn in [(f"{what} (all stages)", whole)] + calls:
            graph, _ = capture_graph(lambda fn=fn: (fn(),), device)
            rows += [{"l2norm": l2, "pass": what, "stage": stage, "sample": i, "us": us}
                     for i, us in enumerate(timer.samples(graph.replay, "evicted", samples, 1))]
            del graph
    return rows


def memory_rows(config: dict, l2: bool, mode: str, device: torch.device) -> list[dict]:
    """Peak memory of one call of each provider's step (module docstring)."""
    case = experiment_case(config, mode, l2)
    x = gdn.make_inputs(case, device, seed=0)
    expected = gdn.reference(case, x)
    rows = []
    for provider in gdn.providers(config):
        row = dict(l2norm=l2, mode=mode, provider=provider.name)
        reason = provider.applies(case)
        if reason:
            rows.append(row | dict(peak_mib=None, retained_mib=None, check=f"n/a: {reason}"))
            continue
        run = provider.build(case, x)
        outputs = run()  # warm-up: compilation, chunk tables
        result = compare(outputs, expected, provider, case)
        del outputs
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        outputs = run()
        torch.cuda.synchronize(device)
        peak, left = torch.cuda.max_memory_allocated(device) - base, torch.cuda.memory_allocated(device) - base
        rows.append(row | dict(peak_mib=peak / 2**20, retained_mib=left / 2**20,
                               check="pass" if result.ok else f"FAIL {result.detail}"))
        del outputs, run
        torch.cuda.empty_cache()
    return rows


def render(raw: Path) -> str:
    """Markdown tables of a raw folder's ``stage_times.csv`` and ``peak_memory.csv`` (medians)."""
    import pandas as pd

    env = json.loads((raw / "env.json").read_text())
    stages = pd.read_csv(raw / "stage_times.csv")
    med = stages.groupby(["pass", "stage", "l2norm"], sort=False)["us"].median().reset_index()
    run = raw.parent.name if raw.name == "stages" else raw.name
    lines = [f"Run `{run}` ({env.get('gpu_name', '?')}, commit `{str(env.get('git_commit', '?'))[:10]}`): "
             f"median of {stages.groupby(['pass', 'stage', 'l2norm']).size().min()} CUDA Graph replays per "
             "stage, L2 evicted before each; a pass's share is of the sum of its stages.", ""]
    for l2, part in med.groupby("l2norm", sort=False):
        lines += [f"**L2 norm {'on' if l2 else 'off'}**", "", "| pass | stage | median us | share of the pass |",
                  "| --- | --- | ---: | ---: |"]
        for pas, rows in part.groupby("pass", sort=False):
            stage_rows_ = rows[~rows["stage"].str.contains("(all stages)", regex=False)]
            total = stage_rows_["us"].sum()
            for _, r in rows.iterrows():
                share = "" if "(all stages)" in r["stage"] else f"{100 * r['us'] / total:.0f}%"
                lines.append(f"| {pas} | {r['stage']} | {r['us']:.1f} | {share} |")
        lines.append("")
    memory = pd.read_csv(raw / "peak_memory.csv")
    lines += ["**Peak memory** of one step (MiB allocated above what was allocated before the call; "
              "outputs and gradients included)", "",
              "| mode | L2 norm | provider | peak MiB | retained MiB | check |", "| --- | --- | --- | ---: | ---: | --- |"]
    for _, r in memory.iterrows():
        peak = "" if pd.isna(r["peak_mib"]) else f"{r['peak_mib']:.0f}"
        kept = "" if pd.isna(r["retained_mib"]) else f"{r['retained_mib']:.0f}"
        lines.append(f"| {r['mode']} | {'on' if r['l2norm'] else 'off'} | {r['provider']} | {peak} | {kept} | "
                     f"{str(r['check']).splitlines()[0][:80]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--render"]:
        if len(argv) != 3:
            raise SystemExit("usage: stage_times.py --render RAW_DIR OUT.md")
        Path(argv[2]).write_text(render(Path(argv[1])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"experiment config (default {DEFAULT_CONFIG})")
    parser.add_argument("--samples", type=int, default=30, help="timed replays per stage (default 30)")
    parser.add_argument("--modes", nargs="+", default=["fwd+bwd"], choices=list(gdn.MODES),
                        help="the steps whose peak memory is measured (default fwd+bwd)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("stage_times.py needs a CUDA GPU (torch.cuda.is_available() is False): it times CUDA Graph "
              "replays and reads the CUDA allocator's peak memory. Run it on the GPU machine.", file=sys.stderr)
        return 2
    import pandas as pd

    device = torch.device("cuda")
    config = start_run(args.out, args.config, device, gdn.OP)
    timer = Timer(device, FLUSH_BYTES)
    l2_values = [bool(v) for v in config.get("l2norm", [True])]
    stages = [row for l2 in l2_values for row in stage_rows(config, l2, timer, args.samples, device)]
    write_csv(args.out / "stage_times.csv", stages)
    memory = [row for l2 in l2_values for mode in args.modes for row in memory_rows(config, l2, mode, device)]
    write_csv(args.out / "peak_memory.csv", memory)

    table = pd.DataFrame(stages).groupby(["pass", "stage", "l2norm"], sort=False)["us"].median().unstack("l2norm")
    print(f"median us per call, CUDA Graph replay, L2 evicted ({args.samples} samples)")
    print(table.round(1).to_string())
    print("\npeak memory (MiB above the allocation before the call)")
    print(pd.DataFrame(memory).round(1).to_string(index=False))
    print(f"\nwrote {args.out / 'stage_times.csv'}, {args.out / 'peak_memory.csv'}, {args.out / 'env.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
