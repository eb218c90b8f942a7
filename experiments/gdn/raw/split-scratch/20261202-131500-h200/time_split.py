"""Ad-hoc paired timing of chunk_gdn (Triton) at one document of 32,768 tokens (split by the rule)."""
import json, sys
import torch
from dsfuse.gdn import chunk_gdn
from dsfuse.bench.harness import Timer, capture_graph

label, out = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
t, h, hv, d = 32768, 16, 48, 128
gen = torch.Generator(device=dev).manual_seed(0)
row = torch.randn(t, (2 * h + hv) * d, device=dev, generator=gen).bfloat16()
q, k, v = row[:, :h * d].view(1, t, h, d), row[:, h * d:2 * h * d].view(1, t, h, d), row[:, 2 * h * d:].view(1, t, hv, d)
g = torch.nn.functional.logsigmoid(torch.randn(1, t, hv, device=dev, generator=gen)) * 0.1
beta = torch.rand(1, t, hv, device=dev, generator=gen).bfloat16()
cu = torch.tensor([0, t], device=dev, dtype=torch.int32)
timer = Timer(dev, 256 << 20)
rows = []
def fwd():
    return chunk_gdn(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, output_final_state=True, backend="triton")
o, ht = fwd()
torch.cuda.synchronize()
ref = {"o_sum": float(o.float().sum()), "ht_sum": float(ht.sum())}
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
fwd(); torch.cuda.synchronize()
peak_fwd = torch.cuda.max_memory_allocated() - base
for i, us in enumerate(timer.samples(fwd, "evicted", 10, 1)):
    rows.append({"label": label, "part": "fwd_eager_evicted", "sample": i, "us": us})
qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
do = torch.randn_like(o)
def step():
    o_, _ = chunk_gdn(qr, kr, vr, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, output_final_state=True, backend="triton")
    torch.autograd.grad(o_, (qr, kr, vr), do)
step(); torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
step(); torch.cuda.synchronize()
peak_step = torch.cuda.max_memory_allocated() - base
for i, us in enumerate(timer.samples(step, "evicted", 5, 1)):
    rows.append({"label": label, "part": "fwd+bwd_eager_evicted", "sample": i, "us": us})
import statistics
summary = {"label": label, "peak_fwd_gib": peak_fwd / 2**30, "peak_step_gib": peak_step / 2**30, **ref}
for part in ("fwd_eager_evicted", "fwd+bwd_eager_evicted"):
    summary[part + "_median_us"] = statistics.median(r["us"] for r in rows if r["part"] == part)
print(json.dumps(summary))
with open(out, "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
    f.write(json.dumps({"summary": summary}) + "\n")
