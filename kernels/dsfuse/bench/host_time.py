"""Host (CPU) time per eager call of every op, next to eager PyTorch and a bare Triton launch.

    python -m dsfuse.bench.host_time run [OPS]      # on a GPU: experiments/<op>/raw/host-time/<run-id>/
    python -m dsfuse.bench.host_time profile [OPS]  # cProfile of the dsfuse calls (where the time goes)
    python -m dsfuse.bench.host_time report [OPS]   # results/<gpu>/<op>_host_time.md from each GPU's
                                                    # newest run (also written by python -m dsfuse.bench report)

Tensors are tiny, so the GPU idles and a loop of calls without synchronisation measures what
the CPU spends to validate, choose a backend, allocate and enqueue. Each op lists its calls
(the dsfuse entry point and the eager PyTorch equivalent, forward and autograd
forward+backward) and the parts of its forward (validation, backend choice, launches); two
baselines run in the same process: a bare Triton launch of a trivial kernel and a ``torch.add``.
Targets: a forward call <= 35 us, an autograd forward+backward <= 200 us; a call of a CuTe DSL
backend (provider ``dsfuse cutedsl``, measured when the ``cutedsl`` extra is installed) <= 15 us.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
import triton
import triton.language as tl

from dsfuse.bench import env as env_mod
from dsfuse.bench.harness import host_us_samples
from dsfuse.bench.paths import raw_url, relative, repo_root

TARGET_US = {"forward": 35.0, "autograd forward+backward": 200.0}
CUTEDSL_TARGET_US = 15.0  # every eager call of a CuTe DSL backend


@triton.jit
def _touch(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n), mask=o < n)


def _baselines(dev) -> dict[str, Callable]:
    """What the host spends on the least a call can do: one Triton launch, one torch kernel, one
    autograd step (a multiply forward and its backward: the engine's own cost)."""
    x = torch.zeros(16, device=dev)
    leaf = torch.zeros(16, device=dev, requires_grad=True)
    return {"bare Triton launch (1 kernel, 2 arguments)": lambda: _touch[(1,)](x, 16, BLOCK=16),
            "torch.add (1 kernel)": lambda: torch.add(x, x),
            "autograd step of torch.mul (forward+backward, 3 kernels)": _backward_of(lambda t: t * 2.0, [leaf], [x])}


def _backward_of(fn: Callable, leaves: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable:
    """One autograd forward+backward of ``fn(*leaves)`` with the given output gradients."""
    def step():
        out = fn(*leaves)
        torch.autograd.backward(list(out) if isinstance(out, tuple) else [out], grads)
    return step


def text_rope_calls(dev) -> list[tuple[str, str, Callable]]:
    from dsfuse.text_rope import api, apply_rope, rope_reference

    values = torch.randn(1, 64, 8, 512, device=dev).bfloat16()
    angles = torch.rand(1, 64, 32, device=dev)
    leaf = values.clone().requires_grad_()
    grad = torch.randn_like(values)
    freqs = api._freqs(angles)
    out = torch.empty_like(values)
    return [
        ("forward", "dsfuse", lambda: apply_rope(values, angles)),
        ("forward", "eager PyTorch", lambda: rope_reference(values, angles)),
        ("autograd forward+backward", "dsfuse", _backward_of(apply_rope, [leaf, angles], [grad])),
        ("autograd forward+backward", "eager PyTorch", _backward_of(rope_reference, [leaf, angles], [grad])),
        ("forward part: validation", "dsfuse", lambda: api._validate(values, angles, False, None)),
        ("forward part: backend choice", "dsfuse", lambda: api.BACKENDS.choose("auto", values.device, values.dtype)),
        ("forward part: freqs (torch.polar, 1 kernel)", "dsfuse", lambda: api._freqs(angles)),
        ("forward part: rotation (allocate + 1 Triton launch)", "dsfuse",
         lambda: api.rotate_op(values, freqs, False, False)),
        ("forward part: rotation into out (1 Triton launch)", "dsfuse",
         lambda: api.launch_rope(values, freqs, out, conj=False)),
    ]


def vision_rope_calls(dev) -> list[tuple[str, str, Callable]]:
    from dsfuse.vision_rope import (attention_front, vision_cos_sin, vision_rope_attention_front,
                                    vision_rope_backward, vision_rope_backward_reference)
    from dsfuse.vision_rope import api

    heads, tokens, dim = 16, 64, 64
    cos, sin = vision_cos_sin(8, 8, dim // 2, device=dev)
    dq, dv = (torch.randn(heads, tokens, dim, device=dev).bfloat16() for _ in range(2))
    dk_hdt = torch.randn(heads, dim, tokens, device=dev).bfloat16()
    qkv = torch.randn(tokens, 3 * heads * dim, device=dev).bfloat16().requires_grad_()
    grads = [dq, dk_hdt.transpose(1, 2), dv]
    return [
        ("backward op (forward call)", "dsfuse", lambda: vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="triton")),
        ("backward op (forward call)", "eager PyTorch",
         lambda: vision_rope_backward_reference(dq, dk_hdt, dv, cos, sin)),
        ("autograd forward+backward", "dsfuse",
         _backward_of(lambda x: vision_rope_attention_front(x, cos, sin, heads, backend="triton"), [qkv], grads)),
        ("autograd forward+backward", "eager PyTorch",
         _backward_of(lambda x: attention_front(x, cos, sin, heads), [qkv], grads)),
        ("forward part: launch (allocate + 1 Triton launch)", "dsfuse",
         lambda: api.backward_op(dq, dk_hdt.transpose(1, 2), dv, cos, sin)),
    ] + _cutedsl_rows(dev, lambda: _vision_cutedsl_rows(dq, dk_hdt, dv, cos, sin))


def _vision_cutedsl_rows(dq, dk_hdt, dv, cos, sin):
    """The public call on the CuTe DSL backward, and its parts: where its host time goes."""
    from dsfuse.vision_rope import api, vision_rope_backward
    from dsfuse.vision_rope import cutedsl as vc

    heads, _, dim = dq.shape
    out = api._new_dqkv(dq)
    kernel = vc._kernel(dq.dtype, heads, dim, True, dq.device)  # compiles here, not in the loop
    dk_htd = dk_hdt.transpose(1, 2)
    return [
        ("backward op (forward call)", "dsfuse cutedsl",
         lambda: vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="cutedsl")),
        ("backward part: into out (validation + launcher, no allocation)", "dsfuse cutedsl",
         lambda: vision_rope_backward(dq, dk_hdt, dv, cos, sin, out=out, backend="cutedsl")),
        ("backward part: allocate out (torch.empty)", "dsfuse cutedsl", lambda: api._new_dqkv(dq)),
        ("backward part: launcher (layout checks + compiled function)", "dsfuse cutedsl",
         lambda: vc.launch_backward(dq, dk_htd, dv, cos, sin, out)),
        ("backward part: compiled function alone (TVM-FFI call, 6 tensors)", "dsfuse cutedsl",
         lambda: kernel(dq, dk_hdt, dv, cos, sin, out)),
    ]


def engram_gate_calls(dev) -> list[tuple[str, str, Callable]]:
    from dsfuse.engram_gate import (EngramGatePlan, engram_gate, engram_gate_backward, engram_gate_forward,
                                    engram_gate_reference)
    from dsfuse.engram_gate import api

    n, streams, dim, eps = 4, 4, 5120, 1e-20
    x = torch.randn(n, streams, dim, device=dev).bfloat16()
    kv = torch.randn(n, (streams + 1) * dim, device=dev).bfloat16()
    weight = torch.rand(streams, dim, device=dev)
    mask = torch.ones(n, dtype=torch.bool, device=dev)
    dout = torch.randn_like(x)
    leaves = [t.clone().requires_grad_() for t in (x, kv, weight)]
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=eps)
    grads = [torch.empty_like(x), torch.empty_like(kv), torch.empty_like(weight)]
    plan = EngramGatePlan(streams=streams, dim=dim, max_tokens=n, device=dev, eps=eps)
    return [
        ("forward", "dsfuse", lambda: engram_gate_forward(x, kv, weight, mask, eps=eps)),
        ("forward", "eager PyTorch", lambda: engram_gate_reference(x, kv, weight, mask, eps=eps)),
        ("autograd forward+backward", "dsfuse",
         _backward_of(lambda a, b, c: engram_gate(a, b, c, mask, eps=eps), leaves, [dout])),
        ("autograd forward+backward", "eager PyTorch",
         _backward_of(lambda a, b, c: engram_gate_reference(a, b, c, mask, eps=eps)[0], leaves, [dout])),
        ("backward (functional)", "dsfuse", lambda: engram_gate_backward(dout, x, kv, weight, mask, saved, eps=eps)),
        ("plan forward", "dsfuse", lambda: plan.forward(x, kv, weight, mask, out, saved)),
        ("plan backward", "dsfuse", lambda: plan.backward(dout, x, kv, weight, mask, saved, *grads)),
        ("forward part: validation", "dsfuse", lambda: api._check_inputs(x, kv, weight, mask, eps, 1e-6)),
        ("forward part: launch (allocate + 1 Triton launch)", "dsfuse",
         lambda: api.forward_op(x, kv, weight, mask, eps, 1e-6)),
    ] + _cutedsl_rows(dev, lambda: _engram_cutedsl_rows(dev, x, kv, weight, mask, dout, saved, out, grads, eps))


