"""Paired-block benchmark harness with correctness checks, shared by every op.

A run takes an op's experiment module (cases, inputs, reference, providers) and
a config, and writes ``<raw_root>/<run-id>/``:

* ``samples.csv``: one row per timing sample (case, provider, regime, clock,
  block, sample, microseconds). The copy bandwidth of the same run is the
  pseudo-case ``copy``.
* ``validation.csv``: every provider's check against the reference, before and
  after timing (status, mismatching elements, max |diff|, error text). A
  provider that raises is recorded and not timed; one whose results differ is
  timed but flagged, and the report never uses it as a baseline. Nothing is
  dropped silently.
* ``cases.csv``: each case's shape parameters, byte floor and FLOPs.
* ``memory.csv`` (GPU runs only; older runs lack it): each provider's extra peak memory per case,
  from one eager call before any graph capture (`peak_memory_row`).
* ``config.yaml`` (the config as run) and ``env.json``.

A config's ``cases`` key, where present, runs only the cases it names (`selected_cases`): a
configuration too long for one GPU call runs as several runs, each naming its part.

Method: providers are interleaved inside each block (rotated per block, so no
provider always runs first), several samples each, several blocks. Clocks:
``graph`` (CUDA Graph replay, launch overhead removed) and ``eager`` (plain
calls; CUDA events around them, so CPU launch gaps count). Cache regimes:
``hot`` (the same buffers back to back, a sample is the mean of enough calls to
last ~200 us) and ``evicted`` (an L2-sized buffer is overwritten before each
single timed call, so inputs come from HBM). On CPU (smoke runs) the only clock
is ``wall`` (``time.perf_counter``) and the only regime ``hot``.
"""

from __future__ import annotations

import csv
import datetime as dt
import gc
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from dsfuse.bench import env as env_mod
from dsfuse.bench.paths import cli_path

Outputs = tuple[torch.Tensor, ...]


@dataclass
class Case:
    """One measured configuration: a named shape and mode with its floors."""

    name: str
    mode: str  # "fwd" or "fwd+bwd"
    params: dict[str, Any]
    bytes: int  # fewest bytes the op must move through device memory
    flops: int = 0


@dataclass
class Provider:
    """An implementation to check and time.

    ``build(case, inputs)`` returns a zero-argument callable that runs the op on
    those inputs and returns its outputs (for ``fwd+bwd``: the gradients too).
    A callable may carry ``reset()`` to restore state it mutates (in-place ops).
    ``check``: ``"bitwise"`` (bit patterns equal to the reference), ``"allclose"``
    (``rtol``/``atol`` per element) or ``"relrms"`` (each output's relative RMS
    error against the reference at most ``rtol``). For ``"relrms"``, ``rtol`` may also
    be a tuple: one bound per output, in order (output ``i`` at most ``rtol[i]``); a
    tuple longer than a case's outputs applies its first bounds (an op whose modes
    return prefixes of one output list, e.g. ``(o,)`` forward and ``(o, dx, dw)``
    with the backward, shares one tuple), one shorter fails the check.
    ``role``: ``"candidate"`` (dsfuse),
    ``"control"`` (same contract; the fastest valid one is the ratio baseline),
    ``"anchor"`` (a related public kernel with a different contract: reported,
    never a ratio baseline).
    """

    name: str
    build: Callable[[Case, dict], Callable[[], Outputs]]
    role: str = "control"
    check: str = "bitwise"
    rtol: float | tuple[float, ...] = 0.0  # a tuple (one bound per output): "relrms" only
    atol: float = 0.0
    applies: Callable[[Case], str | None] = lambda case: None  # reason it does not apply
    expect: Callable[[Case, Outputs], Outputs] | None = None  # reference outputs -> this provider's outputs
    form: str = ""  # candidates are compared with controls of the same form (e.g. "in-place")


@dataclass
class CheckResult:
    ok: bool
    mismatches: int = 0
    max_abs_diff: float = 0.0
    detail: str = ""


