"""What every CuTe DSL backend shares: the lazy import, the target architecture of a compile, the
compile cache, and the call path.

* `require` imports ``cutlass`` (the ``cutedsl`` extra) on first use, so importing dsfuse
  never needs it; without it an ``ImportError`` names the extra. `kernel_module`: a backend
  package's loader of its kernel module (which imports ``cutlass``), so its table imports without it.
* `target` / `arch_of`: a compile targets ``CUTE_DSL_ARCH`` (``sm_90a``, ``sm_100a``);
  `compile` sets it for the one compile, so the CPU can compile for any GPU (the AOT test).
  `arch_of` reads a device's compute capability from `dsfuse._common.backends.capability`, the
  one device lookup of the package.
* `KernelCache`: one compiled function per key, the key naming everything that changes the
  generated code (dtype, compile-time sizes, target); lengths that vary between calls (tokens) are
  symbolic in the compiled function, so a new length never compiles. ``compiles`` counts the builds
  (tests assert that a second call compiles nothing).
* The call path: compiled with ``--enable-tvm-ffi`` (``apache-tvm-ffi``, part of the extra): torch
  tensors passed directly, the kernels launched on the current torch stream (the compiled functions
  read it from the TVM-FFI environment), no per-call wrapping. `require` asks for both packages.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from dsfuse._common.backends import capability

EXTRA = "cutedsl"
ARCH_ENV = "CUTE_DSL_ARCH"


def installed() -> bool:
    """Both packages of the ``cutedsl`` extra: the DSL and its call path."""
    return importlib.util.find_spec("cutlass") is not None and tvm_ffi_installed()


def tvm_ffi_installed() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None


def require():
    """``(cutlass, cutlass.cute)``, imported now; ``ImportError`` naming the extra when missing."""
    try:
        cutlass = importlib.import_module("cutlass")
        cute = importlib.import_module("cutlass.cute")
        importlib.import_module("tvm_ffi")
    except ImportError as err:
        raise ImportError(f"the CuTe DSL backend needs nvidia-cutlass-dsl and apache-tvm-ffi: "
                          f"pip install 'dsfuse[{EXTRA}]' ({err})") from err
    return cutlass, cute


def kernel_module(name: str) -> Callable[[], ModuleType]:
    """The loader of a backend package's kernel module ``name``: imported on the first call (it
    imports ``cutlass``), the module from then on."""
    return functools.cache(functools.partial(importlib.import_module, name))


def arch_of(device: torch.device) -> str:
    """The CuTe DSL target of a CUDA device: ``sm_90a`` (H100/H200), ``sm_100a`` (B200), ...

    The exact compute capability, not the GPU family of `dsfuse._common.backends.gpu_family`: code
    for an arch-specific target (``a``) runs on that capability only."""
    major, minor = capability(device)
    return f"sm_{major}{minor}a"


_arch_lock = threading.Lock()


@contextlib.contextmanager
def target(arch: str):
    """Compile for ``arch`` within the block (``CUTE_DSL_ARCH``, restored after)."""
    with _arch_lock:
        old = os.environ.get(ARCH_ENV)
        os.environ[ARCH_ENV] = arch
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(ARCH_ENV, None)
            else:
                os.environ[ARCH_ENV] = old


def compile(fn: Callable, *args: Any, arch: str, keep_ptx: bool = False, dump_dir: str | None = None,
            keep_cubin: bool = False) -> Callable:
    """``cute.compile(fn, *args)`` for ``arch``, with the TVM-FFI call path.

    ``keep_ptx``: the PTX is kept (``compiled.__ptx__``) and written to ``dump_dir`` (default: the
    directory the process started in, where the DSL was imported); ``keep_cubin`` likewise the cubin
    the DSL's own ptxas made (``compiled.__cubin__``: its register counts are the kernel's)."""
    _, cute = require()
    # the DSL reads CUTE_DSL_ARCH once, when it is imported: name the target in the options too
    options = [f"--gpu-arch {arch}", "--enable-tvm-ffi"]
    if keep_ptx:
        options.append("--keep-ptx")
    if keep_cubin:
        options.append("--keep-cubin")
    if dump_dir is not None:
        options.append(f"--dump-dir {dump_dir}")
    with target(arch):
        return cute.compile(fn, *args, options=" ".join(options))


class KernelCache:
    """Compiled functions by key; ``get(key, build)`` builds once per key (see the module)."""

    def __init__(self) -> None:
        self._compiled: dict[Hashable, Callable] = {}
        self._lock = threading.Lock()
        self.compiles = 0

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        fn = self._compiled.get(key)
        if fn is None:
            with self._lock:
                fn = self._compiled.get(key)
                if fn is None:
                    fn = self._compiled[key] = build()
                    self.compiles += 1
        return fn

    def __len__(self) -> int:
        return len(self._compiled)


@dataclass(frozen=True)
class CuteAotSpec:
    """One specialisation a CuTe DSL module compiles for the AOT tests: ``build(arch, **options)`` compiles
    it for ``arch`` with its PTX kept (each module's ``AOT_SPECS`` lists the model's shapes), for each of
    ``archs`` (an instruction of one architecture, such as Hopper's ``wgmma``, names only that one)."""

    name: str
    build: Callable[..., Callable]
    archs: tuple[str, ...] = ("sm_90a", "sm_100a")