def _engram_cutedsl_rows(dev, x, kv, weight, mask, dout, saved, out, grads, eps):
    from dsfuse.engram_gate import EngramGatePlan, engram_gate_backward, engram_gate_forward

    from dsfuse.engram_gate import cutedsl as ec

    n, streams, dim = x.shape
    clamp = 1e-6
    plan = EngramGatePlan(streams=streams, dim=dim, max_tokens=n, device=dev, eps=eps, backend="cutedsl")
    forward = ec._forward_fn(x.dtype, streams, dim, ec._arch(x.device))  # compiled by the plan
    mask8 = mask.view(torch.uint8)
    workspace = torch.empty(ec.workspace_elements(n, streams, dim), device=dev)
    return [
        ("forward", "dsfuse cutedsl", lambda: engram_gate_forward(x, kv, weight, mask, eps=eps, backend="cutedsl")),
        ("backward (functional)", "dsfuse cutedsl",
         lambda: engram_gate_backward(dout, x, kv, weight, mask, saved, eps=eps, backend="cutedsl")),
        ("plan forward", "dsfuse cutedsl", lambda: plan.forward(x, kv, weight, mask, out, saved)),
        ("plan backward", "dsfuse cutedsl", lambda: plan.backward(dout, x, kv, weight, mask, saved, *grads)),
        ("forward part: launcher (geometry check + compiled function)", "dsfuse cutedsl",
         lambda: ec.launch_forward(x, kv, weight, mask, out, saved, eps=eps, clamp=clamp)),
        ("forward part: compiled function alone (TVM-FFI call, 6 tensors)", "dsfuse cutedsl",
         lambda: forward(x, kv, weight, mask8, out, saved, eps, clamp)),
        ("backward part: launcher (2 compiled functions)", "dsfuse cutedsl",
         lambda: ec.launch_backward(dout, x, kv, weight, saved, *grads, workspace, clamp=clamp)),
    ]