def compare(outputs: Outputs, expected: Outputs, provider: Provider, case: Case) -> CheckResult:
    """Compare a provider's outputs with the reference outputs."""
    if provider.expect is not None:
        expected = provider.expect(case, expected)
    if len(outputs) != len(expected):
        return CheckResult(False, detail=f"{len(outputs)} outputs, expected {len(expected)}")
    bounds = provider.rtol if isinstance(provider.rtol, (tuple, list)) else None
    if bounds is not None and provider.check != "relrms":
        return CheckResult(False, detail=f"rtol: one bound per output needs check 'relrms', not {provider.check!r}")
    if bounds is not None and len(bounds) < len(expected):
        return CheckResult(False, detail=f"rtol: {len(bounds)} bounds for {len(expected)} outputs")
    total, worst = 0, 0.0
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if got.shape != want.shape or (got.dtype != want.dtype and provider.check != "relrms"):
            return CheckResult(False, detail=f"output {i}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
        got, want = got.detach(), want.detach()
        if provider.check == "bitwise":
            bad = bits(got) != bits(want)
        elif provider.check == "relrms":  # relative RMS error of the whole output <= its bound
            bound = provider.rtol if bounds is None else bounds[i]
            err = rel_rms(got, want)
            bad = torch.full((1,), not err <= bound)  # NaN fails
            if bad.any():
                limit = "" if bounds is None else f" (bound {bound:.3g})"
                return CheckResult(False, int(got.numel()), float(err),
                                   f"output {i}: relative RMS error {float(err):.3g}{limit}")
            continue
        else:
            bad = ~torch.isclose(got.float(), want.float(), rtol=provider.rtol, atol=provider.atol, equal_nan=True)
        n_bad = int(bad.sum())
        total += n_bad
        if n_bad:
            diff = (got.float() - want.float()).abs()[bad]
            finite = diff[torch.isfinite(diff)]
            worst = max(worst, float(finite.max()) if finite.numel() else float("inf"))
    return CheckResult(total == 0, total, worst)


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative RMS error ``|got - want| / |want|`` over the whole tensor, in float64 (the project's
    one tolerance measure against a reference); NaN when ``got`` holds a NaN."""
    got, want = got.double(), want.to(got.device).double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t`` as integers (so -0.0 != +0.0 and NaN == same NaN)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


def cpu_draws(seed: int, device: torch.device) -> tuple[torch.Generator, Callable[..., torch.Tensor]]:
    """A CPU generator seeded with ``seed`` and ``randn(shape, dtype)``: standard normal values drawn from
    it in fp32 (so every device sees the same inputs), rounded to ``dtype`` and moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)

    return gen, randn


def select_providers(table: dict[str, Callable[[], Provider]], config: dict) -> list[Provider]:
    """The providers a config names (``providers:``), built from an op's table.

    Also prepares ``torch.compile`` controls: one compiled function serves every
    case (shapes and ``requires_grad`` differ), so recompilations are allowed, and
    passing the limit fails loudly instead of silently falling back to eager. A
    config ``tolerance: {rtol, atol}`` (smoke runs on CPU, where the interpreter
    is not bitwise) turns bitwise checks into tolerance checks.
    """
    torch._dynamo.config.recompile_limit = 64
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    wanted = config["providers"]
    unknown = [name for name in wanted if name not in table]
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; expected names from {sorted(table)}")
    chosen = [table[name]() for name in wanted]
    tolerance = config.get("tolerance")
    if tolerance:
        for p in chosen:
            if p.check == "bitwise":
                p.check, p.rtol, p.atol = "allclose", tolerance["rtol"], tolerance["atol"]
    return chosen


# -- timing ----------------------------------------------------------------------------------


