"""Gated DeltaNet context parallelism: per-rank step times, bytes exchanged, and a check against one GPU.

    torchrun --nproc_per_node 2 experiments/gdn/cp_bench.py OUT_DIR [--config experiments/gdn/configs/h200.yaml]
        [--samples 10] [--device cpu]
    python experiments/gdn/cp_bench.py --render RAW_DIR OUT.md
    python experiments/gdn/cp_bench.py --render-scaling OUT.md RAW_DIR [RAW_DIR ...]   # 1, 2, 4, 8 GPUs

At the experiment's shape (the config's tokens, documents and geometry: by default the H200 config,
T = 32,768 tokens in five documents, (H, HV) = (16, 48), head dim 128, bf16, L2 norm in the kernel,
initial state and final state), each of the W ranks holds its share of the packed row
(:func:`dsfuse.gdn.cp_shards`; q, k, v as :func:`~dsfuse.gdn.packed_qkv_views` of the share) and
times, eagerly (collectives and host work included), after a barrier and with the L2 overwritten
before each sample (CUDA events on its own GPU):

* ``cp``: ``chunk_gdn(..., cp_group=WORLD)``;
* ``local``: the same share's documents without context parallelism (``cu_seqlens`` of the share,
  documents cut at the share's edges, no exchange: not the model's result, the kernels' time on the
  share alone), so ``cp - local`` is what crossing the ranks costs;
* ``1 GPU``: rank 0 alone on the whole row without context parallelism (the others wait).

Modes: ``fwd`` (no autograd), ``bwd`` (the backward of a forward done before the sample),
``fwd+bwd``, ``ckpt`` (``torch.utils.checkpoint``: two forwards, one backward). The loss is
``sum(o * do)`` on every rank plus ``sum(final_state * dht)`` on rank 0.

Also, per rank, the bytes each collective of one ``fwd+bwd`` sends and receives
(:func:`dsfuse.gdn.cp.count_exchanged_bytes`), and the relative RMS of its share of every output
and gradient against the same step on one GPU (each rank runs it on its own GPU; the initial
state's gradient summed over the ranks).

Writes ``cp_times.csv`` (``rank, world, provider, mode, sample, us``), ``cp_bytes.csv``,
``cp_check.csv``, ``env.json`` and ``config.yaml`` under ``OUT_DIR/<run-id>-cp<W>/`` (rank 0);
``--render`` makes the Markdown tables the docs include.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dsfuse.bench import env as env_mod
from dsfuse.bench import gdn
from dsfuse.bench.harness import load_config, new_run_id, rel_rms, write_csv
from dsfuse.bench.paths import cli_path

DEFAULT_CONFIG = "experiments/gdn/configs/h200.yaml"
FLUSH_BYTES = 512 << 20
MODES = ("fwd", "bwd", "fwd+bwd", "ckpt")
CHECKED = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


class Step:
    """One provider's step on this rank: ``run(mode)`` and ``outputs()`` of its last fwd+bwd."""

    def __init__(self, x: dict, lo: int, hi: int, p: dict, group, cu_seqlens, final_weight: float):
        self.x, self.lo, self.hi, self.p, self.group, self.cu = x, lo, hi, p, group, cu_seqlens
        self.final_weight = final_weight
        self.result = None

    def _forward(self, grad: bool):
        from dsfuse.gdn import chunk_gdn, packed_qkv_views

        x, lo, hi = self.x, self.lo, self.hi
        row = x["row"][lo:hi].detach().requires_grad_(grad)
        g, beta = (x[n][:, lo:hi].detach().requires_grad_(grad) for n in ("g", "beta"))
        h0 = x["initial_state"].detach().requires_grad_(grad)
        leaves = dict(row=row, g=g, beta=beta, h0=h0)

        def fn(row, g, beta, h0):
            q, k, v = packed_qkv_views(row, self.p["heads"], self.p["value_heads"])  # [1, T, heads, D]
            return chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=self.cu,
                             use_qk_l2norm_in_kernel=self.p["l2norm"], cp_group=self.group)

        return fn, leaves

    def _loss(self, o, ht):
        loss = (o.float() * self.x["do"][:, self.lo:self.hi].float()).sum()
        return loss + (ht * self.x["dht"]).sum() * self.final_weight

    def run(self, mode: str, prepared=None):
        if mode == "fwd":
            fn, leaves = self._forward(False)
            with torch.no_grad():
                return fn(**leaves)
        if mode == "bwd":
            prepared[0].backward()
            return None
        fn, leaves = self._forward(True)
        if mode == "ckpt":
            o, ht = torch.utils.checkpoint.checkpoint(fn, *leaves.values(), use_reentrant=False)
        else:
            o, ht = fn(**leaves)
        self._loss(o, ht).backward()
        self.result = (o, ht, leaves)
        return None

    def prepare_bwd(self):
        fn, leaves = self._forward(True)
        o, ht = fn(**leaves)
        return (self._loss(o, ht),)

    def outputs(self) -> dict:
        o, ht, leaves = self.result
        h, d = self.p["heads"], self.p["head_dim"]
        grad = leaves["row"].grad
        return dict(o=o.detach(), final_state=ht.detach(), dq=grad[:, : h * d], dk=grad[:, h * d : 2 * h * d],
                    dv=grad[:, 2 * h * d :], dg=leaves["g"].grad, dbeta=leaves["beta"].grad, dh0=leaves["h0"].grad)


