"""The shipped launchers' forward, and forward + backward, timed as the tuning scripts time them.

    python experiments/engram_gate/launcher_pair.py OUT.csv [ROUNDS]

N = 4096 on the experiment's inputs; CUDA Graph replay, L2 overwritten before each call; the
pair checked against the float64 backward from the same saved state first. For comparing with
the benchmark's ``dsfuse`` provider (``configs/dsfuse-only.yaml``) on the same machine instance.
"""

import sys

import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, capture_graph, checked_graph_samples, write_csv
from dsfuse.engram_gate import engram_gate_backward_from_saved
from dsfuse.engram_gate import triton as eg

dev = torch.device("cuda")
x, kv, w, m, dout, eps = gate_inputs(4096, dev)
n, streams, dim = x.shape
out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device=dev)
dx, dkv, dw = torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device=dev)
ws = torch.empty(eg.workspace_elements(n, streams, dim), device=dev)


def fwd():
    eg.launch_forward(x, kv, w, m, out, saved, eps=eps, clamp=1e-6)


def bwd():
    eg.launch_backward(dout, x, kv, w, saved, dx, dkv, dw, ws, clamp=1e-6)


fwd()
want = engram_gate_backward_from_saved(dout, x, kv, w, saved)
timer = Timer(dev, 256 << 20)
rows = []
for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    graph, _ = capture_graph(lambda: (fwd(),), dev)
    for mode, us in (("fwd", timer.samples(graph.replay, "evicted", 20, 1)),
                     ("fwd+bwd", checked_graph_samples(lambda: (fwd(), bwd()), (dx, dkv, dw), want, timer, "pair"))):
        rows += [dict(mode=mode, round=rnd, sample=i, us=round(u, 3)) for i, u in enumerate(us)]
        print(f"round {rnd} {mode}: {sorted(us)[len(us) // 2]:.1f} us", flush=True)
write_csv(sys.argv[1], rows)
