"""Ahead-of-time compilation of Triton kernels for a named GPU target.

``triton.compile`` with a ``GPUTarget`` runs the whole pipeline down to a cubin
(Triton ships its own ptxas), so a machine without a GPU can check that every
kernel builds for Hopper (sm_90) and Blackwell (sm_100). Each kernel module lists the
specialisations it launches in ``AOT_SPECS``; the modules are found through the backend
registry (`dsfuse._common.backends`), so a new op or stage module needs no list here.
A module records its specs from its own launchers (`record_specs`: the launcher is called
with meta tensors of the model's shapes and its kernel launches are intercepted), so a spec
cannot drift from what the launcher passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
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
    arg_names = spec.kernel.arg_names
    constexprs = {}
    for name, value in spec.constexprs.items():
        if isinstance(value, tuple):  # a tuple of constexprs: one constexpr per field, as Triton's runtime passes it
            signature[name] = type(value)(*("constexpr",) * len(value))
            constexprs.update({(arg_names.index(name), i): field for i, field in enumerate(value)})
        else:
            signature[name] = "constexpr"
            constexprs[name] = value
    attrs = {(arg_names.index(name),): [["tt.divisibility", 16]] for name in spec.divisible_by_16}
    src = triton.compiler.ASTSource(fn=spec.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32), options=dict(spec.options))


@contextlib.contextmanager
def _intercepted_launches() -> Iterator[list[tuple[object, tuple, dict]]]:
    """Within the block, ``kernel[grid](*args, **kwargs)`` runs nothing and appends
    ``(kernel, args, kwargs)`` to the list yielded. ``run`` is replaced on the classes (Triton's
    ``JITFunction`` and, under the interpreter, ``InterpretedFunction``), so every kernel a
    launcher reaches is caught, however it is imported; not thread-safe (import-time use)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[tuple[object, tuple, dict]] = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    saved = {cls: cls.__dict__["run"] for cls in (JITFunction, InterpretedFunction)}
    try:
        for cls in saved:
            cls.run = run
        yield launches
    finally:
        for cls, original in saved.items():
            cls.run = original