class Timer:
    """Times a callable in one (clock, regime); GPU via CUDA events, CPU via perf_counter."""

    def __init__(self, device: torch.device, flush_bytes: int, hot_target_us: float = 200.0):
        self.device = device
        self.hot_target_us = hot_target_us
        self.flush = torch.empty(flush_bytes // 4, dtype=torch.float32, device=device) if device.type == "cuda" else None

    def reps_for(self, fn: Callable[[], Any]) -> int:
        """Calls per hot sample so that one sample lasts about ``hot_target_us``."""
        us = self.once(fn)
        return int(min(1000, max(1, self.hot_target_us // max(us, 1e-3))))

    def once(self, fn: Callable[[], Any]) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def samples(self, fn: Callable[[], Any], regime: str, n: int, reps: int) -> list[float]:
        """``n`` samples in microseconds per call."""
        if self.device.type != "cuda":
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                out.append((time.perf_counter() - t0) * 1e6 / reps)
            return out
        events = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if regime == "evicted":
                self.flush.add_(1.0)  # overwrite an L2-sized buffer: the next call reads from HBM
                start.record()
                fn()
                end.record()
            else:
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
            events.append((start, end))
        torch.cuda.synchronize(self.device)
        per_call = 1 if regime == "evicted" else reps
        return [s.elapsed_time(e) * 1e3 / per_call for s, e in events]


def capture_graph(fn: Callable[[], Outputs], device: torch.device) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """Capture ``fn`` (warmed up on a side stream first); return the graph and its static outputs."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    torch.cuda.synchronize(device)
    return graph, outputs


def peak_memory_row(case: Case, provider: Provider, runner: Callable[[], Any], device: torch.device) -> dict | None:
    """The extra peak memory of one call of ``runner``: ``peak_mib``, the most bytes the caching allocator
    held for tensors during the call above what it held before (the inputs, and in ``bwd`` the forward's
    saved tensors, excluded; outputs and gradients included), and ``retained_mib``, what stays allocated
    once the outputs are dropped. None on a non-CUDA device (no counters) or where the call raises (the
    checks record failures)."""
    if device.type != "cuda":
        return None
    try:
        if hasattr(runner, "reset"):
            runner.reset()  # before the counters: restoring the state is not the op's memory
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        outputs = runner()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base  # read while the outputs are alive
    except Exception:  # noqa: BLE001  (a failing provider is recorded by the checks, not here)
        return None
    del outputs
    retained = torch.cuda.memory_allocated(device) - base
    return dict(case=case.name, mode=case.mode, provider=provider.name, peak_mib=peak / 2**20,
                retained_mib=retained / 2**20)


def graph_part_rows(parts: list[tuple[str, Callable[[], Any]]], timer: Timer, samples: int, device: torch.device,
                    **row) -> list[dict]:
    """A probe's timing: each ``(part, fn)`` captured alone in a CUDA Graph and replayed ``samples`` times
    with the L2 overwritten before each (the evicted regime); rows of ``row``'s columns, ``part``,
    ``sample`` and ``us``."""
    rows = []
    for part, fn in parts:
        graph, _ = capture_graph(lambda fn=fn: (fn(),), device)
        rows += [row | {"part": part, "sample": i, "us": us}
                 for i, us in enumerate(timer.samples(graph.replay, "evicted", samples, 1))]
        del graph
    return rows


def variant_rows(run: Callable[[], Outputs], first: Outputs | None, what: str, timer: Timer, samples: int,
                 device: torch.device, **row) -> tuple[list[torch.Tensor], list[dict]]:
    """A probe's variant of one computation: ``run()``'s outputs (cloned), required bitwise equal to
    ``first`` where given (AssertionError naming ``what``), then ``samples`` of ``run`` replayed from a
    CUDA Graph and called eagerly, the L2 overwritten before each (the evicted regime). Returns
    ``(outputs, rows)``: rows of ``row``'s columns, ``clock``, ``sample`` and ``us``."""
    got = [t.detach().clone() for t in run()]
    if first is not None and not all(torch.equal(bits(a), bits(b)) for a, b in zip(got, first, strict=True)):
        raise AssertionError(f"{what} changed the bits")  # bit patterns: -0.0 against +0.0, NaN payloads
    graph, _ = capture_graph(run, device)
    rows = [row | {"clock": clock, "sample": i, "us": us} for clock, fn in (("graph", graph.replay), ("eager", run))
            for i, us in enumerate(timer.samples(fn, "evicted", samples, 1))]
    return got, rows


def write_part_medians(out: Path, rows: list[dict], samples: int) -> None:
    """Write a probe's rows (`graph_part_rows`) to ``out/samples.csv`` and print their medians by case and part."""
    import pandas as pd

    write_csv(out / "samples.csv", rows)
    table = pd.DataFrame(rows).groupby(["case", "part"], sort=False)["us"].median().unstack("part")
    print(f"median us per call, CUDA Graph replay, L2 evicted ({samples} samples)")
    print(table.round(1).to_string())
    print(f"wrote {out / 'samples.csv'}")


def start_run(out: Path, config: str | Path, device: torch.device, op: str | None = None) -> dict:
    """A GPU script's start: ``out`` created with ``env.json`` (this machine, the commit and, with ``op``,
    the hash of its kernel sources) in it; returns the experiment config at ``config`` (a path as
    given on the command line)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(env_mod.collect(device, op=op), indent=2) + "\n")
    return load_config(cli_path(config))


def start_probe(doc: str, default_config: str, samples: int, op: str, argv: list[str] | None = None,
                flush_bytes: int = 256 << 20) -> tuple:
    """A GPU probe's start: its command line (``OUT``, ``--config``, ``--samples``; ``doc``'s first
    line the description), then `start_run` on the GPU; returns ``(args, device, config, timer)``
    (a `Timer` overwriting ``flush_bytes`` of L2). Without a CUDA GPU it says so and exits (2)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--config", default=default_config, help=f"experiment config (default {default_config})")
    parser.add_argument("--samples", type=int, default=samples, help=f"timed samples per part (default {samples})")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{parser.prog} needs a CUDA GPU: run it on the GPU machine.", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda")
    config = start_run(args.out, args.config, device, op=op)
    return args, device, config, Timer(device, flush_bytes)


def checked_graph_samples(fn: Callable[[], Any], outputs: Outputs, expected: Outputs, timer: Timer, what: str, *,
                          rtol: float = 2**-8, n: int = 20) -> list[float]:
    """For launch-constant sweeps: poison ``outputs`` with NaN, run ``fn`` once and require a
    relative RMS error <= ``rtol`` on each against ``expected`` (AssertionError naming ``what``
    otherwise); then ``n`` samples (us per call) of ``fn``, replayed from a CUDA Graph with the
    L2 overwritten before each call (plain calls on the CPU)."""
    for t in outputs:
        t.fill_(float("nan"))
    fn()
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        err = rel_rms(got, want)
        if not err <= rtol:
            raise AssertionError(f"{what}: output {i}: relative RMS error {err:.2e} (limit {rtol:.2e})")
    if timer.device.type != "cuda":
        return timer.samples(fn, "hot", n, 1)
    graph, _ = capture_graph(lambda: (fn(),), timer.device)
    return timer.samples(graph.replay, "evicted", n, 1)


def host_us_samples(fn: Callable[[], Any], device: torch.device, reps: int = 5, calls: int = 200,
                    warmup: int = 20) -> list[float]:
    """Host time per call of ``fn``, ``reps`` samples of ``calls`` calls with no synchronisation
    inside a sample: on an input small enough for the GPU to keep up, the CPU cost of enqueueing."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return out


def copy_bandwidth_samples(timer: Timer, device: torch.device, nbytes: int, blocks: int, n: int) -> tuple[list[dict], int]:
    """Device-to-device copy of ``nbytes``: the run's bandwidth ceiling (bytes read + written)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    rows = []
    clocks = {"eager" if device.type == "cuda" else "wall": fn}
    if device.type == "cuda":
        graph, _ = capture_graph(lambda: (dst.copy_(src),), device)
        clocks["graph"] = graph.replay
    for block in range(blocks):
        for clock, call in clocks.items():
            call()
            for i, us in enumerate(timer.samples(call, "evicted" if device.type == "cuda" else "hot", n, 1)):
                rows.append(dict(case="copy", mode="copy", provider="copy", regime="evicted", clock=clock,
                                 block=block, sample=i, us=us))
    return rows, 2 * src.numel() * src.element_size()


# -- a run -----------------------------------------------------------------------------------


@dataclass
class RunSettings:
    blocks: int = 5
    samples: int = 10
    clocks: list[str] = field(default_factory=lambda: ["graph", "eager"])
    regimes: list[str] = field(default_factory=lambda: ["hot", "evicted"])
    copy_bytes: int = 1 << 30
    flush_bytes: int = 256 << 20

    @classmethod
    def from_config(cls, cfg: dict, device: torch.device) -> RunSettings:
        s = cls(**cfg.get("timing", {}))
        if device.type != "cuda":  # smoke: no graphs, no eviction control on CPU
            s.clocks, s.regimes = ["wall"], ["hot"]
            s.copy_bytes = min(s.copy_bytes, 16 << 20)
        return s


def _try(fn: Callable[[], Any]) -> tuple[Any, str]:
    try:
        return fn(), ""
    except Exception as exc:  # a failing provider is recorded, not fatal
        return None, f"{type(exc).__name__}: {exc}".strip()[:500] + "\n" + traceback.format_exc(limit=3)[-800:]


def new_run_id(env: dict, smoke: bool = False) -> str:
    """``<UTC stamp>-<gpu>`` (``-smoke`` appended for a CPU smoke run), the GPU named by
    `dsfuse.bench.env.gpu_key` of ``env['gpu_name']``: ``20261129-101731-h200``."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{env_mod.gpu_key(env.get('gpu_name'))}" + ("-smoke" if smoke else "")


UNFINISHED = "UNFINISHED"  # in a run folder while its cases run; left there when the run was stopped


def run_experiment(experiment, config: dict, raw_root: Path, device: torch.device, run_id: str | None = None) -> Path:
    """Check and time every provider of ``experiment`` on every case; write the raw data.

    ``experiment`` is an op's bench module: ``cases(config)``, ``make_inputs(case,
    device, seed)``, ``reference(case, inputs)`` and ``providers(config)``.
    A config's ``own_process`` names providers that run in a second process (another Python
    environment: `dsfuse.bench.own_process`), inside the same blocks; env.json records its packages.
    Returns the run directory.
    """
    from dsfuse.bench import own_process

    settings = RunSettings.from_config(config, device)
    cases = selected_cases(experiment, config)  # a bad selection is refused before a folder is made
    env = env_mod.collect(device, op=getattr(experiment, "OP", None))  # with the hash of the op's kernel sources
    apart = own_process.start(experiment, config, settings, device)
    if apart is not None:
        env["own_process"] = apart.env
    if run_id is None:
        run_id = new_run_id(env, smoke=device.type != "cuda")
    run_dir = Path(raw_root) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (run_dir / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    try:
        _run_cases(experiment, config, cases, settings, device, run_dir, apart)
    finally:
        if apart is not None:
            apart.close()
    return run_dir


def selected_cases(experiment, config: dict) -> list[Case]:
    """The config's cases, or only those its ``cases`` key names (in the config's order): a
    configuration too long for one GPU call runs in parts, each a run with its own subset. An
    unknown name is an error, not a case silently left out."""
    cases = experiment.cases(config)
    if "cases" not in config:
        return cases
    names = config["cases"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"cases: expected a non-empty list of case names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"cases: {names} names a case twice")
    known = {case.name for case in cases}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"cases: {unknown} are not cases of this config; it has {sorted(known)}")
    return [case for case in cases if case.name in set(names)]


def _run_cases(experiment, config: dict, cases: list[Case], settings: RunSettings, device: torch.device,
               run_dir: Path, apart) -> None:
    """The copy bandwidth, then every case, each written as soon as it is done."""

    timer = Timer(device, settings.flush_bytes)
    samples, validation, case_rows, memory = [], [], [], []
    copy_rows, copy_bytes = copy_bandwidth_samples(timer, device, settings.copy_bytes, settings.blocks, settings.samples)
    samples += copy_rows
    case_rows.append(dict(case="copy", mode="copy", bytes=copy_bytes, flops=0, params="{}"))

    providers = experiment.providers(config)
    unfinished = run_dir / UNFINISHED  # until the last case is written: a run cut short says so
    unfinished.write_text(f"{len(cases)} cases to run; cases.csv lists those finished\n")
    for case in tqdm(cases, desc=f"{experiment.OP} cases", unit="case"):
        case_rows.append(dict(case=case.name, mode=case.mode, bytes=case.bytes, flops=case.flops,
                              params=json.dumps(case.params, sort_keys=True)))
        samples += _run_case(experiment, case, providers, settings, timer, device, validation, memory, apart)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # after every case: a stopped run keeps those it finished
        _write_run(run_dir, samples, validation, case_rows, memory)
    _write_run(run_dir, samples, validation, case_rows, memory)  # a config without cases still leaves its copy samples
    unfinished.unlink()


def _write_run(run_dir: Path, samples: list[dict], validation: list[dict], case_rows: list[dict],
               memory: list[dict]) -> None:
    """The run's CSVs, each written whole to a temporary file and then renamed over the last one
    (a run killed mid-write leaves the previous case's files, never a truncated one); ``memory.csv``
    only once it has rows (a CPU run has none)."""
    files = [("samples.csv", samples), ("validation.csv", validation), ("cases.csv", case_rows)]
    if memory:
        files.append(("memory.csv", memory))
    for name, rows in files:
        partial = run_dir / f".{name}.partial"
        write_csv(partial, rows)
        os.replace(partial, run_dir / name)


def validation_row(case: Case, provider: Provider, stage: str, result: CheckResult | None, error: str = "",
                   status: str = "") -> dict:
    """One row of ``validation.csv``: a provider's check at one stage (or why it did not run)."""
    return dict(
        case=case.name, mode=case.mode, provider=provider.name, role=provider.role, form=provider.form,
        check=provider.check, stage=stage,
        status=status or ("pass" if result is not None and result.ok else "fail"),
        mismatches=result.mismatches if result else "", max_abs_diff=result.max_abs_diff if result else "",
        error=(result.detail if result else "") or error,
    )


class CaseRun:
    """One case's providers in one process: the checks before timing, the runners and graphs, the
    samples of one (provider, clock, regime) in a block, the checks after timing. The run's own
    process makes one; `dsfuse.bench.own_process` another for the providers a config runs apart."""

    def __init__(self, experiment, case: Case, providers: list[Provider], settings: RunSettings, timer: Timer,
                 device: torch.device):
        self.experiment, self.case, self.providers = experiment, case, providers
        self.settings, self.timer, self.device = settings, timer, device
        self.runnable: list[Provider] = []
        self.calls: dict[tuple[str, str], Callable[[], Any]] = {}
        self.statics: dict[str, tuple] = {}
        self.runners: dict[str, Callable[[], Any]] = {}
        self.reps: dict[tuple[str, str], int] = {}
        self.inputs, self.expected = None, None  # `prepare`'s
        self.memory_rows: list[dict] = []  # `peak_memory_row` of each runner, made in `build`

    def check_before(self) -> list[dict]:
        """Each provider on fresh random inputs (seed 1). A provider that ran but differs is still
        timed (reported as not matching, never a baseline); one that raised is not."""
        rows = []
        inputs = self.experiment.make_inputs(self.case, self.device, seed=1)
        expected = self.experiment.reference(self.case, inputs)
        for provider in self.providers:
            reason = provider.applies(self.case)
            if reason:
                rows.append(validation_row(self.case, provider, "applies", None, reason, status="n/a"))
                continue
            outputs, error = _try(lambda: provider.build(self.case, inputs)())
            result = compare(outputs, expected, provider, self.case) if outputs is not None else None
            rows.append(validation_row(self.case, provider, "before", result, error))
            if result is not None:
                self.runnable.append(provider)
        return rows

    def prepare(self) -> None:
        """The timing inputs (seed 2) and their reference, kept for `build` and the checks after timing;
        nothing where no provider passed `check_before` (nothing to time)."""
        if not self.runnable:
            return
        self.inputs = self.experiment.make_inputs(self.case, self.device, seed=2)
        self.expected = self.experiment.reference(self.case, self.inputs)

    def build(self) -> tuple[list[dict], list[str]]:
        """On `prepare`'s inputs: each runnable provider's runner, its extra peak memory (one eager
        call, before any capture: `memory`), its graph (captured once), one warm-up call each;
        ``(validation rows of what failed, names of the providers to time)``."""
        rows, inputs = [], self.inputs
        if not self.runnable:
            return rows, []
        if inputs is None:
            raise RuntimeError("CaseRun.build: call prepare first (it makes the timing inputs and their reference)")
        for provider in self.runnable:
            runner, error = _try(lambda: provider.build(self.case, inputs))
            if runner is None:
                rows.append(validation_row(self.case, provider, "build", None, error))
                continue
            self.runners[provider.name] = runner
            measured = peak_memory_row(self.case, provider, runner, self.device)
            if measured is not None:
                self.memory_rows.append(measured)
            for clock in self.settings.clocks:
                if clock == "graph":
                    captured, error = _try(lambda: capture_graph(runner, self.device))
                    if captured is None:
                        rows.append(validation_row(self.case, provider, "graph-capture", None, error))
                        continue
                    self.calls[(provider.name, clock)] = captured[0].replay
                    self.statics[provider.name] = captured
                else:
                    self.calls[(provider.name, clock)] = runner
        self.reps = {key: self.timer.reps_for(call) for key, call in self.calls.items()}  # also a warm-up call
        return rows, [p.name for p in self.runnable if p.name in self.runners]

    def memory(self) -> list[dict]:
        """The rows of ``memory.csv`` that `build` measured (none on a non-CUDA device)."""
        return list(self.memory_rows)

    def samples(self, name: str, clock: str, regime: str, block: int) -> list[dict]:
        """The samples of one provider in one (clock, regime) of a block (none where its graph failed)."""
        key = (name, clock)
        if key not in self.calls:
            return []
        return [dict(case=self.case.name, mode=self.case.mode, provider=name, regime=regime, clock=clock, block=block,
                     sample=i, us=us)
                for i, us in enumerate(self.timer.samples(self.calls[key], regime, self.settings.samples,
                                                          self.reps[key]))]

    def check_after(self) -> list[dict]:
        """Re-check what was timed (the eager runner, and the graph's static outputs), then let go of it all."""
        rows = []
        for provider in self.runnable:
            runner = self.runners.get(provider.name)
            if runner is None:
                continue
            for stage, produce in (("after-eager", runner), ("after-graph", self.statics.get(provider.name))):
                if produce is None:
                    continue
                if hasattr(runner, "reset"):
                    runner.reset()
                if stage == "after-graph":
                    graph, outs = produce
                    outputs, error = _try(lambda: (graph.replay(), outs)[1])
                else:
                    outputs, error = _try(produce)
                result = compare(outputs, self.expected, provider, self.case) if outputs is not None else None
                rows.append(validation_row(self.case, provider, stage, result, error))
        self.calls, self.statics, self.runners, self.inputs, self.expected = {}, {}, {}, None, None
        return rows


def release_cached_memory(device: torch.device) -> None:
    """Give the allocator's cached, unused blocks back to the driver (nothing allocated is freed), so
    that the other process of a run (`dsfuse.bench.own_process`) can use them: each process computes
    its own float64 reference, and at 131,072 tokens one process's cache alone holds most of the GPU."""
    if device.type == "cuda":
        gc.collect()  # a CUDA Graph let go of in a reference cycle keeps its pool until collected
        torch.cuda.empty_cache()


def _run_case(experiment, case: Case, providers: list[Provider], settings: RunSettings, timer: Timer,
              device: torch.device, validation: list[dict], memory: list[dict], apart=None) -> list[dict]:
    """Check and time one case; its validation and memory rows are added to ``validation`` and
    ``memory``. ``apart`` (a `dsfuse.bench.own_process.OwnProcess`): the providers it names run in
    that process, checked and measured there on the same seeds and timed inside the same blocks,
    interleaved with the others as if they were here."""
    here = CaseRun(experiment, case, [p for p in providers if apart is None or p.name not in apart.names],
                   settings, timer, device)
    validation += here.check_before()
    if apart is not None:  # what this process's allocator caches but no longer uses, back before the other's reference
        release_cached_memory(device)
        validation += apart.check_before(case.name)
    here.prepare()  # the check set is freed before the timing set is made
    if apart is not None:  # both references before either process's runners and graphs hold memory
        release_cached_memory(device)
        apart.prepare()
    built, local = here.build()
    validation += built
    memory += here.memory()
    remote: list[str] = []
    if apart is not None:
        release_cached_memory(device)
        built, remote = apart.build()
        validation += built
        memory += apart.memory()
    names = [p.name for p in providers if p.name in local or p.name in remote]  # the config's order

    rows = []
    for block in range(settings.blocks):
        order = names[block % max(len(names), 1):] + names[: block % max(len(names), 1)]
        for clock in settings.clocks:
            for regime in settings.regimes:
                for name in order:
                    rows += (apart if name in remote else here).samples(name, clock, regime, block)

    validation += here.check_after()
    if apart is not None:  # this process's runners and graphs, let go of, back before the other's checks
        release_cached_memory(device)
        validation += apart.check_after()
    return rows


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """One row per dict (the union of their keys as columns); floats with 4 decimals."""
    path = Path(path)
    if not rows:
        path.write_text("")
        return
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()} for row in rows)


