"""Gated DeltaNet context parallelism (``chunk_gdn(..., cp_group=...)``, ``dsfuse.gdn.cp``).

CPU (gloo, the reference backend): 1, 2, 3 and 4 ranks spawned by the test
(``tests/gdn/gdn_cp_worker.py``) against one process on the whole row: documents crossing no rank
boundary, one, and all of them (one document over every rank, so the middle ranks span theirs);
documents shorter than a share, of one token and empty; L2 norm on and off; with and without
initial and final state. Tolerances (relative RMS of every output and gradient against the single
process in the same dtype): fp64 1e-12, fp32 1e-5 (each share is chunked from its own start and the
merge adds a matrix product per boundary: fp32 rounding; observed <= 9e-7). One rank: bitwise
equal to the call without ``cp_group``. Every rank runs each case twice: bitwise equal; the final
state is the same on every rank, bitwise; each rank's initial-state gradient holds its own
documents' rows and zeros elsewhere. The bytes each rank exchanges are those of the module's
description. Checkpointed (``torch.utils.checkpoint``, non-reentrant): the forward and its exchange
run again in the backward, same results.

GPU (NCCL, the stages of every fused backend: the ``backend`` fixture): one rank bitwise equal to the call without ``cp_group`` (on one
GPU); two ranks (needs two GPUs) against one GPU and against the float64 recurrence with the
op's contract tolerances, bitwise repeatable, packed q/k/v views; the same with the long-document
split inside each rank's share.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gdn_cp_worker as worker
from helpers import assert_bitwise, assert_rel_rms

T = 150
LAYOUTS = {  # name: world size -> global cu_seqlens
    "no_crossing": lambda w: sorted({0, T, *(r * T // w for r in range(1, w)), *(r * T // w + 7 for r in range(w))}),
    "one_crossing": lambda w: [0, 1, 20, 20, T // w - 9, T // w + 4, T // w + 5, T],
    "one_document": lambda w: [0, T],
    "short_documents": lambda w: [0, 10, 23, 24, 40, 64, 65, 100, 129, T],
}
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def cases(world: int) -> list[dict]:
    out = []
    for i, (layout, bounds) in enumerate(LAYOUTS.items()):
        for dtype in (torch.float32, torch.float64):
            for j, (l2, h0, final) in enumerate([(True, True, True), (False, False, False)]):
                heads = 2 if layout == "short_documents" else 1
                out.append(dict(name=f"{layout}-{str(dtype)[6:]}-{'l2' if l2 else 'raw'}-{'h0' if h0 else 'zero'}-"
                                     f"{'ht' if final else 'noht'}",
                                bounds=bounds(world), heads=heads, value_heads=2 * heads, dim=16, dtype=dtype,
                                l2=l2, initial_state=h0, final_state=final, backend="reference",
                                seed=100 * i + 10 * j + world))
    # torch.utils.checkpoint (non-reentrant) around the call: recomputed forward, same results
    out += [dict(c, name=c["name"] + "-ckpt", checkpoint=True) for c in out
            if c["name"] in ("one_document-float32-l2-h0-ht", "one_crossing-float64-raw-zero-noht")]
    return out


def _spawn(world: int, tmp_path, case_list, backend="gloo"):
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(worker.run_rank, args=(world, init, str(tmp_path), case_list, backend), nprocs=world, join=True)


def _compare(got: dict, want: dict, tol: float, what: str) -> dict:
    errs = {}
    for name, w in want.items():
        if w is None:
            assert got[name] is None, f"{what} {name}: expected None"
            continue
        assert got[name].shape == w.shape and got[name].dtype == w.dtype, (what, name, got[name].shape, w.shape)
        errs[name] = assert_rel_rms(got[name], w.double(), tol, f"{what} {name}")
    return errs


def _check_records(records: list[dict], case: dict, world: int) -> None:
    for rank, rec in enumerate(records):
        assert rec["repeat_equal"], f"{case['name']}: rank {rank}'s two runs differ"
    if case["final_state"]:
        for rank, rec in enumerate(records[1:], 1):
            assert_bitwise(rec["result"]["final_state"], records[0]["result"]["final_state"],
                           f"{case['name']}: final state on rank {rank} vs rank 0")


def _expected_exchange(case: dict, world: int, rank: int) -> list[tuple[str, int, int]]:
    """What the module's description says a rank sends and receives (bytes) for one forward and backward."""
    shards = worker_shards(case, world)
    item = 8 if case["dtype"] == torch.float64 else 4
    hv, d, n = case["value_heads"], case["dim"], len(case["bounds"]) - 1
    state = hv * d * d * item
    crossing, spanning = any(s.to_next for s in shards), any(s.spans for s in shards)
    forward, backward = [], []
    if crossing:
        forward.append(("forward: E", state, state * (world - 1)))
        if spanning:
            forward.append(("forward: M", state, state * (world - 1)))
    if case["final_state"]:
        forward.append(("forward: final states", n * state, n * state * (world - 1)))
        backward.append(("backward: final-state gradients", n * state, n * state * (world - 1)))
    if crossing:
        backward.append(("backward: D", state, state * (world - 1)))
    # checkpointed: the forward (and its exchange) runs again at the start of the backward
    return forward + (forward if case.get("checkpoint") else []) + backward


