"""One rank of the Gated DeltaNet context-parallel tests (``tests/gdn/test_gdn_cp.py``).

Each rank builds the same global inputs from a case's seed, runs ``chunk_gdn(..., cp_group=...)``
on its share twice (forward and backward, fresh leaves each time) and saves what it got, and
whether the two runs were bitwise equal, to ``<out>/<case>-<rank>.pt``. Every ``torch.empty*``
allocation is NaN-filled here too, as the tests' conftest does. The test process assembles the
shares and compares them with one process's result (:func:`single`).

    python tests/gdn/gdn_cp_worker.py OUT_DIR CASES.pt   # under torchrun (NCCL on the GPUs)
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _poison_empty() -> None:
    for name in ("empty", "empty_like", "empty_strided"):
        fn = getattr(torch, name)

        def poisoned(*args, _fn=fn, **kwargs):
            t = _fn(*args, **kwargs)
            if t.is_floating_point():
                with torch.no_grad():
                    t.fill_(float("nan"))
            return t

        setattr(torch, name, poisoned)


def make_inputs(case: dict, device) -> dict:
    """The case's global inputs (the same on every rank): a packed row, g, beta, h0 and the
    gradients that enter the backward (``do``; ``dht``, split over the ranks by weight). Without the
    L2 norm q and k are scaled to a norm of about 1 (as the model's normalised keys). With
    ``case["compute"]`` the values rounded to ``case["dtype"]`` are cast to that dtype (an oracle's
    inputs)."""
    from helpers import model_like_gates

    gen = torch.Generator().manual_seed(case["seed"])
    t, h, hv, d = case["bounds"][-1], case["heads"], case["value_heads"], case["dim"]
    dtype = case["dtype"]
    row = torch.randn(1, t, (2 * h + hv) * d, generator=gen)
    if not case["l2"]:
        row[..., : 2 * h * d] *= d**-0.5
    g, beta = model_like_gates((1, t, hv), gen, case.get("gates", "model"))
    n = len(case["bounds"]) - 1
    h0 = torch.randn(n, hv, d, d, generator=gen) * 0.5 if case["initial_state"] else None
    x = dict(row=row.to(dtype), g=g, beta=beta.to(dtype), h0=h0,
             do=torch.randn(1, t, hv, d, generator=gen).to(dtype), dht=torch.randn(n, hv, d, d, generator=gen))
    compute = case.get("compute")
    return {name: None if v is None else v.to(device=device, dtype=compute if compute and v.dtype == dtype else v.dtype)
            for name, v in x.items()}


def views(row, case: dict, packed: bool):
    from dsfuse.gdn import packed_qkv_views

    h, hv, d = case["heads"], case["value_heads"], case["dim"]
    if packed:
        return packed_qkv_views(row, h, hv)
    q, k, v = row.split([h * d, h * d, hv * d], -1)
    return q.unflatten(-1, (h, d)), k.unflatten(-1, (h, d)), v.unflatten(-1, (hv, d))


def run_once(case: dict, x: dict, lo: int, hi: int, group=None, dht_weight: float = 1.0) -> dict:
    """Forward and backward of tokens ``lo:hi`` (the whole row without ``group``) on fresh leaves."""
    from dsfuse.gdn import chunk_gdn

    row = x["row"][:, lo:hi].detach().clone().requires_grad_()
    g = x["g"][:, lo:hi].detach().clone().requires_grad_()
    beta = x["beta"][:, lo:hi].detach().clone().requires_grad_()
    h0 = None if x["h0"] is None else x["h0"].detach().clone().requires_grad_()
    cu = torch.tensor(case["bounds"], dtype=torch.int32)

    def call(row, g, beta, h0):
        q, k, v = views(row, case, case.get("packed", False))
        return chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=case["final_state"], cu_seqlens=cu,
                         use_qk_l2norm_in_kernel=case["l2"], backend=case["backend"], cp_group=group)

    if case.get("checkpoint"):  # the forward runs again in the backward (and its exchange with it)
        o, ht = torch.utils.checkpoint.checkpoint(call, row, g, beta, h0, use_reentrant=False)
    else:
        o, ht = call(row, g, beta, h0)
    loss = (o.float() * x["do"][:, lo:hi].float()).sum()
    if ht is not None:
        loss = loss + (ht * x["dht"]).sum() * dht_weight
    loss.backward()
    h, d = case["heads"], case["dim"]
    grad = row.grad
    out = dict(o=o.detach(), final_state=None if ht is None else ht.detach(),
               dq=grad[..., : h * d], dk=grad[..., h * d : 2 * h * d], dv=grad[..., 2 * h * d :],
               dg=g.grad, dbeta=beta.grad, dh0=None if h0 is None else h0.grad)
    return {name: None if t is None else t.detach().cpu() for name, t in out.items()}


def single(case: dict, device="cpu") -> dict:
    """One process's result on the whole row (no context parallelism)."""
    return run_once(case, make_inputs(case, device), 0, case["bounds"][-1])


@contextlib.contextmanager
def split_rule(split):
    """Within it, `chunk_gdn` splits long documents by ``SplitRule(*split)`` (``split``: ``(segment,
    above)`` in chunks; None: the default rule); yields the list of the split passes the schedule
    runs (``"state"``, ``"reverse"``)."""
    from dsfuse.gdn import schedule
    from dsfuse.gdn import split as split_mod

    passes: list[str] = []
    if split is None:
        yield passes
        return
    saved = split_mod.RULE, schedule.split_state_pass, schedule.split_state_backward
    real_pass, real_back = saved[1:]
    split_mod.RULE = split_mod.SplitRule(*split)
    schedule.split_state_pass = lambda *a, **k: passes.append("state") or real_pass(*a, **k)
    schedule.split_state_backward = lambda *a, **k: passes.append("reverse") or real_back(*a, **k)
    try:
        yield passes
    finally:
        split_mod.RULE, schedule.split_state_pass, schedule.split_state_backward = saved


def _bitwise_equal(a: dict, b: dict) -> bool:
    return all((a[n] is None and b[n] is None) or (a[n] is not None and torch.equal(a[n], b[n])
               and torch.equal(a[n].isnan(), b[n].isnan())) for n in a)


def run_rank(rank: int, world: int, init: str, out_dir: str, cases: list[dict], backend: str = "gloo") -> None:
    """Run every case on this rank; ``init``: the process group's ``init_method``."""
    from dsfuse.gdn import cp, cp_shards

    _poison_empty()
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = "cuda"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        for case in cases:
            shard = cp_shards(torch.tensor(case["bounds"]), world)[rank]
            x = make_inputs(case, device)
            weight = (rank + 1) / (world * (world + 1) / 2)  # the ranks' dht weights sum to 1
            with split_rule(case.get("split")) as passes:
                with cp.count_exchanged_bytes() as log:
                    first = run_once(case, x, shard.start, shard.end, dist.group.WORLD, weight)
                second = run_once(case, x, shard.start, shard.end, dist.group.WORLD, weight)
            torch.save(dict(result=first, repeat_equal=_bitwise_equal(first, second), exchanged=log,
                            shard=(shard.start, shard.end), split_passes=passes),
                       Path(out_dir) / f"{case['name']}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def assemble(out_dir, case: dict, world: int) -> tuple[dict, list[dict]]:
    """The ranks' shares joined along the tokens, ``dh0`` summed over the ranks in rank order; and
    each rank's saved record."""
    records = [torch.load(Path(out_dir) / f"{case['name']}-{r}.pt") for r in range(world)]
    parts = [rec["result"] for rec in records]
    joined = {name: torch.cat([p[name] for p in parts], dim=1) for name in ("o", "dq", "dk", "dv", "dg", "dbeta")}
    joined["final_state"] = parts[0]["final_state"]
    joined["dh0"] = None
    if parts[0]["dh0"] is not None:
        joined["dh0"] = parts[0]["dh0"].clone()
        for p in parts[1:]:
            joined["dh0"] += p["dh0"]
    return joined, records


if __name__ == "__main__":  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment
    import os

    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # this folder, and tests/ for helpers
    run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", sys.argv[1],
             torch.load(sys.argv[2]), backend="nccl")
