"""Time the cooperative one-kernel backward (cooperative_backward.py) against the shipped one.

    python experiments/engram_gate/explored/cooperative_backward/tune_cooperative.py OUT.csv [--grid G] [--n N]

Grids: ``token-blocks`` (the sweep of ``blocks-bwd-cooperative-token-blocks.csv``: token groups
8 / 16 / 32, channels per program 256 / 512, tokens per block 2 / 4 / 8, warps 4 / 8, lookahead
1 / 2); ``per-token`` (the grid of ``blocks-bwd-cooperative-per-token.csv`` on this kernel with
one token per block: groups 32 / 64, channels 128 / 256 / 512, warps 4 / 8, lookahead 1 / 2 / 4 /
8); ``looped`` (the looped kernel, ``blocks-bwd-cooperative-looped.csv``: groups 16 / 32, channels
256 / 512, tokens per block 4 / 8 / 16, lookahead 0 / 1, alone and after the forward). The
shipped two-kernel backward is timed in the same run, alone and after the forward. Method of
``experiments/engram_gate/tune_blocks.py`` (N = 4096, D = 5120, S = 4, bf16, CUDA Graph replay,
L2 overwritten before each call; each setting checked first against the float64 formula from
the same saved state).
"""

import argparse
import itertools

import cooperative_backward as coop
import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, checked_graph_samples, sweep
from dsfuse.engram_gate import engram_gate_backward_from_saved
from dsfuse.engram_gate.triton import kernels as eg

CLAMP = 1e-6
# groups, channels per program, tokens per block, warps, lookahead
GRIDS = {
    "token-blocks": list(itertools.product((8, 16, 32), (256, 512), (2, 4, 8), (4, 8), (1, 2))),
    "per-token": list(itertools.product((32, 64), (128, 256, 512), (1,), (4, 8), (1, 2, 4, 8))),
    "looped": list(itertools.product((16, 32), (256, 512), (4, 8, 16), (4,), (0, 1))),
}


def settings(grid: str) -> list[dict]:
    out = [dict(mode=f"{what}-two-kernel", elements=eg.TILE_BLOCK_D, warps=eg.TILE_WARPS, regime="evicted")
           for what in ("bwd", "fwd+bwd")]
    kind = "looped" if grid == "looped" else "coop"
    for groups, block_d, tokens, warps, lookahead in GRIDS[grid]:
        for what in ("bwd", "fwd+bwd") if grid == "looped" else ("bwd",):
            out.append(dict(mode=f"{what}-{kind}-groups{groups}-tokens{tokens}-look{lookahead}", elements=block_d,
                            warps=warps, regime="evicted", groups=groups, tokens=tokens, lookahead=lookahead))
    return out


def set_constants(s: dict, n: int, streams: int, dim: int) -> int:
    """The module constants of one setting; the workspace it needs."""
    coop.GROUPS, coop.BWD_BLOCK_D, coop.BWD_TOKENS, coop.BWD_WARPS, coop.LOOKAHEAD = (
        s["groups"], s["elements"], s["tokens"], s["warps"], s["lookahead"])
    return coop.workspace_elements(n, streams, dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="CSV to write (one row per sample)")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="token-blocks")
    parser.add_argument("--n", type=int, default=4096, help="tokens (default 4096)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    x, kv, weight, mask, dout, eps = gate_inputs(args.n, dev)
    n, streams, dim = x.shape
    out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device=dev)
    grads = (torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device=dev))
    todo = settings(args.grid)
    sizes = [set_constants(s, n, streams, dim) for s in todo if "groups" in s]
    workspace = torch.empty(max(sizes + [eg.workspace_elements(n, streams, dim)]), device=dev)
    coop.LOOPED = args.grid == "looped"

    def fwd():
        eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=CLAMP)

    fwd()
    want = engram_gate_backward_from_saved(dout, x, kv, weight, saved)

    def build(s):
        if "groups" in s:
            set_constants(s, n, streams, dim)
            bwd = lambda: coop.launch(dout, x, kv, weight, saved, *grads, workspace, clamp=CLAMP)  # noqa: E731
        else:
            bwd = lambda: eg.launch_backward(dout, x, kv, weight, saved, *grads, workspace, clamp=CLAMP)  # noqa: E731
        return (lambda: (fwd(), bwd())) if s["mode"].startswith("fwd+bwd") else bwd

    timer = Timer(dev, 256 << 20)
    sweep(todo, build, lambda fn, s: checked_graph_samples(fn, grads, want, timer, str(s)), args.out,
          desc=f"cooperative {args.grid}")


if __name__ == "__main__":
    main()
