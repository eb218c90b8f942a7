"""Kernel-time breakdown of the consumer (N = 4096, fwd + bwd) for dsfuse and compile-default.

    python experiments/engram_gate/consumer_profile.py > raw/tuning/consumer-profile-N4096.txt

torch.profiler over three eager iterations after three warm-up ones: which kernels the
consumer runs and their device time (the three GEMMs are identical for every provider).
"""
import torch, yaml
from torch.profiler import profile, ProfilerActivity
from dsfuse.bench import engram_gate as b
cfg = yaml.safe_load(open("experiments/engram_gate/configs/h200.yaml"))
case = [c for c in b.cases(cfg) if c.name == "consumer_N4096_fwd+bwd"][0]
dev = torch.device("cuda")
inputs = b.make_inputs(case, dev, 0)
provs = {p.name: p for p in b.providers(cfg)}
for name in ("dsfuse", "compile-default"):
    fn = provs[name].build(case, inputs)
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3): fn()
        torch.cuda.synchronize()
    print("=====", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
