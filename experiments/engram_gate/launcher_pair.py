"""The shipped launchers' forward, and forward + backward, timed as the tuning scripts time them.

    python experiments/engram_gate/launcher_pair.py OUT.csv [--rounds R]

N = 4096 on the experiment's inputs; CUDA Graph replay, L2 overwritten before each call; the
pair checked against the float64 backward from the same saved state first (the forward alone
is timed unchecked). For comparing with the benchmark's ``dsfuse`` provider
(``configs/dsfuse-only.yaml``) on the same machine instance.
"""

import argparse

import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, capture_graph, checked_graph_samples, sweep
from dsfuse.engram_gate import engram_gate_backward_from_saved
from dsfuse.engram_gate.triton import kernels as eg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both modes (default 3)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    x, kv, w, m, dout, eps = gate_inputs(4096, dev)
    n, streams, dim = x.shape
    out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device=dev)
    grads = (torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device=dev))
    ws = torch.empty(eg.workspace_elements(n, streams, dim), device=dev)

    def fwd():
        eg.launch_forward(x, kv, w, m, out, saved, eps=eps, clamp=1e-6)

    def bwd():
        eg.launch_backward(dout, x, kv, w, saved, *grads, ws, clamp=1e-6)

    fwd()
    want = engram_gate_backward_from_saved(dout, x, kv, w, saved)
    timer = Timer(dev, 256 << 20)

    def measure(mode, s):
        if mode == "fwd":
            graph, _ = capture_graph(lambda: (fwd(),), dev)
            return timer.samples(graph.replay, "evicted", 20, 1)
        return checked_graph_samples(lambda: (fwd(), bwd()), grads, want, timer, "pair")

    sweep([{"mode": "fwd"}, {"mode": "fwd+bwd"}], lambda s: s["mode"], measure, args.out, rounds=args.rounds,
          desc="launcher pair")


if __name__ == "__main__":
    main()
