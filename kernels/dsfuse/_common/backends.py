"""Backends, the ops that offer them, and the one place that decides which serves a call.

A backend is a way to compute an op's math:

* ``reference``: the op's eager PyTorch reference (``<op>/reference.py``); serves every call.
* ``triton``: the fused Triton kernels; CUDA tensors, or CPU tensors under Triton's
  interpreter (``TRITON_INTERPRET=1``, how CI runs them).
* ``cutedsl``: the fused CuTe DSL kernels; CUDA only, needs the ``cutedsl`` extra.

Each fused backend of an op is a package, ``dsfuse/<op>/<backend>/``, whose ``__init__.py`` exports
one [`BackendTable`][dsfuse._common.backends.BackendTable] named ``TABLE``: the dtypes it computes in,
the calls it serves with each call's reasons against it, its kernel modules (where the AOT check
finds ``AOT_SPECS``) and a loader of its launchers (or stage tables), imported on first use, so a
table imports without its backend's package. [`register`][dsfuse._common.backends.register]
(``BACKENDS = register("<op>")`` in the op's ``api.py``) finds the tables; the op's code never
names a backend. Every public entry point asks
[`OpBackends.choose`][dsfuse._common.backends.OpBackends.choose] (after validating its arguments,
so a call is accepted or refused the same way whatever serves it):

* ``backend="<name>"``: that backend, or ``ValueError`` naming every reason it cannot serve the
  call;
* ``backend="auto"``: on CUDA the first fused backend of the GPU family's order that serves the
  call, else the reference; on the CPU the reference (the interpreter is for tests, never picked
  by ``auto``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import pkgutil
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dsfuse._common.op import tracing

AUTO = "auto"
REFERENCE = "reference"
LOG = logging.getLogger("dsfuse")


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
    # its tables' reasons read data pointers: while torch.compile traces (fake tensors) ``auto`` does
    # not pick it, and a call that names it is checked by its declared op when that runs
    reasons_need_addresses: bool = False
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
                       also_needs=("tvm_ffi",), reasons_need_addresses=True),
}

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the fused kernels so far compute in


# -- the GPU of a device (looked up once per device index) -----------------------------------

_CAPABILITIES: dict[int, tuple[int, int]] = {}
_FAMILIES: dict[int, str] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA device, looked up once per device."""
    index = _index(device)
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPABILITIES[index]


def gpu_family(device: torch.device) -> str:
    """``"sm_90"`` (Hopper), ``"sm_100"`` (Blackwell), ... for a CUDA device; ``"cpu"`` otherwise.

    The device-to-family lookup for ``auto``'s order and per-family launch constants (one
    capability lookup per device, `capability`)."""
    if device.type != "cuda":
        return "cpu"
    index = _index(device)
    family = _FAMILIES.get(index)
    if family is None:
        family = _FAMILIES[index] = f"sm_{capability(device)[0]}0"
    return family


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- what one fused backend of an op offers --------------------------------------------------

Reasons = Callable[..., Sequence[str]]


def no_reasons(*args) -> list[str]:
    """A call a backend serves whenever its dtype, device and package allow (no reasons of its own)."""
    return []


@dataclass(frozen=True)
class BackendTable:
    """One fused backend of one op: what ``dsfuse/<op>/<backend>/__init__.py`` exports as ``TABLE``.

    ``backend``: a key of ``BACKENDS`` (``"triton"``, ``"cutedsl"``). ``dtypes``: the dtypes its
    kernels compute in. ``calls``: the op's calls it serves (``"forward"``, ``"backward"``, ...),
    each with a function of the call's arguments (those its launcher takes) giving the reasons it
    cannot serve that call (``no_reasons`` where there are none); a call it does not list, it does
    not serve. ``kernels``: the modules holding its kernels, each with ``AOT_SPECS`` (the AOT check
    compiles them). ``load``: imports the kernel modules and returns ``{call: launcher}`` (a stage
    table for an op of stages) plus any helper the op's code reads (e.g. a workspace size), called
    once, on first use. ``auto``: GPU family -> this backend's place in ``auto``'s order there
    (lower first; ``None``: ``auto`` never picks it there, it serves calls that name it); on a
    family no table names, the order of the tables (``BACKENDS``' order). With a second fused
    backend the order of a family is the one measured faster on it (the op's page cites the run).
    """

    backend: str
    dtypes: tuple[torch.dtype, ...]
    calls: Mapping[str, Reasons]
    kernels: tuple[str, ...]
    load: Callable[[], Mapping[str, Any]]
    auto: Mapping[str, int | None] = field(default_factory=dict)
    _loaded: list = field(default_factory=list, init=False, repr=False, compare=False)

    def launchers(self) -> Mapping[str, Any]:
        """``load()``'s mapping, loaded once (imports the kernel modules, so the backend's package)."""
        if not self._loaded:
            with _LOAD_LOCK:
                if not self._loaded:
                    loaded = dict(self.load())
                    if missing := set(self.calls) - set(loaded):
                        raise RuntimeError(f"{self.backend}: load() gave no launcher for the calls {sorted(missing)}")
                    self._loaded.append(loaded)
        return self._loaded[0]


