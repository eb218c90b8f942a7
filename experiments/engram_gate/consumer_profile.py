"""Kernel-time breakdown of the consumer (N = 4096, fwd + bwd) for dsfuse and compile-default.

    python experiments/engram_gate/consumer_profile.py > raw/tuning/consumer-profile-N4096.txt

torch.profiler over three eager iterations after three warm-up ones: which kernels the
consumer runs and their device time (the three GEMMs are identical for every provider).
"""

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from dsfuse.bench import engram_gate as bench

config = yaml.safe_load(open("experiments/engram_gate/configs/h200.yaml"))
case = next(c for c in bench.cases(config) if c.name == "consumer_N4096_fwd+bwd")
inputs = bench.make_inputs(case, torch.device("cuda"), 0)
providers = {p.name: p for p in bench.providers(config)}
for name in ("dsfuse", "compile-default"):
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
