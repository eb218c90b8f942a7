"""Host (CPU) time per eager call of every op, next to eager PyTorch and a bare Triton launch.

    python -m dsfuse.bench.host_time run [OPS]      # on a GPU: experiments/<op>/raw/host-time/<run-id>/
    python -m dsfuse.bench.host_time profile [OPS]  # cProfile of the dsfuse calls (where the time goes)
    python -m dsfuse.bench.host_time report [OPS]   # results/<gpu>/<op>_host_time.md from each GPU's
                                                    # newest run (also written by python -m dsfuse.bench report)

The ops are every op with an experiment (``dsfuse.bench.experiments()``, from the registry); each
lists its calls in its bench module, ``host_time_calls(device)`` in ``kernels/dsfuse/bench/<op>.py``
(an op without it is an error, not skipped): ``(call, provider, fn)`` rows, the dsfuse entry point
and the eager PyTorch equivalent, forward and autograd forward+backward, and the parts of its
forward (validation, backend choice, launches). Tensors are tiny, so the GPU idles and a loop of
calls without synchronisation measures what the CPU spends to validate, choose a backend, allocate
and enqueue. Two baselines run in the same process: a bare Triton launch of a trivial kernel and a
``torch.add`` (and the same trivial kernel through the bound launch of ``dsfuse._common.launch``).
Targets: multiples of that ``torch.add`` per call (``HOST_TARGETS`` of the op's bench module), an
autograd forward+backward below eager PyTorch's; a call of a CuTe DSL backend (provider ``dsfuse
cutedsl``, measured when the ``cutedsl`` extra is installed) <= 15 us. The tables are rendered by
``dsfuse.bench.report`` (``render_host_time``, ``write_host_time``).
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

from dsfuse._common.launch import Geometry, TritonLaunch, layout_key
from dsfuse.bench import env as env_mod
from dsfuse.bench import experiments, report
from dsfuse.bench.harness import host_us_samples


@triton.jit
def _touch(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n), mask=o < n)


def _baselines(dev) -> dict[str, Callable]:
    """What the host spends on the least a call can do: one Triton launch, one torch kernel, one
    autograd step (a multiply forward and its backward: the engine's own cost)."""
    x = torch.zeros(16, device=dev)
    leaf = torch.zeros(16, device=dev, requires_grad=True)
    bound = TritonLaunch(_touch)
    geometry = Geometry((1,), (16,), dict(BLOCK=16))
    return {"bare Triton launch (1 kernel, 2 arguments)": lambda: _touch[(1,)](x, 16, BLOCK=16),
            "bound Triton launch (the same kernel, dsfuse._common.launch)": lambda: bound(
                layout_key(x), (x,), lambda: geometry),
            "torch.add (1 kernel)": lambda: torch.add(x, x),
            "autograd step of torch.mul (forward+backward, 3 kernels)": backward_of(lambda t: t * 2.0, [leaf], [x])}


def backward_of(fn: Callable, leaves: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable:
    """One autograd forward+backward of ``fn(*leaves)`` with the given output gradients (a call of
    the ops' ``host_time_calls``)."""
    def step():
        out = fn(*leaves)
        torch.autograd.backward(list(out) if isinstance(out, tuple) else [out], grads)
    return step


def cutedsl_rows(dev, rows: Callable[[], list]) -> list:
    """The CuTe DSL backend's calls (provider ``dsfuse cutedsl``) on a GPU with the ``cutedsl`` extra:
    ``rows()``, else none."""
    from dsfuse._common import cutedsl

    return rows() if cutedsl.installed() and dev.type == "cuda" else []


def ops() -> list[str]:
    """The ops measured: every op with an experiment, from the registry."""
    return list(experiments())


def op_calls(op: str, dev: torch.device) -> list[tuple[str, str, Callable]]:
    """``(call, provider, fn)`` of ``op``: its bench module's ``host_time_calls(dev)`` (``LookupError``
    naming the op where it has none)."""
    return report.op_function(op, "host_time_calls")(dev)


def run(op: str, raw_root: Path | None = None, reps: int = 7, calls: int = 300) -> Path:
    """Measure ``op``'s calls and the baselines; write ``host_time.csv``, ``env.json``; return the run folder."""
    if not torch.cuda.is_available():
        raise SystemExit("host time needs a CUDA GPU (the point is an idle GPU behind the CPU's calls)")
    dev = torch.device("cuda")
    env = env_mod.collect(dev, op=op)  # with the hash of the op's kernel sources
    env["host_sources"] = env_mod.kernel_sources(op, scope="host")  # and of its eager call's path
    run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S") + f"-{env_mod.gpu_key(env['gpu_name'])}"
    run_dir = (raw_root or report.host_time_root(op)) / run_id
    entries = op_calls(op, dev) + [(name, "baseline", fn) for name, fn in _baselines(dev).items()]
    rows = []
    for call, provider, fn in entries:
        for i, us in enumerate(host_us_samples(fn, dev, reps=reps, calls=calls, warmup=50)):
            rows.append(dict(op=op, call=call, provider=provider, sample=i, host_us=round(us, 3)))
    run_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(run_dir / report.HOST_TIME_MARKER, index=False)
    (run_dir / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    return run_dir


def profile(op: str, calls: int = 300, top: int = 25) -> str:
    """cProfile of each whole dsfuse call of ``op``, both backends (where the host time goes): the
    call's host time without the profiler first (the profiler roughly doubles it), then the
    functions by cumulative time (``2 * top`` of them) and by their own time."""
    import cProfile
    import io
    import pstats

    dev = torch.device("cuda")
    text = []
    for call, provider, fn in op_calls(op, dev):
        if provider not in ("dsfuse", "dsfuse cutedsl") or " part: " in call:
            continue
        (plain_us,) = host_us_samples(fn, dev, reps=1, calls=calls, warmup=50)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text.append(f"## {op}: {call}, {provider} ({calls} calls; {plain_us:.1f} us a call without the profiler)")
        for order, count in (("cumulative", 2 * top), ("tottime", top)):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(count)
            text.append(buf.getvalue())
    return "\n".join(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsfuse.bench.host_time", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("run", "report", "profile"))
    parser.add_argument("ops", nargs="*", help="ops (default: every op with an experiment)")
    args = parser.parse_args(argv)
    if unknown := set(args.ops) - set(ops()):
        parser.error(f"unknown ops {sorted(unknown)}; expected some of {ops()}")
    for op in args.ops or ops():
        if args.command == "run":
            print(f"{op}: {run(op)}")
        elif args.command == "profile":
            print(profile(op))
        else:
            for path in report.write_host_time(op):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
