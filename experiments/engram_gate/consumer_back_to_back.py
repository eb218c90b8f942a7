"""The consumer (N = 4096, fwd + bwd) timed back to back, twice per provider, alternating.

    python experiments/engram_gate/consumer_back_to_back.py > raw/tuning/consumer-back-to-back-N4096.txt

Ten calls between two CUDA events, eager and as a replayed CUDA Graph, plus the kernel time
inside the graph from torch.profiler and the three largest kernels: shows how far the GEMMs'
speed drifts between measurements compared with the gate's share.
"""
import torch, yaml
from torch.profiler import profile, ProfilerActivity
from dsfuse.bench import engram_gate as b
from dsfuse.bench.harness import capture_graph
cfg = yaml.safe_load(open("experiments/engram_gate/configs/h200.yaml"))
case = [c for c in b.cases(cfg) if c.name == "consumer_N4096_fwd+bwd"][0]
dev = torch.device("cuda")
inputs = b.make_inputs(case, dev, 0)
provs = {p.name: p for p in b.providers(cfg)}
def ev(fn, n=10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / n * 1e3
for name in ("dsfuse", "compile-default", "dsfuse", "compile-default"):
    fn = provs[name].build(case, inputs)
    for _ in range(3): fn()
    eager_us = ev(fn)
    graph, _ = capture_graph(fn, dev)
    graph_us = ev(graph.replay)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3): graph.replay()
        torch.cuda.synchronize()
    kern = sum(k.self_device_time_total for k in prof.key_averages()) / 3
    print(f"{name:16s} eager back-to-back {eager_us:8.1f} us  graph back-to-back {graph_us:8.1f} us  kernels in graph {kern:8.1f} us")
    for k in sorted(prof.key_averages(), key=lambda k: -k.self_device_time_total)[:3]:
        print("    ", k.key[:60], round(k.self_device_time_total / 3, 1))
