"""Gated DeltaNet on the GPU: the time of the CuTe DSL fused backward's kernels, beside the Triton
backward stages they replace, at the experiment's shape.

    python experiments/gdn/fused_backward_probe.py OUT_DIR [--config experiments/gdn/configs/h200-fwd.yaml]
        [--samples 10] [--steps-only] [--snapshot] [--cases N]

For each case of the config (its tokens, documents, value heads and L2 norm settings; q, k, v head
views of one packed row, initial state, dO and the final state's gradient): the CuTe DSL forward
saving what the fused backward reads (``forward_saving``: the preparing UT inverse, ``head_rs``
writing ``round(S)`` of every chunk), the fused backward's kernels (``state_bwd``, the reverse
state chain; ``chunk_bwd``, the per-chunk gradients, the value heads' sum of dq and dk and the
L2 norm's backward included) and both (``fused_backward``, as `chunk_gdn` runs them: the per-chunk
kernel a programmatic dependent of the chain, starting while it runs; ``fused_backward_serial``, one
after the other, which must give the same bits: checked before timing), beside the Triton
backward (``triton_backward``) and each of its stages (``triton_<stage>``), each replayed from a
CUDA Graph with the L2 overwritten before each call (`dsfuse.bench.harness.Timer`, evicted regime),
after one whole Triton forward and backward on the same inputs. Before timing, the fused
backward's dq, dk, dv, dg, dbeta and dh0 are checked against the Triton backward's (relative RMS
<= 2e-2: two approximations of one float64 result; the float64 checks are the GPU tests'). Writes
``samples.csv`` (case, tokens, value heads, l2norm, part, sample, us) and ``env.json`` under
OUT_DIR and prints the medians. First, for each case, `chunk_gdn`'s step through autograd (q, k, v
as the packed views of one autograd node and as plain split views of one row) on the ``cutedsl``
backend and on the Triton stages: its peak memory above what was allocated before it and its eager
time (``steps.csv``; ``--steps-only``: that alone; ``--snapshot``: the tensors alive at the peak).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, graph_part_rows, rel_rms, start_run, write_csv, write_part_medians

DEFAULT_CONFIG = "experiments/gdn/configs/h200-fwd.yaml"
FLUSH_BYTES = 256 << 20


def case_rows(case, timer: Timer, samples: int, device: torch.device) -> list[dict]:
    from dsfuse.gdn import schedule
    from dsfuse.gdn.cutedsl.chunk_bwd import launch_chunk_backward
    from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward
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
    for _, launch in bwd_calls:
        launch()

    # the CuTe DSL forward saving its states, then the fused backward's kernels, on the same views
    table = schedule.chunk_table(p["bounds"], device)
    ci, co, order = table.indices, table.offsets, table.order
    tokens, hv, dim = q.shape[1], p["value_heads"], p["head_dim"]
    q_, k_, v_, do_ = q[0], k[0], v[0], x["do"][0]
    g_, beta_ = x["g"][0], x["beta"][0]
    new = torch.empty
    a_round = new(tokens, hv, 64, device=device, dtype=q.dtype)
    factors = new(ci.shape[0] * len(FACTORS), hv, 64, device=device)
    g_cum = torch.empty_like(g_)
    states, dstates = (new(ci.shape[0], dim, hv, dim, device=device, dtype=q.dtype) for _ in range(2))
    o, ht, dh0 = new(tokens, hv, dim, device=device, dtype=q.dtype), torch.empty_like(x["dht"]), torch.empty_like(x["dht"])
    f_dq, f_dk, f_dv = (torch.zeros_like(t[0]) for t in (q, k, v))
    f_dg, f_dbeta = torch.zeros_like(g_), torch.zeros_like(beta_)

    def forward():
        launch_ut_inverse(k_, beta_, ci, None, use_qk_l2norm=l2, g=g_, g_cum=g_cum, q=q_, a_round=a_round,
                          factors=factors)
        launch_fused_forward(q_, k_, v_, g_, beta_, None, ci, co, order, x["initial_state"], ht, o, scale,
                             use_qk_l2norm=l2, form="head_rs", g_cum=g_cum, a_round=a_round, factors=factors,
                             states=states)

    def chain():
        launch_state_backward(q_, k_, do_, a_round, factors, ci, co, order, x["dht"], dh0, dstates, scale,
                              use_qk_l2norm=l2)

    def per_chunk():
        launch_chunk_backward(q_, k_, v_, do_, a_round, factors, states, dstates, ci, f_dq, f_dk, f_dv, f_dg,
                              f_dbeta, scale, use_qk_l2norm=l2)

    ready = torch.empty(ci.shape[0], hv, dtype=torch.int32, device=device)

    def serial():
        chain()
        per_chunk()

    def fused():  # as chunk_gdn runs it: the per-chunk kernel starts while the chain runs
        ready.zero_()
        launch_state_backward(q_, k_, do_, a_round, factors, ci, co, order, x["dht"], dh0, dstates, scale,
                              use_qk_l2norm=l2, ready=ready)
        launch_chunk_backward(q_, k_, v_, do_, a_round, factors, states, dstates, ci, f_dq, f_dk, f_dv, f_dg,
                              f_dbeta, scale, use_qk_l2norm=l2, ready=ready, finished=table.finished)

    def triton():
        for _, launch in bwd_calls:
            launch()

    forward()
    serial()
    torch.cuda.synchronize(device)
    ours = {"dq": f_dq, "dk": f_dk, "dv": f_dv, "dg": f_dg, "dbeta": f_dbeta, "dh0": dh0}
    kept = {name: t.clone() for name, t in ours.items()}
    for t in (*ours.values(), dstates):  # dstates too: a read before its flag would find NaN
        t.fill_(float("nan"))
    fused()
    torch.cuda.synchronize(device)
    unequal = [name for name in ours if not torch.equal(ours[name], kept[name])]
    if unequal:
        raise AssertionError(f"{case.name}: the overlapped kernels differ from the serial ones in {unequal}")
    theirs = {"dq": grads.dq[0], "dk": grads.dk[0], "dv": grads.dv[0], "dg": grads.dg[0], "dbeta": grads.dbeta[0],
              "dh0": grads.dh0}
    errors = {name: rel_rms(ours[name], theirs[name]) for name in ours}
    bad = {name: err for name, err in errors.items() if not err <= 2e-2}
    if bad:
        raise AssertionError(f"{case.name}: the fused backward differs from the Triton backward: {bad}")
    print(f"{case.name}: fused backward, relative RMS against the Triton backward: "
          + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()))

    parts = [("forward_saving", forward), ("state_bwd", chain), ("chunk_bwd", per_chunk), ("fused_backward", fused),
             ("fused_backward_serial", serial),
             ("triton_backward", triton)]
    parts += [(f"triton_{name.replace(' ', '_').replace(',', '')}", launch) for name, launch in bwd_calls]
    return graph_part_rows(parts, timer, samples, device, case=case.name, tokens=p["tokens"], value_heads=hv,
                           l2norm=l2)


def step_rows(case, device: torch.device, repeats: int = 5, snapshot: Path | None = None) -> list[dict]:
    """`chunk_gdn`'s forward and backward through autograd on the ``cutedsl`` backend (the fused backward
    where it serves) and on the Triton stages, from q, k, v as the three views of one autograd node
    (``packed``: `dsfuse.gdn.packed.packed_qkv_views`, the row's gradient handed over as it was written)
    and as plain split views (``split``: torch's split backward concatenates the three gradients into a
    new row): peak memory above what was allocated before the step (the inputs and their gradients'
    buffers excluded, the outputs and gradients included) and the eager step's time (CUDA events around
    the whole call, host work included), median of ``repeats``. ``snapshot``: also write the tensors
    alive at the ``cutedsl`` step's peak, with where each was allocated (`peak_allocations`), there."""
    from dsfuse.gdn import chunk_gdn

    p = case.params
    x = gdn.make_inputs(case, device, seed=0)
    rows = []
    for backend, views in itertools.product(("cutedsl", "triton"), ("packed", "split")):
        row = x["row"].detach().requires_grad_()
        h0 = x["initial_state"].detach().requires_grad_()
        g, beta = x["g"].detach().requires_grad_(), x["beta"].detach().requires_grad_()
        make_views = gdn.packed_views if views == "packed" else gdn.split_views

        def step():
            q, k, v = make_views(row, p["heads"], p["value_heads"])
            o, ht = chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                              cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=p["l2norm"], backend=backend)
            torch.autograd.backward((o, ht), (x["do"], x["dht"]))

        step()
        torch.cuda.synchronize(device)
        times = []
        for i in range(repeats):
            for t in (row, h0, g, beta):
                t.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            record = snapshot is not None and backend == "cutedsl" and i == repeats - 1
            if record:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) * 1e3)
            peak = torch.cuda.max_memory_allocated(device) - base
            if record:
                found = peak_allocations(torch.cuda.memory._snapshot(), device)
                torch.cuda.memory._record_memory_history(enabled=None)
                write_csv(snapshot / f"peak-{case.name}-{views}.csv", found)
        times.sort()
        rows.append({"case": case.name, "value_heads": p["value_heads"], "l2norm": p["l2norm"], "backend": backend,
                     "views": views, "peak_mib": peak / 2**20, "step_us_eager": times[len(times) // 2]})
    return rows


def peak_allocations(snapshot: dict, device: torch.device) -> list[dict]:
    """The blocks alive at the peak of the allocations a memory-history ``snapshot`` recorded (those
    made before the recording started are not in it), largest first: ``mib`` and ``where``, the
    innermost frames of the project's own files (``kernels/``, ``experiments/``) that allocated it."""
    trace = snapshot["device_traces"][device.index or 0]
    live, total, best, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > best:
            best, at_peak = total, dict(live)

    def where(event) -> str:
        own = [f for f in event.get("frames", []) if "/dsfuse/" in f["filename"] or "/experiments/" in f["filename"]]
        return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in own[:3]) or "?"

    rows = [{"mib": e["size"] / 2**20, "where": where(e)} for e in at_peak.values()]
    return sorted(rows, key=lambda r: -r["mib"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"experiment config (default {DEFAULT_CONFIG})")
    parser.add_argument("--samples", type=int, default=10, help="timed replays per part (default 10)")
    parser.add_argument("--steps-only", action="store_true",
                        help="only chunk_gdn's step through autograd: peak memory and eager time (steps.csv)")
    parser.add_argument("--snapshot", action="store_true",
                        help="also write the tensors alive at the cutedsl step's peak (peak-<case>-<views>.csv)")
    parser.add_argument("--cases", type=int, default=None,
                        help="only the config's first CASES cases (e.g. 1 under Nsight Compute)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_backward_probe.py needs a CUDA GPU: run it on the GPU machine.", file=sys.stderr)
        return 2
    import pandas as pd

    device = torch.device("cuda")
    config = start_run(args.out, args.config, device, gdn.OP)
    cases = gdn.cases(config | {"modes": ["fwd+bwd"]})[: args.cases]
    steps = [row for case in cases for row in step_rows(case, device, snapshot=args.out if args.snapshot else None)]
    write_csv(args.out / "steps.csv", steps)
    print("chunk_gdn forward + backward through autograd (peak MiB above the inputs; eager us, median of 5)")
    print(pd.DataFrame(steps).round(1).to_string(index=False))
    if args.steps_only:
        return 0
    timer = Timer(device, FLUSH_BYTES)
    rows = [row for case in cases for row in case_rows(case, timer, args.samples, device)]
    write_part_medians(args.out, rows, args.samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
