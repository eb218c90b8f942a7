"""The consumer (N = 4096, fwd + bwd) timed back to back, twice per provider, alternating.

    python experiments/engram_gate/consumer_back_to_back.py > raw/tuning/consumer-back-to-back-N4096.txt

Ten calls between two CUDA events, eager and as a replayed CUDA Graph, plus the kernel time
inside the graph from torch.profiler and the three largest kernels: shows how far the GEMMs'
speed drifts between measurements compared with the gate's share.
"""

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from dsfuse.bench import engram_gate as bench
from dsfuse.bench.harness import capture_graph

config = yaml.safe_load(open("experiments/engram_gate/configs/h200.yaml"))
case = next(c for c in bench.cases(config) if c.name == "consumer_N4096_fwd+bwd")
device = torch.device("cuda")
inputs = bench.make_inputs(case, device, 0)
providers = {p.name: p for p in bench.providers(config)}


def per_call_us(fn, n=10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n * 1e3


for name in ("dsfuse", "compile-default", "dsfuse", "compile-default"):
    step = providers[name].build(case, inputs)
    for _ in range(3):
        step()
    eager_us = per_call_us(step)
    graph, _ = capture_graph(step, device)
    graph_us = per_call_us(graph.replay)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    kernels_us = sum(k.self_device_time_total for k in prof.key_averages()) / 3
    print(f"{name:16s} eager back-to-back {eager_us:8.1f} us  graph back-to-back {graph_us:8.1f} us  "
          f"kernels in graph {kernels_us:8.1f} us")
    for k in sorted(prof.key_averages(), key=lambda k: -k.self_device_time_total)[:3]:
        print("    ", k.key[:60], round(k.self_device_time_total / 3, 1))
