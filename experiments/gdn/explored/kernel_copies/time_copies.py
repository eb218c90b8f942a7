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
import fused_backward_probe as fbp
from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, load_config


def launcher(kernel: str, module, s):
    """``(run, outputs)``: a launch of ``module``'s kernel on ``s`` (`dsfuse.bench.gdn.fused_backward_inputs`)
    into outputs poisoned with NaN."""
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
    frames, differ = [], []
    for case in gdn.cases(config | {"modes": ["fwd+bwd"]})[:cases]:
        s = gdn.fused_backward_inputs(case, dev)
        parts, results = [], {}
        for name, module in mods.items():
            run, outs = launcher(kernel, module, s)
            run()
            torch.cuda.synchronize()
            results[name] = [t.clone() for t in outs]
            parts.append((name, run))
        first = next(iter(results.values()))
        for name, outs in results.items():
            equal = all(torch.equal(a, b) for a, b in zip(outs, first))
            nan_left = any(bool(t.isnan().any()) for t in outs)
            differ.extend([f"{case.name}: {name}"] if not equal or nan_left else [])
            print(case.name, name, "same bits as the first:", equal, "NaN left:", nan_left)
        frames.append(pd.DataFrame(fbp.graph_part_rows(parts * 2, timer, 5, dev, case=case.name)))
        print(frames[-1].groupby("part").us.median().round(1).to_string())
    pd.concat(frames).to_csv(out / "samples.csv", index=False)
    if differ:  # timed all the same (the samples are written), but a trial that changes bits is not one
        sys.exit("not the first copy's bits (or NaN left): " + "; ".join(differ))


if __name__ == "__main__":
    main()