def load_config(path: str | Path) -> dict:
    return yaml.safe_load(Path(path).read_text())


def sweep(settings, build: Callable[[dict], Any], measure: Callable[[Any, dict], Any], out: str | Path, *,
          value: str = "us", rounds: int = 1, desc: str = "sweep") -> list[dict]:
    """Check and time every setting of a launch-constant sweep; one CSV row per sample in ``out``.

    ``settings``: a list of dicts (each dict's items become columns of its rows), or a dict of
    ``name -> options`` for every combination of the options (``itertools.product``, in order).
    For each setting ``build(setting)`` prepares the run (sets the module constants, returns what
    ``measure`` needs: e.g. a callable, or a callable with its outputs and expected outputs), and
    ``measure(built, setting)`` checks and times it, returning the samples (floats, e.g. from
    ``checked_graph_samples``) or a pair ``(samples, extra)`` with ``extra`` a dict of more columns
    (e.g. registers of the compiled kernel). Rows: the setting's columns, ``extra``, ``round``
    (only when ``rounds > 1``: every setting is run once per round, rounds outermost, so drift
    falls on all settings alike), ``sample`` and ``value``. A setting whose build or measure
    raises is recorded as one row with an empty sample and the exception in ``error``; the sweep
    goes on. The CSV is rewritten after every setting (a sweep stopped half way keeps what it
    measured). ``<out>.env.json`` beside it records the environment (GPU, versions, commit), so the
    report files the sweep's table under its GPU. Prints each setting's median (or its error) above a
    progress bar; returns the rows.
    """
    import itertools
    import statistics
    from collections.abc import Mapping

    if isinstance(settings, Mapping):
        names = list(settings)
        settings = [dict(zip(names, combo)) for combo in itertools.product(*(settings[k] for k in names))]
    else:
        settings = [dict(s) for s in settings]
    rows: list[dict] = []
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{Path(out).with_suffix('')}.env.json").write_text(json.dumps(env_mod.collect(device), indent=2) + "\n")
    with tqdm(total=rounds * len(settings), desc=desc, unit="setting") as bar:
        for rnd in range(rounds):
            for setting in settings:
                label = " ".join(f"{k}={v}" for k, v in setting.items()) + (f" round={rnd}" if rounds > 1 else "")
                tag = {"round": rnd} if rounds > 1 else {}
                try:
                    result = measure(build(setting), setting)
                    pair = isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)
                    samples, extra = result if pair else (result, {})
                    samples = [float(u) for u in samples]
                    if not samples:
                        raise ValueError("measure returned no samples")
                except Exception as exc:  # a failing setting is a row of the CSV, not a gap in it
                    error = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")[:500]
                    rows.append({**setting, **tag, "sample": None, value: None, "error": error})
                    bar.write(f"{label}: FAILED {error}")
                else:
                    rows += [{**setting, **extra, **tag, "sample": i, value: u} for i, u in enumerate(samples)]
                    bar.write(f"{label}: {statistics.median(samples):.1f} {value} median of {len(samples)}")
                write_csv(out, rows)
                bar.update()
    return rows
