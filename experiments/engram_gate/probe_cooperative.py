"""Probe: where the cooperative backward loses time (variants built from the shipped kernel's source).

    python experiments/engram_gate/probe_cooperative.py OUT.csv

Variants of ``cooperative_backward.py``: ``full`` (as it is); ``nosync`` (no release count, no wait: the totals are read
whenever they are there, so results are wrong; timing only); ``local`` (nosync, and each
program uses only its own chunk's sum: no cross-program traffic at all). Prints registers and
spills per setting. N = 4096, D = 5120, CUDA Graph replay, L2 overwritten before each call.
"""

import importlib.util
import itertools
import sys
import tempfile
import textwrap
from pathlib import Path

import cooperative_backward as coop
import torch

from dsfuse.bench.engram_gate import gate_inputs
from dsfuse.bench.harness import Timer, capture_graph, write_csv
from dsfuse.engram_gate import triton as eg

SHIPPED = coop._engram_bwd_kernel
WAIT = """                while tl.atomic_add(p_cnt + i_b, 0, sem="acquire", scope="gpu") < N_CHUNKS:
                    pass
"""
PUBLISH = """                tl.debug_barrier()  # every thread's sums are stored before the count says so
                tl.atomic_add(p_cnt + i_b, 1, sem="release", scope="gpu")
"""


def variant(name):
    src = textwrap.dedent(SHIPPED.src)
    if name != "full":
        assert WAIT in src and PUBLISH in src
        src = src.replace(WAIT, "").replace(PUBLISH, "")
    if name == "local":
        src = src.replace("mask=(o_c < N_CHUNKS)[None, :, None]", "mask=(o_c == c0)[None, :, None]")
    path = Path(tempfile.mkdtemp()) / f"probe_{name}.py"  # Triton reads a kernel's source from its file
    path.write_text("import triton\nimport triton.language as tl\n"
                    "from dsfuse.engram_gate.triton import _grad_coefficients, _grad_tile\n\n"
                    '@triton.jit(do_not_specialize=["n_tokens", "n_groups"])\n' + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._engram_bwd_kernel


x, kv, weight, mask, dout, eps = gate_inputs(4096, torch.device("cuda"))
n, streams, dim = x.shape
out, saved = torch.empty_like(x), torch.empty(n, streams, 4, device="cuda")
eg.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=1e-6)
dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(streams, dim, device="cuda")
workspace = torch.empty(64 << 20, device="cuda")
timer = Timer(torch.device("cuda"), 256 << 20)
rows = []
kernels = {name: variant(name) for name in ("full", "nosync", "local")}
for (tokens, block_d, warps), name in itertools.product(
        [(1, 256, 4), (1, 512, 4), (2, 256, 4), (4, 128, 4), (2, 512, 8), (4, 256, 8)], kernels):
    coop.GROUPS, coop.BWD_TOKENS, coop.BWD_BLOCK_D, coop.BWD_WARPS, coop.LOOKAHEAD = 32, tokens, block_d, warps, 2
    coop._engram_bwd_kernel = kernels[name]
    fn = lambda: coop.launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=1e-6)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    compiled = list(kernels[name].device_caches[torch.cuda.current_device()][0].values())[-1]
    graph, _ = capture_graph(lambda: (fn(),), torch.device("cuda"))
    us = timer.samples(graph.replay, "evicted", 10, 5)
    rows += [dict(variant=name, tokens=tokens, elements=block_d, warps=warps, regs=compiled.n_regs,
                  spills=compiled.n_spills, sample=i, us=round(u, 3)) for i, u in enumerate(us)]
    print(name, tokens, block_d, warps, "regs", compiled.n_regs, "spills", compiled.n_spills,
          "us", round(sorted(us)[len(us) // 2], 1), flush=True)
coop._engram_bwd_kernel = SHIPPED
write_csv(sys.argv[1], rows)