@contextlib.contextmanager
def _as_on_gpu() -> Iterator[None]:
    """``TRITON_INTERPRET`` reads as unset within the block: a launcher takes the path of a GPU
    launch (``dsfuse._common.backends.interpreting()`` is false), so the interpreter-only
    constexprs (bf16 emulation, while loops) are recorded as the GPU sets them."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _kernel_params(kernel) -> list:
    """Triton's ``KernelParam`` of each argument of ``kernel`` (a ``JITFunction`` has them; an
    ``InterpretedFunction`` is given them from its function and its ``do_not_specialize`` lists,
    as ``JITFunction.__init__`` builds them)."""
    from triton.runtime.jit import KernelParam

    if hasattr(kernel, "params"):
        return list(kernel.params)
    dns = kernel.kwargs.get("do_not_specialize") or ()
    dns_oa = kernel.kwargs.get("do_not_specialize_on_alignment") or ()
    return [KernelParam(i, param, i in dns or param.name in dns, i in dns_oa or param.name in dns_oa)
            for i, param in enumerate(inspect.signature(kernel.fn).parameters.values())]


def spec_of_launch(name: str, kernel, args: tuple, kwargs: dict) -> AotSpec:
    """The `AotSpec` of one launch ``kernel[grid](*args, **kwargs)``, as ``JITFunction.run``
    specialises it on a GPU (Triton 3.6, ``create_function_from_signature`` and ``_pack_args``):

    * ``constexprs``: the ``tl.constexpr`` arguments, and the arguments the runtime turns into
      constants (``None``, an int equal to 1 unless listed in ``do_not_specialize``, and a tuple
      of ``tl.constexpr`` values, kept whole);
    * ``signature``: every other argument's type from ``native_specialize_impl`` (``*bf16``,
      ``i32``, ``i64``, ``fp32``, ...; a Triton type annotation wins, floats and bools not
      specialised);
    * ``divisible_by_16``: the arguments whose specialisation is ``"D"``: a tensor whose address
      is a multiple of 16 bytes, an int that is a multiple of 16 (not for ``do_not_specialize``
      or ``do_not_specialize_on_alignment`` arguments);
    * ``options``: the keyword arguments that are not kernel arguments (``num_warps``,
      ``num_stages``, ``maxnreg``, ``enable_fp_fusion``, ...), those set to None left out as
      the CUDA backend's ``parse_options`` does.

    Example tensors on the meta device have address 0 plus their view's offset, as an allocation
    of the CUDA caching allocator (256-byte aligned) would give."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend, CUDAOptions

    params = _kernel_params(kernel)
    names = [p.name for p in params]
    fn = kernel.fn
    bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    options = {k: v for k, v in kwargs.items() if k not in names}
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(CUDAOptions)})
    if unknown:
        raise ValueError(f"kwargs: {unknown} are neither arguments of {fn.__name__} nor Triton launch options")
    signature, constexprs, divisible = {}, {}, []
    for kp in params:
        value = bound.arguments[kp.name]
        if kp.is_constexpr:
            constexprs[kp.name] = value
            continue
        specialize, align = not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
        ty, attr = native_specialize_impl(CUDABackend, value, kp.is_const, specialize, align)
        if isinstance(ty, tuple):  # a tuple argument: only tuples of constexprs (e.g. a stage's shared constants)
            if any(t != "constexpr" for t in ty):
                raise ValueError(f"{kp.name}: a tuple argument of {ty} is more than an AotSpec holds (constexpr fields)")
            constexprs[kp.name] = value
            continue
        if kp.annotation_type:  # an annotated argument keeps its type; floats and bools not specialised
            if kp.annotation_type == "u1" or kp.annotation_type[:2] in ("fp", "bf"):
                specialize = False
            ty, attr = (kp.annotation_type, attr) if specialize else (kp.annotation_type, None)
        if ty == "constexpr":
            constexprs[kp.name] = value
            continue
        signature[kp.name] = ty
        attrs = CUDABackend.parse_attr(attr) if isinstance(attr, str) else []
        if any(a != ["tt.divisibility", 16] for a in attrs):
            raise ValueError(f"{kp.name}: specialisation {attr!r} is more than an AotSpec holds (divisibility by 16)")
        if attrs:
            divisible.append(kp.name)
    options = {k: v for k, v in options.items() if v is not None}
    return AotSpec(name=name, kernel=kernel, signature=signature, constexprs=constexprs, options=options,
                   divisible_by_16=tuple(divisible))


def record_specs(names: str | Sequence[str], launch: Callable, *args, **kwargs) -> list[AotSpec]:
    """The `AotSpec` of each kernel launch of ``launch(*args, **kwargs)``, named ``names`` (one
    name, or one per launch in launch order); the launches run nothing.

    ``launch`` is a launcher (it computes its grid, strides and constexprs and launches with
    ``kernel[grid](...)``) given example tensors of the model's shapes, best on the meta device
    (no memory; the launcher must not read their values). It is called as on a GPU
    (``TRITON_INTERPRET`` reads as unset during the call, also under the CPU tests' interpreter),
    and each launch is specialised as Triton's runtime would (`spec_of_launch`). A launcher that
    picks its constants by GPU family is called within its own way of choosing one (e.g.
    ``dsfuse.gdn.triton.common.assume_family``). Raises ValueError when the number of launches
    is not the number of names."""
    names = [names] if isinstance(names, str) else list(names)
    with _as_on_gpu(), _intercepted_launches() as launches:
        launch(*args, **kwargs)
    if len(launches) != len(names):
        raise ValueError(f"names: {len(names)} given ({names}) but {getattr(launch, '__name__', launch)} "
                         f"launched {len(launches)} kernels")
    return [spec_of_launch(name, *launch_) for name, launch_ in zip(names, launches)]


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