_LOAD_LOCK = threading.RLock()  # reentrant: a table's load may load another's (the CuTe DSL GDN backward falls back to the Triton stages)


@dataclass(frozen=True)
class OpBackends:
    """What one op offers beyond its reference: its backends' tables, in ``BACKENDS``' order.

    Built by [`register`][dsfuse._common.backends.register] from the op's backend packages;
    ``kernels``, ``dtypes`` and ``preference`` are read from the tables.
    """

    op: str
    tables: tuple[BackendTable, ...]

    def __post_init__(self):
        by_name = {table.backend: table for table in self.tables}
        for name in by_name:
            if name not in BACKENDS:
                raise ValueError(f"{self.op}: unknown backend {name!r}; known: {sorted(BACKENDS)}")
        if len(by_name) != len(self.tables):
            raise ValueError(f"{self.op}: two tables of one backend: {[t.backend for t in self.tables]}")
        object.__setattr__(self, "_by_name", by_name)
        families = sorted({family for table in self.tables for family in table.auto})
        object.__setattr__(self, "_orders", {family: self._order(family) for family in families})
        object.__setattr__(self, "_default_order", self._order(None))

    def _order(self, family: str | None) -> tuple[str, ...]:
        """``auto``'s order on ``family``: the tables' ranks there, then the unranked in table order."""
        ranked = []
        for i, table in enumerate(self.tables):
            rank = table.auto.get(family, 1000 + i) if family is not None else 1000 + i
            if rank is not None:
                ranked.append((rank, i, table.backend))
        return tuple(name for _, _, name in sorted(ranked))

    @property
    def kernels(self) -> dict[str, tuple[str, ...]]:
        """Fused backend name -> the modules holding its kernels and ``AOT_SPECS``."""
        return {table.backend: table.kernels for table in self.tables}

    @property
    def dtypes(self) -> dict[str, tuple[torch.dtype, ...]]:
        """Fused backend name -> the dtypes it computes in (the reference takes any the op accepts)."""
        return {table.backend: table.dtypes for table in self.tables}

    @property
    def preference(self) -> dict[str, tuple[str, ...]]:
        """GPU family -> the order ``auto`` tries the fused backends in, for the families a table names."""
        return dict(self._orders)

    @property
    def first(self) -> str:
        """The op's first fused backend (its declared ops carry no backend suffix)."""
        return self.tables[0].backend

    def table(self, backend: str) -> BackendTable:
        return self._by_name[backend]

    def serving(self, call: str) -> tuple[str, ...]:
        """The fused backends that have a kernel for ``call``, in table order."""
        return tuple(table.backend for table in self.tables if call in table.calls)

    def load(self, backend: str) -> Mapping[str, Any]:
        """``backend``'s launchers (and helpers), its kernel modules imported on first use."""
        return self._by_name[backend].launchers()

    def names(self) -> tuple[str, ...]:
        return (AUTO, *self._by_name, REFERENCE)

    def reasons_against(self, backend: str, device: torch.device, dtype: torch.dtype,
                        extra: Sequence[str] = (), call: str | None = None) -> list[str]:
        """Why ``backend`` cannot serve a call on ``device`` in ``dtype``, before its own reasons
        (empty when none): its package, the device, the dtype, a ``call`` it has no kernel for, and
        ``extra``, the call's reasons against every fused backend (e.g. an input that requires a
        gradient the kernels do not give)."""
        if backend == REFERENCE:
            return []
        table = self._by_name[backend]
        reasons = BACKENDS[backend].reasons_against(device)
        if dtype not in table.dtypes:
            names = ", ".join(map(_dtype_name, table.dtypes))
            reasons.append(f"dtype {_dtype_name(dtype)} is not one of {names}")
        if call is not None and call not in table.calls:
            reasons.append(f"the {BACKENDS[backend].title} backend has no {call} kernel for {self.op} "
                           f"(it has: {', '.join(table.calls)})")
        return reasons + list(extra)

    def own_reasons(self, backend: str, call: str, args: Sequence[Any], auto: bool = False) -> list[str]:
        """``backend``'s own reasons against ``call`` with these arguments (its table's function).

        A backend whose reasons read data pointers has none to give while torch.compile traces:
        ``auto`` is told so (it takes another backend), a call that names it is checked by its
        declared op when that runs. Under ``auto`` a kernel module that does not import (another
        ``cutlass`` package) is a reason; a call that names the backend gets the ``ImportError``."""
        if BACKENDS[backend].reasons_need_addresses and _tracing(args):
            return [f"tracing: the {BACKENDS[backend].title} kernels' layout needs addresses, known at run time"] \
                if auto else []
        try:
            return list(self._by_name[backend].calls[call](*args))
        except ImportError as err:
            if not auto:
                raise
            return [f"the {BACKENDS[backend].title} kernels of {self.op} do not import ({err})"]

    def check_at_run_time(self, backend: str, call: str, args: Sequence[Any]) -> None:
        """In a declared op's launch: ``ValueError`` with ``backend``'s own reasons against ``call``
        where they need addresses (deferred while torch.compile traced the call); nothing else."""
        if not BACKENDS[backend].reasons_need_addresses or _tracing(args):
            return
        if reasons := list(self._by_name[backend].calls[call](*args)):
            raise ValueError(f"backend={backend!r} cannot serve this {self.op} call: " + "; ".join(reasons))

    def choose(self, backend: str, device: torch.device, dtype: torch.dtype, extra: Sequence[str] = (),
               call: str | None = None, args: Sequence[Any] = ()) -> str:
        """The backend that serves this call (see the module docstring).

        ``call`` and ``args``: the call (a key of the tables' ``calls``) and its arguments, for each
        backend's own reasons. ``auto`` asks a backend's own reasons only where the rest allow it
        (so a backend's module is imported only where it is installed); a named backend gets the
        rest first, then its own reasons, in the ``ValueError``."""
        if backend not in self.names():
            raise ValueError(f"backend: expected one of {self.names()} for {self.op}, got {backend!r}")
        if backend == REFERENCE:
            return self._served(backend, REFERENCE, "asked for", call)
        if backend != AUTO:
            reasons = self.reasons_against(backend, device, dtype, extra, call)
            if not reasons and call is not None:
                reasons = self.own_reasons(backend, call, args)
            if reasons:
                raise ValueError(f"backend={backend!r} cannot serve this {self.op} call: " + "; ".join(reasons))
            return self._served(backend, backend, "asked for", call)
        if device.type != "cuda":
            return self._served(backend, REFERENCE, f"tensors on {device.type}: auto runs the reference there", call)
        skipped = []
        for name in self.auto_order(device):
            reasons = self.reasons_against(name, device, dtype, extra, call)
            if not reasons and call is not None:
                reasons = self.own_reasons(name, call, args, auto=True)
            if not reasons:
                return self._served(backend, name, "; ".join(skipped) or f"first in auto's order on {device}", call)
            skipped.append(f"not {name}: " + ", ".join(reasons))
        return self._served(backend, REFERENCE, "; ".join(skipped) or "no fused backend on this GPU", call)

    def _served(self, asked: str, chosen: str, why: str, call: str | None) -> str:
        """Log which backend serves the call, and why, at debug level on the ``dsfuse`` logger
        (``logging.getLogger("dsfuse").setLevel(logging.DEBUG)`` shows it); return ``chosen``."""
        if not torch.compiler.is_compiling() and LOG.isEnabledFor(logging.DEBUG):  # no logger while tracing
            LOG.debug("%s%s: backend %r served (asked %r): %s", self.op, f" {call}" if call else "", chosen, asked, why)
        return chosen

    def reused(self, chosen: str, call: str | None) -> str:
        """Log that a call reuses the backend chosen for the first call of its signature (see
        ``dsfuse._common.plans``); return ``chosen``."""
        if LOG.isEnabledFor(logging.DEBUG):
            LOG.debug("%s%s: backend %r served (chosen for the first call of this signature)", self.op,
                      f" {call}" if call else "", chosen)
        return chosen

    def auto_order(self, device: torch.device) -> tuple[str, ...]:
        """The fused backends ``auto`` tries on ``device``'s GPU family, in order."""
        return self._orders.get(gpu_family(device), self._default_order)


