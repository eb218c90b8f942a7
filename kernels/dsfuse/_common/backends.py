"""Backends, the ops that offer them, and the one place that decides which serves a call.

A backend is a way to compute an op's math:

* ``reference``: the op's eager PyTorch reference (``<op>/reference.py``); serves every call.
* ``triton``: the fused Triton kernels; CUDA tensors, or CPU tensors under Triton's
  interpreter (``TRITON_INTERPRET=1``, how CI runs them).
* ``cutedsl`` (registered by the ops that have CuTe DSL kernels): CUDA only, needs the
  ``cutedsl`` extra.

Each op registers an :class:`OpBackends`: the modules that hold its kernels per backend
(where the AOT check finds them), the dtypes each fused backend computes in, and the
order ``backend="auto"`` tries the fused backends in on each GPU family. Every public
entry point asks :func:`choose` (after validating its arguments, so a call is accepted
or refused the same way whatever serves it):

* ``backend="<name>"``: that backend, or ``ValueError`` naming every reason it cannot
  serve the call;
* ``backend="auto"``: on CUDA the first fused backend of the GPU family's order that
  serves the call, else the reference; on the CPU the reference (the interpreter is
  for tests, never picked by ``auto``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

AUTO = "auto"
REFERENCE = "reference"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRITON_IMPORT_MODE: list[bool] = []  # [interpreted?] of Triton's own library, once Triton is imported


def triton_mode_mismatch() -> str | None:
    """Why Triton cannot run in the mode ``TRITON_INTERPRET`` asks for now (``None`` when it can).

    Triton reads the variable when a kernel is decorated, its own library (``tl.sum``, ...)
    included, at ``import triton``: set after that import, the kernels stay compiled (on a CPU
    machine: "0 active drivers"); unset after it, they stay interpreted. So every entry point
    (``python -m dsfuse.bench``, the notebooks, ``tests/conftest.py``) sets it before anything
    imports Triton, and a call in the other order is refused with this reason."""
    if not _TRITON_IMPORT_MODE:  # looked up once (the mode cannot change), never while tracing
        standard = sys.modules.get("triton.language.standard")
        if standard is None or torch.compiler.is_compiling():
            return None
        from triton.runtime.jit import JITFunction

        _TRITON_IMPORT_MODE.append(not isinstance(standard.sum, JITFunction))
    imported_interpreted = _TRITON_IMPORT_MODE[0]
    if imported_interpreted == interpreting():
        return None
    now, then = ("set", "unset") if interpreting() else ("unset", "set")
    return (f"TRITON_INTERPRET is {now} now but was {then} when Triton was imported, and Triton keeps the mode "
            f"of import; set it before anything imports triton or dsfuse")


@dataclass(frozen=True)
class Backend:
    """A fused backend: the package it needs and the devices it runs on."""

    name: str
    title: str  # how messages name it
    package: str  # importable module the backend needs
    extra: str | None = None  # the dsfuse extra that installs it
    interpreter_on_cpu: bool = False  # runs CPU tensors under TRITON_INTERPRET=1
    aot_archs: tuple[str, ...] = ()  # targets the AOT check compiles its kernels for
    also_needs: tuple[str, ...] = ()  # other importable modules of the same extra
    installed: bool = field(init=False)  # looked up once, so torch.compile traces no import machinery

    def __post_init__(self):
        found = all(importlib.util.find_spec(m) is not None for m in (self.package, *self.also_needs))
        object.__setattr__(self, "installed", found)

    def reasons_against(self, device: torch.device) -> list[str]:
        reasons = []
        if not self.installed:
            how = f" (pip install 'dsfuse[{self.extra}]')" if self.extra else ""
            names = " and ".join((self.package, *self.also_needs))
            reasons.append(f"the {self.name} backend needs the package{'s' if self.also_needs else ''} {names}{how}")
        cpu_ok = self.interpreter_on_cpu and interpreting() and device.type == "cpu"
        if device.type != "cuda" and not cpu_ok:
            where = ", or TRITON_INTERPRET=1 for CPU" if self.interpreter_on_cpu else ""
            reasons.append(f"tensors are on {device} ({self.title} needs CUDA{where})")
        mismatch = triton_mode_mismatch() if self.interpreter_on_cpu else None
        if mismatch:
            reasons.append(mismatch)
        return reasons


BACKENDS: dict[str, Backend] = {
    "triton": Backend("triton", "Triton", "triton", interpreter_on_cpu=True, aot_archs=("sm_90", "sm_100")),
    "cutedsl": Backend("cutedsl", "CuTe DSL", "cutlass", extra="cutedsl", aot_archs=("sm_90a", "sm_100a"),
                       also_needs=("tvm_ffi",)),
}


def gpu_family(device: torch.device) -> str:
    """``"sm_90"`` (Hopper), ``"sm_100"`` (Blackwell), ... for a CUDA device; ``"cpu"`` otherwise."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FAMILIES:
        _FAMILIES[index] = f"sm_{torch.cuda.get_device_capability(index)[0]}0"
    return _FAMILIES[index]