def worker_shards(case, world):
    from dsfuse.gdn import cp_shards

    return cp_shards(torch.tensor(case["bounds"]), world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cpu_ranks_against_one_process(world, tmp_path):
    case_list = cases(world)
    _spawn(world, tmp_path, case_list)
    for case in case_list:
        joined, records = worker.assemble(tmp_path, case, world)
        _check_records(records, case, world)
        want = worker.single(case)
        _compare(joined, want, TOL[case["dtype"]], f"{case['name']} W={world}")
        shards = worker_shards(case, world)
        for rank, rec in enumerate(records):
            assert rec["exchanged"] == _expected_exchange(case, world, rank), (case["name"], rank, rec["exchanged"])
            dh0 = rec["result"]["dh0"]
            if dh0 is not None:  # each rank holds the rows of the documents that start in its share, zeros elsewhere
                owned = [d for i, d in enumerate(shards[rank].docs) if not (i == 0 and shards[rank].from_prev)]
                others = [d for d in range(dh0.shape[0]) if d not in owned]
                assert torch.equal(dh0[others], torch.zeros_like(dh0[others])), (case["name"], rank)
                if owned:
                    assert_rel_rms(dh0[owned], want["dh0"][owned].double(), TOL[case["dtype"]],
                                   f"{case['name']} rank {rank} dh0 rows")


def test_cpu_one_rank_equals_no_cp(tmp_path):
    case_list = [c for c in cases(1) if c["name"].startswith(("one_document", "short_documents"))]
    _spawn(1, tmp_path, case_list)
    for case in case_list:
        joined, records = worker.assemble(tmp_path, case, 1)
        _check_records(records, case, 1)
        want = worker.single(case)
        for name, w in want.items():
            if w is not None:
                assert_bitwise(joined[name], w, f"{case['name']} {name}")
        assert records[0]["exchanged"] == ([] if not case["final_state"] else _expected_exchange(case, 1, 0))


@pytest.mark.serves("stages")  # context parallelism runs the backends of stages
def test_cpu_fused_stages_three_ranks(backend, tmp_path):
    """The fused path of context parallelism (``cp_local.fused_passes``: the stages, the reverse
    pass alone for ``D``, the packed gradient row) on each fused backend that runs on the CPU (Triton's
    interpreter), against one process."""
    case_list = [dict(c, backend=backend, packed=True) for c in cases(3)
                 if c["name"] in ("one_crossing-float32-l2-h0-ht", "one_document-float32-raw-zero-noht")]
    _spawn(3, tmp_path, case_list)  # three ranks: the middle one spans its document (the M pass)
    for case in case_list:
        joined, records = worker.assemble(tmp_path, case, 3)
        _check_records(records, case, 3)
        _compare(joined, worker.single(case), TOL[case["dtype"]], f"{case['name']} {backend} W=3")


@pytest.mark.serves("stages")  # the backends whose state passes split long documents
def test_cpu_split_documents_across_two_ranks(backend, tmp_path):
    """The long-document split (`dsfuse.gdn.split`, here segments of 2 chunks for documents over 3)
    inside each rank's share under context parallelism: one document of 513 tokens crosses the two
    ranks and is cut on both (its share has five chunks on rank 0 and four on rank 1, each ending in
    a partial one), a short one on each rank stays whole. Against one process without the split
    (fp32 tolerance), bitwise run to run on each rank; each rank ran the split's forward and reverse
    passes."""
    bounds = [0, 7, 520, 600]
    case = dict(name="split-float32-l2-h0-ht", bounds=bounds, heads=1, value_heads=2, dim=16, dtype=torch.float32,
                l2=True, initial_state=True, final_state=True, backend=backend, packed=True, seed=7, split=(2, 3))
    _spawn(2, tmp_path, [case])
    joined, records = worker.assemble(tmp_path, case, 2)
    _check_records(records, case, 2)
    _compare(joined, worker.single(dict(case, split=None)), TOL[case["dtype"]], f"{case['name']} {backend} W=2")
    for rank, rec in enumerate(records):
        assert {"state", "reverse"} <= set(rec["split_passes"]), (rank, rec["split_passes"])


def test_shards():
    from dsfuse.gdn import cp_shards

    # docs: [0,5) [5,5) [5,30) [30,31) [31,40); shares 0:13, 13:26, 26:40
    s = cp_shards(torch.tensor([0, 5, 5, 30, 31, 40], dtype=torch.int32), 3)
    assert [(x.start, x.end) for x in s] == [(0, 13), (13, 26), (26, 40)]
    assert [list(x.docs) for x in s] == [[0, 1, 2], [2], [2, 3, 4]]
    assert [x.bounds for x in s] == [[0, 5, 5, 13], [0, 13], [0, 4, 5, 14]]
    assert [(x.from_prev, x.to_next, x.spans) for x in s] == [(False, True, False), (True, True, True),
                                                              (True, False, False)]
    # a document ending on a share's edge crosses nothing; an empty one there belongs to the next share
    s = cp_shards(torch.tensor([0, 20, 20, 40]), 2)
    assert [list(x.docs) for x in s] == [[0], [1, 2]] and not s[0].to_next and not s[1].from_prev
    s = cp_shards(torch.tensor([0, 40, 40]), 2)  # empty last document at T: the last rank
    assert [list(x.docs) for x in s] == [[0], [0, 1]] and s[1].bounds == [0, 20, 20]
    with pytest.raises(ValueError, match="cannot give each of 4 ranks"):
        cp_shards(torch.tensor([0, 3]), 4)
    with pytest.raises(ValueError, match="non-decreasing"):
        cp_shards(torch.tensor([0, 5, 3]), 2)
    with pytest.raises(TypeError, match="int32 or int64"):
        cp_shards(torch.tensor([0.0, 3.0]), 1)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_validation(one_rank_group):
    from dsfuse.gdn import chunk_gdn

    q = k = torch.randn(1, 10, 1, 16)
    v = torch.randn(1, 10, 2, 16)
    g, beta = -torch.rand(1, 10, 2), torch.rand(1, 10, 2)
    cu = torch.tensor([0, 4, 10])
    with pytest.raises(ValueError, match="cu_seqlens .* is required"):
        chunk_gdn(q, k, v, g, beta, cp_group=one_rank_group)
    with pytest.raises(ValueError, match="holds tokens 0:12"):
        chunk_gdn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 12]), cp_group=one_rank_group)
    with pytest.raises(TypeError, match="ProcessGroup"):
        chunk_gdn(q, k, v, g, beta, cu_seqlens=cu, cp_group="world")
    with pytest.raises(ValueError, match=r"initial_state: .*\[N, HV, K, V\] for the N documents"):
        chunk_gdn(q, k, v, g, beta, cu_seqlens=cu, cp_group=one_rank_group, initial_state=torch.zeros(1, 2, 16, 16))
    with pytest.raises(ValueError, match="expected B = 1"):
        chunk_gdn(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), g.expand(2, -1, -1),
                  beta.expand(2, -1, -1), cu_seqlens=cu, cp_group=one_rank_group)
    o, ht = chunk_gdn(q, k, v, g, beta, cu_seqlens=cu, cp_group=one_rank_group, output_final_state=True)
    assert o.shape == v.shape and ht.shape == (2, 2, 16, 16)


