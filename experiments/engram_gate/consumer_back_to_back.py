"""The consumer (N = 4096, fwd + bwd) timed back to back, twice per provider, alternating.

    python experiments/engram_gate/consumer_back_to_back.py > OUT.txt   # raw/tuning/consumer-back-to-back-N4096.txt

Ten calls between two CUDA events, eager and as a replayed CUDA Graph, plus the kernel time
inside the graph from torch.profiler and the three largest kernels: shows how far the GEMMs'
speed drifts between measurements compared with the gate's share.
"""

import argparse
from pathlib import Path

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from dsfuse.bench import engram_gate as bench
from dsfuse.bench.harness import capture_graph

CONFIG = Path(__file__).resolve().parent / "configs" / "h200.yaml"


def per_call_us(fn, n=10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="experiment config (default: configs/h200.yaml)")
    parser.add_argument("--case", default="consumer_N4096_fwd+bwd", help="case of the config to time")
    parser.add_argument("--order", nargs="+", default=["dsfuse", "compile-default", "dsfuse", "compile-default"],
                        help="providers in the order they are timed")
    args = parser.parse_args()

    config = yaml.safe_load(Path(args.config).read_text())
    case = next(c for c in bench.cases(config) if c.name == args.case)
    device = torch.device("cuda")
    inputs = bench.make_inputs(case, device, 0)
    providers = {p.name: p for p in bench.providers(config)}
    for name in args.order:
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


if __name__ == "__main__":
    main()
