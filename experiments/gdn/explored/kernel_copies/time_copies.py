"""Time the reverse chain (``state_bwd``) or the per-chunk kernel (``chunk_bwd``) of several copies of
its module on the GDN experiment's first cases, each copy's outputs checked bitwise against the
first copy's, each kernel captured alone in a CUDA Graph and replayed with the L2 evicted, two blocks
of 5 samples.

    python3 experiments/gdn/explored/kernel_copies/time_copies.py {state_bwd,chunk_bwd} CASES OUT a.py b.py ...
"""
import importlib.util
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, "experiments/gdn")
import fused_backward_probe as fbp  # noqa: E402
from dsfuse.bench import gdn  # noqa: E402
from dsfuse.bench.harness import Timer, load_config  # noqa: E402
from dsfuse.gdn import schedule  # noqa: E402
from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward  # noqa: E402
from dsfuse.gdn.cutedsl.state_bwd import launch_state_backward  # noqa: E402
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse  # noqa: E402


def saved_forward(case, dev):
    """The case's inputs, the CuTe DSL forward's saved buffers and (main's) reverse chain's outputs."""
    p = case.params
    x = gdn.make_inputs(case, dev, seed=0)
    q, k, v = (t[0] for t in gdn.split_views(x["row"], p["heads"], p["value_heads"]))
    l2, scale = p["l2norm"], p["head_dim"] ** -0.5
    table = schedule.chunk_table(p["bounds"], dev)
    ci, co, order = table.indices, table.offsets, table.order
    tokens, hv, dim = q.shape[0], p["value_heads"], p["head_dim"]
    s = dict(q=q, k=k, v=v, do=x["do"][0], g=x["g"][0], beta=x["beta"][0], dht=x["dht"], l2=l2, scale=scale,
             ci=ci, co=co, order=order, a_round=torch.empty(tokens, hv, 64, device=dev, dtype=q.dtype),
             factors=torch.empty(ci.shape[0] * len(FACTORS), hv, 64, device=dev),
             states=torch.empty(ci.shape[0], dim, hv, dim, device=dev, dtype=q.dtype),
             dstates=torch.empty(ci.shape[0], dim, hv, dim, device=dev, dtype=q.dtype))
    g_cum = torch.empty_like(s["g"])
    launch_ut_inverse(k, s["beta"], ci, None, use_qk_l2norm=l2, g=s["g"], g_cum=g_cum, q=q, a_round=s["a_round"],
                      factors=s["factors"])
    launch_fused_forward(q, k, v, s["g"], s["beta"], None, ci, co, order, x["initial_state"], torch.empty_like(x["dht"]),
                         torch.empty(tokens, hv, dim, device=dev, dtype=q.dtype), scale, use_qk_l2norm=l2,
                         form="head_rs", g_cum=g_cum, a_round=s["a_round"], factors=s["factors"], states=s["states"])
    launch_state_backward(q, k, s["do"], s["a_round"], s["factors"], ci, co, order, s["dht"],
                          torch.empty_like(s["dht"]), s["dstates"], scale, use_qk_l2norm=l2)
    return s


def launcher(kernel: str, module, s):
    """``(run, outputs)``: a launch of ``module``'s kernel on ``s`` into outputs poisoned with NaN."""
    nan = float("nan")
    if kernel == "state_bwd":
        outs = [torch.full_like(s["dstates"], nan), torch.full_like(s["dht"], nan)]
        return (lambda: module.launch_state_backward(s["q"], s["k"], s["do"], s["a_round"], s["factors"], s["ci"],
                                                     s["co"], s["order"], s["dht"], outs[1], outs[0], s["scale"],
                                                     use_qk_l2norm=s["l2"])), outs
    outs = [torch.full_like(s[name], nan) for name in ("q", "k", "v", "g", "beta")]
    return (lambda: module.launch_chunk_backward(s["q"], s["k"], s["v"], s["do"], s["a_round"], s["factors"],
                                                 s["states"], s["dstates"], s["ci"], *outs, s["scale"],
                                                 use_qk_l2norm=s["l2"])), outs


def main() -> None:
    kernel, cases, out, files = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    out.mkdir(parents=True, exist_ok=True)
    mods = {}
    for f in files:
        spec = importlib.util.spec_from_file_location(Path(f).stem, f)
        mods[Path(f).stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[Path(f).stem])
    dev = torch.device("cuda")
    config = load_config("experiments/gdn/configs/h200-bwd-pair.yaml")
    timer = Timer(dev, fbp.FLUSH_BYTES)
    frames = []
    for case in gdn.cases(config | {"modes": ["fwd+bwd"]})[:cases]:
        s = saved_forward(case, dev)
        parts, results = [], {}
        for name, module in mods.items():
            run, outs = launcher(kernel, module, s)
            run()
            torch.cuda.synchronize()
            results[name] = [t.clone() for t in outs]
            parts.append((name, run))
        first = next(iter(results.values()))
        for name, outs in results.items():
            print(case.name, name, "same bits as the first:", all(torch.equal(a, b) for a, b in zip(outs, first)),
                  "NaN left:", any(bool(t.isnan().any()) for t in outs))
        frames.append(pd.DataFrame(fbp.graph_part_rows(parts * 2, timer, 5, dev, case=case.name)))
        print(frames[-1].groupby("part").us.median().round(1).to_string())
    pd.concat(frames).to_csv(out / "samples.csv", index=False)


if __name__ == "__main__":
    main()
