"""Kernel-time breakdown of the consumer (N = 4096, fwd + bwd) for dsfuse and compile-default.

    python experiments/engram_gate/consumer_profile.py > OUT.txt   # raw/tuning/consumer-profile-N4096.txt

torch.profiler over three eager iterations after three warm-up ones: which kernels the
consumer runs and their device time (the three GEMMs are identical for every provider).
"""

import argparse
from pathlib import Path

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from dsfuse.bench import engram_gate as bench

CONFIG = Path(__file__).resolve().parent / "configs" / "h200.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG), help="experiment config (default: configs/h200.yaml)")
    parser.add_argument("--case", default="consumer_N4096_fwd+bwd", help="case of the config to profile")
    parser.add_argument("--providers", nargs="+", default=["dsfuse", "compile-default"])
    args = parser.parse_args()

    config = yaml.safe_load(Path(args.config).read_text())
    case = next(c for c in bench.cases(config) if c.name == args.case)
    inputs = bench.make_inputs(case, torch.device("cuda"), 0)
    providers = {p.name: p for p in bench.providers(config)}
    for name in args.providers:
        step = providers[name].build(case, inputs)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print("=====", name)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()
