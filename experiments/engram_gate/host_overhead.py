"""Host (CPU) time per call of the Engram gate API and its parts, on a small input.

    python experiments/engram_gate/host_overhead.py OUT.csv

N = 4 tokens of the model's width keeps GPU time far below host time, so the time
per call of a loop without synchronisation is the host cost of enqueueing. This is
what the eager-clock rows of the results add on top of the kernels. One CSV row per
sample (``part``, ``sample``, ``host_us``).
"""

import argparse

import torch

from dsfuse.bench.harness import host_us_samples, sweep
from dsfuse.engram_gate import (
    EngramGatePlan,
    engram_gate,
    engram_gate_backward,
    engram_gate_forward,
    engram_gate_reference,
)
from dsfuse.engram_gate import api
from dsfuse.engram_gate import triton as eg


def parts(dev: torch.device) -> dict:
    """The API layers, each a zero-argument call on the same small input."""
    n, streams, dim, eps = 4, 4, 5120, 1e-20
    x = torch.randn(n, streams, dim, device=dev).bfloat16()
    kv = torch.randn(n, (streams + 1) * dim, device=dev).bfloat16()
    weight = torch.randn(streams, dim, device=dev)
    mask = torch.ones(n, dtype=torch.bool, device=dev)
    dout = torch.randn_like(x)
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=eps)
    dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty_like(weight)
    workspace = torch.empty(eg.workspace_elements(n, streams, dim), device=dev)
    plan = EngramGatePlan(dim=dim, max_tokens=n, device=dev, eps=eps)
    leaves = [t.detach().requires_grad_() for t in (x, kv, weight)]

    def autograd_step():
        torch.autograd.grad(engram_gate(leaves[0], leaves[1], leaves[2], mask, eps=eps), leaves, dout)

    def reference_step():
        with torch.enable_grad():
            torch.autograd.grad(engram_gate_reference(leaves[0], leaves[1], leaves[2], mask, eps=eps)[0], leaves,
                                dout)

    return {
        "validate inputs": lambda: api._check_inputs(x, kv, weight, mask, eps, 1e-6),
        "launch_forward (1 kernel)": lambda: eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=1e-6),
        "launch_backward (3 kernels)": lambda: eg.launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight,
                                                                  workspace, clamp=1e-6),
        "engram_gate_forward": lambda: engram_gate_forward(x, kv, weight, mask, eps=eps),
        "engram_gate_backward": lambda: engram_gate_backward(dout, x, kv, weight, mask, saved, eps=eps),
        "plan.forward": lambda: plan.forward(x, kv, weight, mask, out, saved),
        "plan.backward": lambda: plan.backward(dout, x, kv, weight, mask, saved, dx, dkv, dweight),
        "engram_gate fwd+bwd (autograd)": autograd_step,
        "eager model fwd+bwd (autograd)": reference_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    calls = parts(dev)
    sweep([{"part": name} for name in calls], lambda s: calls[s["part"]],
          lambda fn, s: host_us_samples(fn, dev), args.out, value="host_us", desc="engram host time")


if __name__ == "__main__":
    main()