def timed(fn, device, flush, prepare=None) -> float:
    prepared = prepare() if prepare else None
    dist.barrier()
    if device.type != "cuda":
        import time

        t0 = time.perf_counter()
        fn(prepared)
        return (time.perf_counter() - t0) * 1e6
    flush.add_(1.0)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(prepared)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"]:
        if len(argv) != 3:
            raise SystemExit("usage: cp_bench.py --render RAW_DIR OUT.md")
        Path(argv[2]).write_text(render(Path(argv[1])))
        return 0
    if argv[:1] == ["--render-scaling"]:
        if len(argv) < 3:
            raise SystemExit("usage: cp_bench.py --render-scaling OUT.md RAW_DIR [RAW_DIR ...]")
        Path(argv[1]).write_text(render_scaling([Path(a) for a in argv[2:]]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: gloo and the reference backend (a smoke run of this script)")
    args = parser.parse_args(argv)
    from dsfuse.gdn import cp, cp_shards

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device(args.device, torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = load_config(cli_path(args.config))
    case = gdn.cases(config | {"modes": ["fwd+bwd"], "l2norm": [True]})[0]
    p = case.params
    x = gdn.make_inputs(case, device, seed=0)
    shard = cp_shards(torch.tensor(p["bounds"]), world)[rank]
    flush = torch.empty(FLUSH_BYTES // 4, device=device) if cuda else None
    world_group = dist.group.WORLD
    steps = {"cp": Step(x, shard.start, shard.end, p, world_group, x["cu_seqlens"], 1.0 if rank == 0 else 0.0),
             "local": Step(x | dict(initial_state=x["initial_state"][list(shard.docs)].contiguous(),
                                    dht=x["dht"][list(shard.docs)]),
                           shard.start, shard.end, p, None, shard.cu_seqlens.to(torch.int32), 1.0)}
    full = Step(x, 0, p["tokens"], p, None, x["cu_seqlens"], 1.0)

    # the check: this rank's share against one GPU's whole-row step
    full.run("fwd+bwd")
    one = full.outputs()
    with cp.count_exchanged_bytes() as log:
        steps["cp"].run("fwd+bwd")
    got = steps["cp"].outputs()
    dist.all_reduce(got["dh0"])  # each rank holds the rows of its documents
    lo, hi = shard.start, shard.end
    check_rows = []
    for name in CHECKED:
        want = one[name]
        if name in ("o", "dg", "dbeta"):
            want = want[:, lo:hi]
        elif name in ("dq", "dk", "dv"):
            want = want[lo:hi]
        check_rows.append(dict(rank=rank, world=world, output=name,
                               rel_rms_vs_one_gpu=f"{rel_rms(got[name], want):.3e}"))
    byte_rows = [dict(rank=rank, world=world, collective=n, sent_bytes=s, received_bytes=r) for n, s, r in log]
    del one, got

    # the times
    rows = []
    for mode in MODES:
        for provider, step in steps.items():
            prepare = step.prepare_bwd if mode == "bwd" else None
            step.run(mode, prepare() if prepare else None)  # warm-up
            for i in range(args.samples):
                us = timed(lambda prepared, step=step, mode=mode: step.run(mode, prepared), device, flush, prepare)
                rows.append(dict(rank=rank, world=world, provider=provider, mode=mode, sample=i, us=us))
        for i in range(args.samples):  # rank 0 alone, the whole row
            prepare = full.prepare_bwd if (mode == "bwd" and rank == 0) else None
            if rank == 0:
                us = timed(lambda prepared, mode=mode: full.run(mode, prepared), device, flush, prepare)
                rows.append(dict(rank=0, world=world, provider="1 GPU", mode=mode, sample=i, us=us))
            else:
                dist.barrier()

    gathered = [None] * world
    dist.all_gather_object(gathered, (rows, byte_rows, check_rows))
    if rank == 0:
        env = env_mod.collect(device, op=gdn.OP)
        env["world_size"] = world
        out = args.out / f"{new_run_id(env, smoke=not cuda)}-cp{world}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "env.json").write_text(json.dumps(env, indent=2) + "\n")
        shutil.copy(cli_path(args.config), out / "config.yaml")
        for i, name in enumerate(("cp_times.csv", "cp_bytes.csv", "cp_check.csv")):
            write_csv(out / name, [r for part in gathered for r in part[i]])
        print(render(out))
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


def render(raw: Path) -> str:
    """Markdown tables of a raw folder (medians per rank; a step's time is its slowest rank's)."""
    import pandas as pd

    env = json.loads((raw / "env.json").read_text())
    times = pd.read_csv(raw / "cp_times.csv")
    world = int(times["world"].iloc[0])
    lines = [f"Run `{raw.name}` ({env.get('gpu_name') or 'CPU'} x {world}, commit "
             f"`{str(env.get('git_commit', '?'))[:10]}`): eager, L2 overwritten before each sample, median of "
             f"{times.groupby(['rank', 'provider', 'mode']).size().min()} samples; `cp`: the context-parallel call "
             "on each rank's share; `local`: the same share's documents alone, no exchange; `1 GPU`: the whole row "
             "on one GPU. The step: per sample, the slowest rank.", "",
             "| mode | 1 GPU us | " + " | ".join(f"cp rank {r} us" for r in range(world)) + " | cp step us | "
             + " | ".join(f"local rank {r} us" for r in range(world)) + " | 1 GPU / cp step |",
             "| --- |" + " ---: |" * (2 * world + 3)]
    med = times.groupby(["provider", "mode", "rank"])["us"].median()
    for mode in MODES:
        step = times[(times["provider"] == "cp") & (times["mode"] == mode)].groupby("sample")["us"].max().median()
        one = med.get(("1 GPU", mode, 0), float("nan"))
        cells = [f"{one:.0f}"] + [f"{med[('cp', mode, r)]:.0f}" for r in range(world)] + [f"{step:.0f}"]
        cells += [f"{med[('local', mode, r)]:.0f}" for r in range(world)] + [f"{one / step:.2f}x"]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    nbytes = pd.read_csv(raw / "cp_bytes.csv")
    lines += ["", "**Bytes exchanged per rank** in one forward + backward (with the final state):", "",
              "| rank | collective | sent MiB | received MiB |", "| --- | --- | ---: | ---: |"]
    for _, r in nbytes.iterrows():
        lines.append(f"| {r['rank']} | {r['collective']} | {r['sent_bytes'] / 2**20:.2f} | "
                     f"{r['received_bytes'] / 2**20:.2f} |")
    check = pd.read_csv(raw / "cp_check.csv")
    worst = check.groupby("output")["rel_rms_vs_one_gpu"].max()
    lines += ["", "Each rank's share against one GPU (relative RMS, the worst rank): "
              + ", ".join(f"{n} {worst[n]:.1e}" for n in CHECKED if n in worst) + "."]
    return "\n".join(lines) + "\n"


def render_scaling(raws: list[Path]) -> str:
    """One table over several runs (world sizes, sequence lengths): per mode the step on W GPUs, the
    same run's one-GPU time, the speedup and the speedup per GPU (1.00 would be a perfect split)."""
    import pandas as pd
    import yaml

    lines = ["| run | tokens | GPUs | mode | 1 GPU us | cp step us | speedup | per GPU |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    rows = []
    for raw in raws:
        times = pd.read_csv(raw / "cp_times.csv")
        tokens = yaml.safe_load((raw / "config.yaml").read_text())["tokens"]
        world = int(times["world"].iloc[0])
        for mode in MODES:
            cp = times[(times["provider"] == "cp") & (times["mode"] == mode)]
            step = cp.groupby("sample")["us"].max().median()
            one = times[(times["provider"] == "1 GPU") & (times["mode"] == mode)]["us"].median()
            rows.append((tokens, world, MODES.index(mode), raw.name, mode, one, step))
    for tokens, world, _, run, mode, one, step in sorted(rows):
        lines.append(f"| `{run}` | {tokens:,} | {world} | {mode} | {one:.0f} | {step:.0f} | {one / step:.2f}x | "
                     f"{one / step / world:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
