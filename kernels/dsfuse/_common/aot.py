"""Ahead-of-time compilation of Triton kernels for a named GPU target.

``triton.compile`` with a ``GPUTarget`` runs the whole pipeline down to a cubin
(Triton ships its own ptxas), so a machine without a GPU can check that every
kernel builds for Hopper (sm_90) and Blackwell (sm_100). Each kernel module lists the
specialisations it launches in ``AOT_SPECS``; the modules are found through the backend
registry (:mod:`dsfuse._common.backends`), so a new op or stage module needs no list here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ARCHS = {"sm_90": 90, "sm_100": 100}


@dataclass(frozen=True)
class AotSpec:
    """One specialisation of a kernel: argument types, constexpr values, and the
    arguments the launcher sees as multiples of 16 (``divisible_by_16``: what
    Triton's runtime specialisation would mark, so vectorisation matches a launch)."""

    name: str
    kernel: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    options: dict[str, object] = field(default_factory=dict)
    divisible_by_16: tuple[str, ...] = ()


def compile_for(spec: AotSpec, arch: str):
    """Compile ``spec`` for ``arch`` (``"sm_90"`` or ``"sm_100"``); return the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {sorted(ARCHS)}, got {arch!r}")
    signature = dict(spec.signature)
    for name in spec.constexprs:
        signature[name] = "constexpr"
    arg_names = spec.kernel.arg_names
    attrs = {(arg_names.index(name),): [["tt.divisibility", 16]] for name in spec.divisible_by_16}
    src = triton.compiler.ASTSource(fn=spec.kernel, signature=signature, constexprs=dict(spec.constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32), options=dict(spec.options))


def spec_modules(backend: str = "triton") -> list[str]:
    """Every registered op's kernel modules of ``backend``, in registration order."""
    from dsfuse._common.backends import load_all_ops

    return [module for entry in load_all_ops().values() for module in entry.kernels.get(backend, ())]


def all_specs(backend: str = "triton") -> list[AotSpec]:
    """Every registered kernel module's ``AOT_SPECS`` of ``backend``."""
    import importlib

    return [spec for module in spec_modules(backend) for spec in importlib.import_module(module).AOT_SPECS]


def main() -> int:
    """``python -m dsfuse._common.aot``: compile every registered Triton kernel's AOT_SPECS for sm_90 and sm_100.

    Prints one JSON line per (spec, arch) with the PTX's global load/store kinds
    and the shared memory size. Run with ``TRITON_INTERPRET`` unset: the
    interpreter replaces kernels by Python functions that cannot be compiled.
    """
    import json

    from dsfuse._common.backends import BACKENDS
    import re
    from collections import Counter

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    failures = 0
    for spec in all_specs():
        for arch in BACKENDS["triton"].aot_archs:
            row = dict(spec=spec.name, arch=arch)
            try:
                compiled = compile_for(spec, arch)
                ptx = compiled.asm["ptx"]
                row.update(ok=True, cubin_bytes=len(compiled.asm["cubin"]), shared=compiled.metadata.shared,
                           target=re.search(r"\.target (\w+)", ptx).group(1),
                           memory_ops=dict(Counter(re.findall(r"\b((?:ld|st)\.global[\.\w]*)", ptx))))
            except Exception as exc:  # report every failure, not just the first
                failures += 1
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            print(json.dumps(row), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
