"""Test configuration.

* Without CUDA, Triton kernels run in the interpreter (``TRITON_INTERPRET=1`` is
  set before anything imports Triton) on CPU tensors.
* GPU tests carry ``@pytest.mark.gpu``. The CPU command deselects them
  (``-m "not gpu"``); ``scripts/gpu_job.sh`` selects them with
  ``DSFUSE_REQUIRE_GPU=1``, under which a missing GPU is an error, not a skip.
* Every ``torch.empty*`` allocation is filled with NaN (integers with their
  maximum) so an output element a kernel forgets to write fails the test.
* Layout: an op's tests live in ``tests/<op>/`` (that folder names the op), the tests of what
  every op shares at the top. The folders are not packages: pytest puts each test's folder (and
  this one, for ``helpers``) on ``sys.path``, so test module names stay unique across folders
  (``test_<op>*.py``).
* The ``backend`` fixture: a test that takes ``backend`` runs once per fused backend its op
  registers (``dsfuse.<op>.api.BACKENDS``, the registry), so a contract test is written once for
  every backend. With ``device`` as well (and no ``parametrize`` of it), the pairs are generated
  together: ``cpu`` with every backend that runs CPU tensors (Triton's interpreter), ``cuda``
  (marked ``gpu``) with every backend. Without ``device`` a ``gpu``-marked test gets every backend
  and a CPU test those that run on the CPU. ``@pytest.mark.serves("forward", ...)`` keeps the
  backends whose table serves those calls; ``forward_stages`` / ``backward_stages`` imply it.
  ``@pytest.mark.refusals`` (a test of bad inputs: refused alike on every path) adds ``"auto"`` and
  ``"reference"`` to the fused backends.
  A backend that is not installed (CuTe DSL without the ``cutedsl`` extra) is a skip naming the
  package, or an error under ``DSFUSE_REQUIRE_CUTEDSL=1``. ``other_backend`` (with ``backend``):
  every ordered pair of two different fused backends. ``launchers``: the backend's loaded table
  (``{call: launcher}``, or an op of stages' stage tables: ``forward_stages``, ``backward_stages``).
  The op is the test's folder, or the module's ``OP``.
"""

import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
REQUIRE_GPU = os.environ.get("DSFUSE_REQUIRE_GPU") == "1"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# The CuTe DSL backend's tests skip without the `cutedsl` extra; DSFUSE_REQUIRE_CUTEDSL=1 (a GPU job
# meant to test that backend) makes a missing package an error instead of a skip.
REQUIRE_CUTEDSL = os.environ.get("DSFUSE_REQUIRE_CUTEDSL") == "1"
AUTO, REFERENCE = "auto", "reference"  # the backend names that are no fused backend
STAGE_FIXTURES = {"forward_stages": "stages", "backward_stages": "stages"}  # fixture -> the call it needs


def cutedsl_or_skip() -> None:
    """At the top of a CuTe DSL code-generation module: skip the module without the `cutedsl` extra
    (an error under DSFUSE_REQUIRE_CUTEDSL=1)."""
    from dsfuse._common import cutedsl

    if cutedsl.installed():
        return
    if REQUIRE_CUTEDSL:
        raise RuntimeError("DSFUSE_REQUIRE_CUTEDSL=1 but the cutedsl extra (nvidia-cutlass-dsl, apache-tvm-ffi) "
                           "is not installed")
    pytest.skip("needs the cutedsl extra: pip install 'dsfuse[cutedsl]'", allow_module_level=True)


def cutedsl_kernels(op: str):
    """At the top of an op's CuTe DSL code-generation module: ``(kernel module, target archs, dtypes)``
    of the op's ``cutedsl`` backend, read from the registry (the module skipped without the extra)."""
    import importlib

    from dsfuse._common.backends import BACKENDS

    cutedsl_or_skip()
    entry = registry(op)
    (module,) = entry.kernels["cutedsl"]
    return importlib.import_module(module), BACKENDS["cutedsl"].aot_archs, tuple(entry.dtypes["cutedsl"])


# -- the backend fixture ----------------------------------------------------------------------


def op_of(module) -> str:
    """The op a test module tests: its ``OP``, else its folder ``tests/<op>/``."""
    op = getattr(module, "OP", None)
    if op is None:
        rel = Path(module.__file__).resolve().relative_to(TESTS)
        if len(rel.parts) < 2:
            raise pytest.UsageError(f"{rel}: takes the backend fixture but names no op (move it to tests/<op>/ "
                                    "or set OP)")
        op = rel.parts[0]
    return op


def registry(op: str):
    """The op's registry entry (``dsfuse.<op>.api.BACKENDS``, an ``OpBackends``)."""
    from dsfuse._common.backends import load_all_ops

    ops = load_all_ops()
    if op not in ops:
        raise pytest.UsageError(f"no registered op {op!r} (registered: {sorted(ops)})")
    return ops[op]