def test_validation_without_process_group():
    from dsfuse.gdn import chunk_gdn

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    x = torch.randn(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="not initialised"):
        chunk_gdn(x, x, x, -torch.rand(1, 4, 1), torch.rand(1, 4, 1), cu_seqlens=torch.tensor([0, 4]),
                  cp_group=object())


# -- GPU (NCCL, every fused backend) ----------------------------------------------------------------------

GPU_BOUNDS = [0, 300, 1000, 1001, 2100, 2200, 2500, 4096]  # crosses the two-rank edge at 2048


def gpu_cases(backend: str, **extra) -> list[dict]:
    out = []
    for i, (l2, h0, packed) in enumerate([(True, True, True), (False, False, False)]):
        out.append(dict(name=f"gpu-{'l2' if l2 else 'raw'}-{'h0' if h0 else 'zero'}-{'packed' if packed else 'split'}",
                        bounds=GPU_BOUNDS, heads=4, value_heads=12, dim=128, dtype=torch.bfloat16, l2=l2,
                        initial_state=h0, final_state=True, backend=backend, packed=packed, seed=7 + i) | extra)
    return out


@pytest.mark.gpu
@pytest.mark.serves("stages")  # context parallelism runs the backends of stages
def test_gpu_one_rank_equals_no_cp(backend, tmp_path):
    case_list = gpu_cases(backend) + gpu_cases(backend, bounds=[0, 4096], name="gpu-one-document")[:1]
    _spawn(1, tmp_path, case_list, backend="nccl")
    for case in case_list:
        joined, records = worker.assemble(tmp_path, case, 1)
        _check_records(records, case, 1)
        want = worker.single(case, "cuda")
        for name, w in want.items():
            if w is not None:
                assert_bitwise(joined[name], w, f"{case['name']} {name}")


