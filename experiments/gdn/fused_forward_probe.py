"""Gated DeltaNet on the GPU: the time of the CuTe DSL fused forward's kernels, beside the Triton
forward, at the experiment's shape.

    python experiments/gdn/fused_forward_probe.py OUT_DIR [--config experiments/gdn/configs/h200.yaml]
        [--samples 10] [--parts fused_head,triton] [--cases 1]

For each forward case of the config (its tokens, documents, value heads and L2 norm settings; q, k,
v head views of one packed row, initial and final state): the UT inverse kernel alone
(``ut_inverse``), the fused kernel alone in each form (``fused`` for the CUDA-core form, ``fused_tc``
for the tensor-core form, ``fused_head`` for the per-head form, ``fused_head_wgmma`` for it on
warpgroup instructions), the inverse and a fused kernel
(``cutedsl``, ``cutedsl_tc``, ``cutedsl_head``, ``cutedsl_head_wgmma``: the forms the GPU has the
instructions of), the gating inverse alone (``ut_inverse_gate``: also the cumulative gate, and
the gated fp32 ``A``; ``ut_inverse_prepare``: also ``round(A)`` and the rows' factors, the
``head_ws`` form's inputs), the per-head forms reading them (``fused_gated_head``,
``fused_gated_head_wgmma``) and the pair `chunk_gdn` launches (``cutedsl_gated_head``,
``cutedsl_gated_head_wgmma``; ``_head_ws`` likewise for the role-split form; a ``_states`` suffix:
a prepared form saving ``round(S)`` at every chunk's start for a backward), `chunk_gdn`'s whole forward
on the CuTe DSL backend (``chunk_gdn_cutedsl``) and the Triton
forward (``triton``, `chunk_gdn`),
each replayed from a CUDA Graph with the L2 overwritten before each call
(`dsfuse.bench.harness.Timer`, evicted regime). Before timing, every timed form's ``o`` and final state
(poisoned with NaN before the call) are checked against the Triton forward's (relative RMS <= 1e-2:
two approximations of one float64 result; the float64 checks are the GPU tests'). Writes ``samples.csv`` (case, tokens, value
heads, l2norm, part, sample, us) and ``env.json`` under OUT_DIR and prints the medians.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, graph_part_rows, rel_rms, start_run, write_part_medians

DEFAULT_CONFIG = "experiments/gdn/configs/h200.yaml"
# other overlaps of the CuTe DSL forward's launches, as Overlap(leads, share) (parts chunk_gdn_cutedsl_<name>)
OVERLAPS = {"leads0": (0,), "leads1": (1,), "leads2": (2,), "leads2_half": (2, 0.5), "leads3": (3,)}
FLUSH_BYTES = 256 << 20


def case_rows(case, timer: Timer, samples: int, device: torch.device, only: set[str] | None = None) -> list[dict]:
    from dsfuse.gdn import chunk_gdn
    from dsfuse._common import cutedsl as _cd
    from dsfuse.gdn.cutedsl import forward
    from dsfuse.gdn.cutedsl.fused_fwd import (ARCHS, CHUNK, FORMS, PREPARED_FORMS, document_order,
                                              launch_fused_forward)
    from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse
    from dsfuse.gdn.reference import prepare_chunk_indices, prepare_chunk_offsets

    p = case.params
    inputs = gdn.make_inputs(case, device, seed=0)
    q, k, v = (x[0] for x in gdn.split_views(inputs["row"], p["heads"], p["value_heads"]))  # [T, *, D] views
    g, beta, h0 = inputs["g"][0], inputs["beta"][0], inputs["initial_state"].contiguous()
    bounds, l2 = p["bounds"], p["l2norm"]
    ci = prepare_chunk_indices(bounds).to(device=device, dtype=torch.int32).contiguous()
    co = prepare_chunk_offsets(bounds).to(device=device, dtype=torch.int32).contiguous()
    order = torch.tensor(document_order(bounds), device=device, dtype=torch.int32)
    tokens, hv, dv = v.shape
    a = torch.empty(tokens, hv, CHUNK, device=device)
    ht = torch.empty_like(h0)
    o = torch.zeros(tokens, hv, dv, device=device, dtype=v.dtype)
    scale = q.shape[-1] ** -0.5

    g_cum = torch.empty_like(g)  # the gating inverse's (chunk_gdn's) cumulative gate
    a_gated = torch.empty_like(a)
    # the preparing inverse's round(A) and rows' factors (the head_ws form's inputs)
    prepared = {"a_round": torch.empty_like(a, dtype=v.dtype),
                "factors": torch.empty(ci.shape[0] * len(FACTORS), hv, CHUNK, device=device)}

    def inverse(gate=False, prepare=False):
        if prepare:
            return lambda: launch_ut_inverse(k, beta, ci, a_gated, use_qk_l2norm=l2, g=g, g_cum=g_cum, q=q, **prepared)
        if gate:
            return lambda: launch_ut_inverse(k, beta, ci, a_gated, use_qk_l2norm=l2, g=g, g_cum=g_cum)
        return lambda: launch_ut_inverse(k, beta, ci, a, use_qk_l2norm=l2)

    # a prepared form's saved states, round(S) at every chunk's start [NC, K, HV, V] (for a backward)
    states = torch.empty(ci.shape[0], q.shape[-1], hv, dv, device=device, dtype=v.dtype)

    def fused(form, gate=False, save=False):
        return lambda: launch_fused_forward(q, k, v, g, beta, a_gated if gate else a, ci, co, order, h0, ht, o, scale,
                                            use_qk_l2norm=l2, form=form, g_cum=g_cum if gate else None,
                                            states=states if save else None,
                                            **(prepared if form in PREPARED_FORMS else {}))

    def both(form, gate=False, save=False):
        def run():
            inverse(gate, form in PREPARED_FORMS)()
            fused(form, gate, save)()
        return run

    def served(overlap=None):  # chunk_gdn's forward on the CuTe DSL backend (the saving launch, checks, allocations)
        if overlap is not None:  # the forward under another overlap of its launches (the same bits)
            saved, forward.OVERLAP = forward.OVERLAP, overlap
            try:
                return served()
            finally:
                forward.OVERLAP = saved
        return chunk_gdn(q[None], k[None], v[None], inputs["g"], inputs["beta"], initial_state=h0,
                         output_final_state=True, cu_seqlens=inputs["cu_seqlens"], use_qk_l2norm_in_kernel=l2,
                         backend="cutedsl")

    def triton():
        return chunk_gdn(q[None], k[None], v[None], inputs["g"], inputs["beta"], initial_state=h0,
                         output_final_state=True, cu_seqlens=inputs["cu_seqlens"], use_qk_l2norm_in_kernel=l2,
                         backend="triton")

    suffix = {"cuda_core": "", "tensor_core": "_tc", "head": "_head", "head_wgmma": "_head_wgmma", "head_ws": "_head_ws",
              "head_rs": "_head_rs"}
    arch = _cd.arch_of(device)
    # the forms this GPU has the instructions of, and (with --parts) only those whose parts are timed
    forms = [f for f in FORMS if arch in ARCHS.get(f, (arch,))
             and (not only or {f"{n}{suffix[f]}" for n in ("fused", "cutedsl", "fused_gated", "cutedsl_gated")}
                  & only)]
    o_tri, ht_tri = triton()
    ungated = [f for f in forms if f not in PREPARED_FORMS]  # they read the preparing inverse's: gated only
    for form, gate in [(f, False) for f in ungated] + [(f, True) for f in forms if f.startswith("head")]:
        o.fill_(float("nan"))
        ht.fill_(float("nan"))
        both(form, gate)()
        torch.cuda.synchronize(device)
        errors = {"o": rel_rms(o, o_tri[0]), "final_state": rel_rms(ht, ht_tri)}
        bad = {name: err for name, err in errors.items() if not err <= 1e-2}
        name = f"{form}{' gated' if gate else ''}"
        if bad:
            raise AssertionError(f"{case.name}: the {name} fused forward differs from the Triton forward: {bad}")
        print(f"{case.name}: {name} form, relative RMS against the Triton forward: "
              + ", ".join(f"{name} {err:.1e}" for name, err in errors.items()))

    rows = []  # the checks above left a and a_gated written for the fused parts alone
    parts = [("ut_inverse", inverse()), ("ut_inverse_gate", inverse(True)), ("ut_inverse_prepare", inverse(True, True))]
    parts += [(f"{name}{suffix[form]}", make(form)) for form in ungated for name, make in (("fused", fused),
                                                                                           ("cutedsl", both))]
    # the per-head forms as chunk_gdn launches them (reading the gating inverse's A), and its whole forward
    parts += [(f"{name}_gated{suffix[form]}", make(form, True)) for form in forms if form.startswith("head")
              for name, make in (("fused", fused), ("cutedsl", both))]
    # the prepared forms saving the states (a backward's round(S) from the forward): the same o and final state
    parts += [(f"{name}_gated{suffix[form]}_states", make(form, True, True)) for form in forms
              if form in PREPARED_FORMS for name, make in (("fused", fused), ("cutedsl", both))]
    parts += [("chunk_gdn_cutedsl", served), ("triton", triton)]
    # chunk_gdn's forward under other overlaps of its launches (`dsfuse.gdn.cutedsl.forward.stages`),
    # eager calls too: the same bits as the plain eager call's, checked here before timing
    overlaps = {f"chunk_gdn_cutedsl_{name}": forward.Overlap(*args, eager=True)
                for name, args in OVERLAPS.items()}
    if not only or only & overlaps.keys():
        o_ref, ht_ref = (x.clone() for x in served())
        for part, overlap in overlaps.items():
            o_, ht_ = served(overlap)
            if not (torch.equal(o_, o_ref) and torch.equal(ht_, ht_ref)):
                raise AssertionError(f"{case.name}: {part} changed the forward's bits (against one stage)")
            plan = forward.stages(bounds, hv, torch.cuda.get_device_properties(device).multi_processor_count, overlap)
            print(f"{case.name}: {part}, stages {plan}: the bits of one stage")
            parts.append((part, lambda overlap=overlap: served(overlap)))
    return rows + graph_part_rows([(part, fn) for part, fn in parts if not only or part in only], timer, samples,
                                  device, case=case.name, tokens=p["tokens"], value_heads=hv, l2norm=l2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"experiment config (default {DEFAULT_CONFIG})")
    parser.add_argument("--samples", type=int, default=10, help="samples per part (default 10)")
    parser.add_argument("--parts", help="comma-separated parts to time (default all; e.g. fused_head under ncu)")
    parser.add_argument("--cases", type=int, help="time the config's first CASES forward cases only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_forward_probe.py needs a CUDA GPU and the cutedsl extra. Run it on the GPU machine.",
              file=sys.stderr)
        return 2

    device = torch.device("cuda")
    config = start_run(args.out, args.config, device, gdn.OP) | {"modes": ["fwd"]}
    timer = Timer(device, FLUSH_BYTES)
    only = set(args.parts.split(",")) if args.parts else None
    rows = [row for case in gdn.cases(config)[: args.cases] for row in case_rows(case, timer, args.samples, device, only)]
    write_part_medians(args.out, rows, args.samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