def not_installed(name: str) -> str | None:
    """Why the fused backend ``name`` cannot run in this process for want of its package (None: it can)."""
    from dsfuse._common.backends import BACKENDS

    kind = BACKENDS[name]
    if kind.installed:
        return None
    how = f" (pip install 'dsfuse[{kind.extra}]')" if kind.extra else ""
    return f"the {name} backend is not installed: needs {' and '.join((kind.package, *kind.also_needs))}{how}"


def runs_on_cpu(name: str) -> bool:
    from dsfuse._common.backends import BACKENDS

    return BACKENDS[name].interpreter_on_cpu


def _parametrized(metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    names = metafunc.fixturenames
    if "backend" not in names or _parametrized(metafunc, "backend"):
        return
    entry = registry(op_of(metafunc.module))
    calls = {c for mark in metafunc.definition.iter_markers("serves") for c in mark.args}
    calls |= {call for fixture, call in STAGE_FIXTURES.items() if fixture in names}
    backends = [t.backend for t in entry.tables if t.calls and calls <= set(t.calls)]  # serving no call: no contract
    if not backends:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: no fused backend of {entry.op} serves {sorted(calls)}")
    refusals = metafunc.definition.get_closest_marker("refusals") is not None

    def on(device: str | None) -> list[str]:
        """The backends a test on ``device`` gets (None: the test's own device parametrisation)."""
        fused = [b for b in backends if device != "cpu" or runs_on_cpu(b)]
        return [AUTO, *fused, REFERENCE] if refusals else fused

    if "other_backend" in names:
        pairs = [(a, b) for a in backends for b in backends if a != b]
        if not pairs:  # one fused backend: nothing to pair, said as a skip
            pairs = [pytest.param(backends[0], None, marks=pytest.mark.skip(reason=f"{entry.op} registers one "
                                                                                   "fused backend"))]
        metafunc.parametrize(("backend", "other_backend"), pairs, indirect=True,
                             ids=lambda v: v if isinstance(v, str) else "none")
    elif "device" in names and not _parametrized(metafunc, "device"):
        params = [pytest.param("cpu", b, id=f"cpu-{b}") for b in on("cpu")]
        params += [pytest.param("cuda", b, id=f"cuda-{b}", marks=pytest.mark.gpu) for b in on("cuda")]
        metafunc.parametrize(("device", "backend"), params, indirect=["backend"])
    elif _parametrized(metafunc, "device"):
        metafunc.parametrize("backend", on(None), indirect=True)
    else:
        gpu = metafunc.definition.get_closest_marker("gpu") is not None
        metafunc.parametrize("backend", on("cuda" if gpu else "cpu"), indirect=True)


def _usable(request, name: str) -> str:
    if name in (AUTO, REFERENCE):
        return name
    reason = not_installed(name)
    if reason:
        if REQUIRE_CUTEDSL:  # a job meant to test every backend: a missing one is an error
            raise RuntimeError(f"DSFUSE_REQUIRE_CUTEDSL=1 but {reason}")
        pytest.skip(reason)
    device = getattr(getattr(request.node, "callspec", None), "params", {}).get("device")
    if device == "cpu" and not runs_on_cpu(name):  # an explicit device parametrisation crossed with it
        pytest.skip(f"the {name} backend does not run CPU tensors")
    return name


@pytest.fixture
def backend(request) -> str:
    """A fused backend of the test's op (parametrised by ``pytest_generate_tests``)."""
    if not hasattr(request, "param"):
        raise pytest.UsageError(f"{request.node.nodeid}: backend is parametrised from the registry; do not request "
                                "it from another fixture alone")
    return _usable(request, request.param)


@pytest.fixture
def other_backend(request) -> str:
    """With ``backend``: another fused backend of the op (every ordered pair)."""
    return _usable(request, request.param)


@pytest.fixture
def launchers(request, backend):
    """``backend``'s loaded table for the test's op: ``{call: launcher}`` and its helpers."""
    return registry(op_of(request.module)).load(backend)


@pytest.fixture
def forward_stages(launchers):
    """An op of stages (Gated DeltaNet): the backend's forward stage table (``schedule.ForwardStages``
    of its ``stages`` call)."""
    return launchers["stages"].forward


@pytest.fixture
def backward_stages(launchers):
    """An op of stages: the backend's backward stage table (``schedule.BackwardStages``)."""
    return launchers["stages"].backward


# -- GPU marker, NaN-poisoned allocations ----------------------------------------------------


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            if REQUIRE_GPU:
                raise pytest.UsageError("DSFUSE_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_job.sh on one)"))


def _poison(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # the allocation may be a leaf that requires grad
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool and t.numel():
            t.fill_(torch.iinfo(t.dtype).max)
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    real = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}
    for name, fn in real.items():
        def poisoned(*args, _fn=fn, **kwargs):
            return _poison(_fn(*args, **kwargs))
        monkeypatch.setattr(torch, name, poisoned)
    yield