@pytest.mark.gpu
@pytest.mark.serves("stages")  # context parallelism runs the backends of stages
def test_gpu_two_ranks(backend, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (device kind nvidia-h200-x2)")
    case_list = gpu_cases(backend) + gpu_cases(backend, bounds=[0, 700, 4096], name="gpu-long-document")[:1]
    _spawn(2, tmp_path, case_list, backend="nccl")
    from test_gdn_backward import CONTRACT  # the op's tolerances against float64

    for case in case_list:
        joined, records = worker.assemble(tmp_path, case, 2)
        _check_records(records, case, 2)
        one_gpu = worker.single(case, "cuda")
        # the two-rank result against one GPU: bf16 rounding of differently chunked shares
        _compare(joined, one_gpu, 8e-3, f"{case['name']} 2 ranks vs 1 GPU")
        oracle = worker.single(case | dict(compute=torch.float64, backend="reference", packed=False), "cuda")
        for name, want in oracle.items():
            if want is not None:
                assert_rel_rms(joined[name], want, CONTRACT[name], f"{case['name']} 2 ranks vs float64 {name}")


@pytest.mark.gpu
@pytest.mark.serves("stages")  # the backends whose state passes split long documents
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_split_documents_across_ranks(backend, world, tmp_path):
    """The long-document split (segments of 8 chunks for documents over 16) inside each rank's share,
    on GPUs: a document of 3,600 tokens (57 chunks) crosses the two ranks' edge at 2,048 and is cut
    on both, the documents around it stay whole. One rank: bitwise the call without ``cp_group`` under
    the same split. Two ranks (two GPUs): against one GPU without the split (bf16, as
    `test_gpu_two_ranks`) and against the float64 recurrence within the op's tolerances. Every rank:
    bitwise run to run, and it ran the split's forward and reverse passes."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (device kind nvidia-h200-x2)")
    case_list = gpu_cases(backend, bounds=[0, 300, 3900, 4096], split=(8, 16))
    case_list = [dict(c, name=c["name"] + "-segments") for c in case_list]
    _spawn(world, tmp_path, case_list, backend="nccl")
    from test_gdn_backward import CONTRACT  # the op's tolerances against float64

    for case in case_list:
        joined, records = worker.assemble(tmp_path, case, world)
        _check_records(records, case, world)
        for rank, rec in enumerate(records):
            assert {"state", "reverse"} <= set(rec["split_passes"]), (case["name"], rank, rec["split_passes"])
        if world == 1:
            with worker.split_rule(case["split"]) as passes:
                want = worker.single(case, "cuda")
            assert {"state", "reverse"} <= set(passes), passes
            for name, w in want.items():
                if w is not None:
                    assert_bitwise(joined[name], w, f"{case['name']} {name}")
            continue
        _compare(joined, worker.single(dict(case, split=None), "cuda"), 8e-3, f"{case['name']} 2 ranks vs 1 GPU")
        oracle = worker.single(case | dict(compute=torch.float64, backend="reference", packed=False, split=None),
                               "cuda")
        for name, want in oracle.items():
            if want is not None:
                assert_rel_rms(joined[name], want, CONTRACT[name], f"{case['name']} 2 ranks vs float64 {name}")


def test_cp_bench_smoke_on_cpu_ranks(tmp_path):
    """``experiments/gdn/cp_bench.py`` end to end on two gloo ranks (the smoke config, the reference
    backend): it writes its raw files and renders them; the shares match one process."""
    import subprocess
    from pathlib import Path

    import pandas as pd

    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "kernels"), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(root / "experiments/gdn/cp_bench.py"), str(tmp_path), "--config",
                    str(root / "experiments/gdn/configs/smoke.yaml"), "--samples", "1", "--device", "cpu"],
                   check=True, env=env, cwd=root, capture_output=True, timeout=600)
    (raw,) = tmp_path.glob("*-cp2")
    check = pd.read_csv(raw / "cp_check.csv")
    assert len(check) == 2 * 8 and (check["rel_rms_vs_one_gpu"] < 1e-5).all(), check
    times = pd.read_csv(raw / "cp_times.csv")
    assert set(times["provider"]) == {"cp", "local", "1 GPU"} and set(times["mode"]) == {"fwd", "bwd", "fwd+bwd", "ckpt"}
    from importlib import util

    spec = util.spec_from_file_location("cp_bench", root / "experiments/gdn/cp_bench.py")
    bench = util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    text = bench.render(raw)
    assert "| fwd+bwd |" in text and "forward: E" in text
    scaling = bench.render_scaling([raw, raw])
    assert scaling.count("| fwd+bwd |") == 2 and "| 2 | fwd |" in scaling


def test_cp_scaling_table(tmp_path):
    """The scaling table: each run's step (the slowest rank per sample, median) against its own one-GPU
    time, the speedup and the speedup per GPU, sorted by tokens and world size."""
    from importlib import util
    from pathlib import Path

    import pandas as pd

    root = Path(__file__).parents[2]
    spec = util.spec_from_file_location("cp_bench", root / "experiments/gdn/cp_bench.py")
    bench = util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    raws = []
    for world, tokens in ((4, 65536), (2, 32768)):
        raw = tmp_path / f"r{world}"
        raw.mkdir()
        (raw / "config.yaml").write_text(f"tokens: {tokens}\n")
        rows = [dict(rank=r, world=world, provider="cp", mode=m, sample=s, us=100.0 + 10 * r + s)
                for r in range(world) for m in bench.MODES for s in range(3)]
        rows += [dict(rank=0, world=world, provider="1 GPU", mode=m, sample=s, us=300.0) for m in bench.MODES
                 for s in range(3)]
        pd.DataFrame(rows).to_csv(raw / "cp_times.csv", index=False)
        raws.append(raw)
    lines = bench.render_scaling(raws).splitlines()
    assert lines[2] == "| `r2` | 32,768 | 2 | fwd | 300 | 111 | 2.70x | 1.35 |"  # slowest rank 1: 110 + sample 1
    assert lines[6] == "| `r4` | 65,536 | 4 | fwd | 300 | 131 | 2.29x | 0.57 |"