_FAMILIES: dict[int, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class OpBackends:
    """What one op offers beyond its reference.

    ``kernels``: fused backend name -> the modules holding its kernels and ``AOT_SPECS``.
    ``dtypes``: fused backend name -> the dtypes it computes in (the reference takes any
    dtype the op's validation accepts). ``preference``: GPU family -> the order ``auto``
    tries the fused backends in; a family not listed uses the order of ``kernels``. With a
    second fused backend, the order of a family is the one measured faster on it (the op's
    page cites the run).
    """

    op: str
    kernels: dict[str, tuple[str, ...]]
    dtypes: dict[str, tuple[torch.dtype, ...]]
    preference: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def names(self) -> tuple[str, ...]:
        return (AUTO, *self.kernels, REFERENCE)

    def reasons_against(self, backend: str, device: torch.device, dtype: torch.dtype,
                        extra: Sequence[str] = ()) -> list[str]:
        """Why ``backend`` cannot serve a call on ``device`` in ``dtype`` (empty when it can).

        ``extra``: the call's own reasons against every fused backend (e.g. an input that
        requires a gradient the kernels do not give).
        """
        if backend == REFERENCE:
            return []
        reasons = BACKENDS[backend].reasons_against(device)
        if dtype not in self.dtypes[backend]:
            names = ", ".join(map(_dtype_name, self.dtypes[backend]))
            reasons.append(f"dtype {_dtype_name(dtype)} is not one of {names}")
        return reasons + list(extra)

    def choose(self, backend: str, device: torch.device, dtype: torch.dtype, extra: Sequence[str] = (),
               own: Mapping[str, Callable[[], Sequence[str]]] | None = None) -> str:
        """The backend that serves this call (see the module docstring).

        ``own``: backend name -> a function giving the call's reasons against that backend alone
        (e.g. a head dim only one backend compiles for), asked by ``auto`` when the backend is
        otherwise available (so a backend's module is imported only where it is installed). An
        explicit backend is checked by the caller's own messages instead."""
        if backend not in self.names():
            raise ValueError(f"backend: expected one of {self.names()} for {self.op}, got {backend!r}")
        if backend == REFERENCE:
            return REFERENCE
        if backend != AUTO:
            reasons = self.reasons_against(backend, device, dtype, extra)
            if reasons:
                raise ValueError(f"backend={backend!r} cannot serve this {self.op} call: " + "; ".join(reasons))
            return backend
        if device.type != "cuda":
            return REFERENCE
        own = own or {}
        for name in self.preference.get(gpu_family(device), tuple(self.kernels)):
            if not self.reasons_against(name, device, dtype, extra) and not (name in own and own[name]()):
                return name
        return REFERENCE


OPS: dict[str, OpBackends] = {}


def register(entry: OpBackends) -> OpBackends:
    """Register an op's backends (once, at import of its ``api`` module)."""
    for name in entry.kernels:
        if name not in BACKENDS:
            raise ValueError(f"{entry.op}: unknown backend {name!r}; known: {sorted(BACKENDS)}")
    if set(entry.dtypes) != set(entry.kernels):
        raise ValueError(f"{entry.op}: dtypes name backends {sorted(entry.dtypes)}, kernels {sorted(entry.kernels)}")
    for family, order in entry.preference.items():
        if not set(order) <= set(entry.kernels):
            raise ValueError(f"{entry.op}: the {family} preference {order} names a backend without kernels")
    OPS[entry.op] = entry
    return entry


def load_all_ops() -> dict[str, OpBackends]:
    """Import every op package under ``dsfuse`` (each registers itself) and return the registry."""
    import dsfuse

    for info in pkgutil.iter_modules(dsfuse.__path__):
        if info.ispkg and not info.name.startswith("_") and info.name not in ("bench", "models"):
            importlib.import_module(f"dsfuse.{info.name}")
    return OPS