def _tracing(args: Sequence[Any]) -> bool:
    """True while torch.compile traces (no data pointers; see ``dsfuse._common.op.tracing``)."""
    return tracing(*args)


def kernel_module_getattr(module: str) -> Callable[[str], Any]:
    """A backend package's module ``__getattr__``: a name the table does not define is read from its
    kernel module ``module``, imported on first use (so ``dsfuse.<op>.<backend>.<name>`` keeps
    naming the kernel module's functions and constants, and importing the table imports nothing)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(module), name)

    return __getattr__


OPS: dict[str, OpBackends] = {}


def register(op: str) -> OpBackends:
    """Register ``op``'s fused backends (once, at import of its ``api`` module): the ``TABLE`` of
    every package ``dsfuse.<op>.<backend>`` for ``backend`` in ``BACKENDS``, in that order."""
    tables = []
    for name in BACKENDS:
        module = f"dsfuse.{op}.{name}"
        if importlib.util.find_spec(module) is None:
            continue
        table = getattr(importlib.import_module(module), "TABLE", None)
        if not isinstance(table, BackendTable) or table.backend != name:
            raise TypeError(f"{module}: expected a BackendTable of backend {name!r} named TABLE, got {table!r}")
        tables.append(table)
    if not tables:
        raise ValueError(f"{op}: no backend package (dsfuse.{op}.<backend> for a backend of {list(BACKENDS)})")
    entry = OpBackends(op, tuple(tables))
    OPS[op] = entry
    return entry


def load_all_ops() -> dict[str, OpBackends]:
    """Import every op package under ``dsfuse`` (each registers itself) and return the registry."""
    import dsfuse

    for info in pkgutil.iter_modules(dsfuse.__path__):
        if info.ispkg and not info.name.startswith("_") and info.name not in ("bench", "models"):
            importlib.import_module(f"dsfuse.{info.name}")
    return OPS