def _cutedsl_rows(dev, rows: Callable[[], list]) -> list:
    """The CuTe DSL backend's calls (provider ``dsfuse cutedsl``) on a GPU with the ``cutedsl`` extra."""
    from dsfuse._common import cutedsl

    return rows() if cutedsl.installed() and dev.type == "cuda" else []


OPS: dict[str, Callable] = {"text_rope": text_rope_calls, "vision_rope": vision_rope_calls,
                            "engram_gate": engram_gate_calls}


def run(op: str, raw_root: Path | None = None, reps: int = 7, calls: int = 300) -> Path:
    """Measure ``op``'s calls and the baselines; write ``host_time.csv``, ``env.json``; return the run folder."""
    if not torch.cuda.is_available():
        raise SystemExit("host time needs a CUDA GPU (the point is an idle GPU behind the CPU's calls)")
    dev = torch.device("cuda")
    env = env_mod.collect(dev, op=op)  # with the hash of the op's kernel sources
    run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S") + f"-{env_mod.gpu_key(env['gpu_name'])}"
    run_dir = (raw_root or repo_root() / "experiments" / op / "raw" / "host-time") / run_id
    entries = OPS[op](dev) + [(name, "baseline", fn) for name, fn in _baselines(dev).items()]
    rows = []
    for call, provider, fn in entries:
        for i, us in enumerate(host_us_samples(fn, dev, reps=reps, calls=calls, warmup=50)):
            rows.append(dict(op=op, call=call, provider=provider, sample=i, host_us=round(us, 3)))
    run_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(run_dir / "host_time.csv", index=False)
    (run_dir / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    return run_dir


def table(samples: pd.DataFrame) -> pd.DataFrame:
    """Median host us per call and provider, with the target and whether dsfuse meets it."""
    med = samples.groupby(["call", "provider"], sort=False)["host_us"].median().unstack("provider")
    out = pd.DataFrame({"call": med.index})
    for provider in ("dsfuse", "dsfuse cutedsl", "eager PyTorch", "baseline"):
        if provider in med:
            out[f"{provider} us"] = [f"{v:.1f}" if pd.notna(v) else "" for v in med[provider]]
    out["target us"] = [f"<= {TARGET_US[c]:.0f}" if c in TARGET_US else "" for c in med.index]
    judged = [c in TARGET_US and "dsfuse" in med and pd.notna(med.loc[c, "dsfuse"]) for c in med.index]
    out["met"] = [("yes" if med.loc[c, "dsfuse"] <= TARGET_US[c] else "NO") if j else ""
                  for c, j in zip(med.index, judged)]
    if "dsfuse cutedsl" in med:
        out[f"cutedsl <= {CUTEDSL_TARGET_US:.0f} us"] = [
            "" if pd.isna(v) or " part: " in c else ("yes" if v <= CUTEDSL_TARGET_US else "NO")
            for c, v in zip(med.index, med["dsfuse cutedsl"])]  # whole calls are judged, not their parts
    return out


def render(op: str, run_dir: Path) -> str:
    """The host-time table of one run, under its anchor (``host-time-<run-id>``), with the run's
    commit, versions, raw folder and whether the op's kernel source changed since."""
    from dsfuse.bench.report import anchor, state_lines
    from dsfuse.bench.tables import markdown

    samples = pd.read_csv(run_dir / "host_time.csv")
    env = json.loads((run_dir / "env.json").read_text())
    return "\n".join([
        f"<!-- generated by python -m dsfuse.bench report {op} from {relative(run_dir)}; do not edit -->", "",
        f'<a id="{anchor(run_dir.name, "host-time")}"></a>', "",
        f"#### Host time per eager call ({env['gpu_name']})", "",
        *state_lines(env_mod.source_state(op, env)),
        f"Median of {samples['sample'].nunique()} samples of a loop without synchronisation on tiny tensors; run "
        f"`{run_dir.name}` ({env.get('date_utc')}), torch {env['packages']['torch']}, triton "
        f"{env['packages']['triton']}, commit `{str(env['git_commit'])[:10]}`, raw data "
        f"[{relative(run_dir)}]({raw_url(run_dir)}).",
        "",
        markdown(table(samples)),
        "",
    ])


def figures(run_dir: Path) -> dict:
    """``{call: {provider: median host us}}`` of one host-time run (for the pages' prose)."""
    samples = pd.read_csv(run_dir / "host_time.csv")
    med = samples.groupby(["call", "provider"], sort=False)["host_us"].median()
    out: dict = {}
    for (call, provider), us in med.items():
        out.setdefault(call, {})[provider] = round(float(us), 4)
    return out


def latest(op: str, gpu: str | None = None) -> Path:
    """The newest host-time run of ``op`` (on ``gpu``, a folder name such as ``h200``, when given)."""
    from dsfuse.bench.report import runs_by_gpu, runs_of

    root = repo_root() / "experiments" / op / "raw" / "host-time"
    runs = runs_by_gpu(root, marker="host_time.csv").get(gpu, []) if gpu else runs_of(root, marker="host_time.csv")
    if not runs:
        raise FileNotFoundError(f"no host-time run for {op} under experiments/{op}/raw/host-time/")
    return runs[-1]


def profile(op: str, calls: int = 300, top: int = 25) -> str:
    """cProfile of each whole dsfuse call of ``op``, both backends (where the host time goes)."""
    import cProfile
    import io
    import pstats

    dev = torch.device("cuda")
    text = []
    for call, provider, fn in OPS[op](dev):
        if provider not in ("dsfuse", "dsfuse cutedsl") or " part: " in call:
            continue
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        text += [f"## {op}: {call}, {provider} ({calls} calls)", buf.getvalue()]
    return "\n".join(text)


def write_report(op: str, gpus: set[str] | None = None) -> list[Path]:
    """``results/<gpu>/<op>_host_time.md`` from each GPU's newest host-time run (only ``gpus`` when
    given), and the op's all-GPU indexes."""
    from dsfuse.bench.report import _write, runs_by_gpu, write_indexes

    results = repo_root() / "results"
    written = [_write(results / gpu / f"{op}_host_time.md", render(op, runs[-1]))
               for gpu, runs in runs_by_gpu(repo_root() / "experiments" / op / "raw" / "host-time",
                                            marker="host_time.csv").items() if gpus is None or gpu in gpus]
    return written + write_indexes(op, results) if written else []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsfuse.bench.host_time", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("run", "report", "profile"))
    parser.add_argument("ops", nargs="*", help=f"ops (default: all of {list(OPS)})")
    args = parser.parse_args(argv)
    if unknown := set(args.ops) - set(OPS):
        parser.error(f"unknown ops {sorted(unknown)}; expected some of {list(OPS)}")
    for op in args.ops or list(OPS):
        if args.command == "run":
            print(f"{op}: {run(op)}")
        elif args.command == "profile":
            print(profile(op))
        else:
            for path in write_report(op):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
