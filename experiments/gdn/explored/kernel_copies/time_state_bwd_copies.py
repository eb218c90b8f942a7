"""Time the reverse chain kernel of several copies of state_bwd.py on the probe's first case (graph replay,
L2 evicted), each checked bitwise against the first copy's outputs."""
import importlib.util, sys
from pathlib import Path
import torch
sys.path.insert(0, "experiments/gdn")
import fused_backward_probe as fbp
from dsfuse.bench import gdn
from dsfuse.bench.harness import Timer, load_config
from dsfuse.gdn import schedule
from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse

out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
files = sys.argv[3:]
mods = {}
for f in files:
    spec = importlib.util.spec_from_file_location(Path(f).stem, f)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); mods[Path(f).stem] = m
dev = torch.device("cuda")
config = load_config("experiments/gdn/configs/h200-bwd-pair.yaml")
cases = gdn.cases(config | {"modes": ["fwd+bwd"]})[: int(sys.argv[1])]
timer = Timer(dev, fbp.FLUSH_BYTES)
for n, case in enumerate(cases):
    p = case.params
    x = gdn.make_inputs(case, dev, seed=0)
    q, k, v = gdn.split_views(x["row"], p["heads"], p["value_heads"])
    l2, scale = p["l2norm"], p["head_dim"] ** -0.5
    table = schedule.chunk_table(p["bounds"], dev)
    ci, co, order = table.indices, table.offsets, table.order
    tokens, hv, dim = q.shape[1], p["value_heads"], p["head_dim"]
    q_, k_, v_, do_, g_, beta_ = q[0], k[0], v[0], x["do"][0], x["g"][0], x["beta"][0]
    a_round = torch.empty(tokens, hv, 64, device=dev, dtype=q.dtype)
    factors = torch.empty(ci.shape[0] * len(FACTORS), hv, 64, device=dev)
    g_cum = torch.empty_like(g_)
    states = torch.empty(ci.shape[0], dim, hv, dim, device=dev, dtype=q.dtype)
    o, ht = torch.empty(tokens, hv, dim, device=dev, dtype=q.dtype), torch.empty_like(x["dht"])
    launch_ut_inverse(k_, beta_, ci, None, use_qk_l2norm=l2, g=g_, g_cum=g_cum, q=q_, a_round=a_round, factors=factors)
    launch_fused_forward(q_, k_, v_, g_, beta_, None, ci, co, order, x["initial_state"], ht, o, scale, use_qk_l2norm=l2,
                         form="head_rs", g_cum=g_cum, a_round=a_round, factors=factors, states=states)
    outs, parts = {}, []
    for name, m in mods.items():
        dstates = torch.full((ci.shape[0], dim, hv, dim), float("nan"), device=dev, dtype=q.dtype)
        dh0 = torch.full_like(x["dht"], float("nan"))
        fn = (lambda m=m, dstates=dstates, dh0=dh0: m.launch_state_backward(
            q_, k_, do_, a_round, factors, ci, co, order, x["dht"], dh0, dstates, scale, use_qk_l2norm=l2))
        fn(); torch.cuda.synchronize()
        outs[name] = (dstates.clone(), dh0.clone())
        parts.append((name, fn))
    first = next(iter(outs.values()))
    for name, (a, b) in outs.items():
        print(case.name, name, "same bits as", next(iter(outs)), torch.equal(a, first[0]) and torch.equal(b, first[1]))
    rows = fbp.graph_part_rows(parts * 2, timer, 5, dev, case=case.name)
    import pandas as pd
    df = pd.DataFrame(rows)
    print(df.groupby("part").us.median().round(1).to_string())
    df.to_csv(out / f"times-{n}.csv", index=False)
