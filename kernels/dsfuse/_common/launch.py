"""Launch helpers shared by every op: the stream context and the bound Triton launch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

CACHE_LIMIT = 1024  # entries per cache; a full cache starts over (a shape-sweeping caller stays bounded)


def on_stream(stream: torch.cuda.Stream | None, device: torch.device):
    """Context that makes ``stream`` current (allocations and launches go to it).

    ``None`` keeps the current stream. A stream on another device is an error.
    """
    if stream is None:
        return contextlib.nullcontext()
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream: expected a torch.cuda.Stream or None, got {type(stream).__name__}")
    if device.type != "cuda" or stream.device != device:
        raise ValueError(f"stream: expected a stream on {device}, got one on {stream.device}")
    return torch.cuda.stream(stream)


def layout_key(*tensors: torch.Tensor | None) -> tuple:
    """Per tensor what a Triton specialisation can read from it: dtype, shape, strides and the data
    pointer modulo 16 (``None`` stays ``None``). A launcher whose int arguments are functions of its
    tensors' shapes and strides is fully specialised by this key and its flags."""
    return tuple(None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() % 16) for t in tensors)


@dataclass(frozen=True)
class Geometry:
    """What a launch derives from its key once: the grid, the scalar arguments that follow the tensor
    arguments, and the constexprs (with launch options such as ``num_warps``)."""

    grid: tuple[int, ...]
    scalars: tuple = ()
    constexprs: dict[str, Any] | None = None


class TritonLaunch:
    """A Triton kernel launched through its compiled form, looked up by the launcher's key.

    ``kernel[grid](...)`` binds and specialises every argument on every call (for twenty arguments
    about as much host time as the rest of an eager call). A launcher that knows what fixes the
    specialisation passes it as ``key`` (e.g. its flags and [`layout_key`][dsfuse._common.launch.layout_key]
    of its tensors); ``geometry()`` is called on the first launch of a key only. That launch goes
    through Triton as usual (compiling or loading from its cache) and keeps the compiled kernel; later
    launches of the key pass the tensors and the stored scalars straight to its launcher. Under the
    interpreter, or with a Triton launch hook set (a profiler), every call takes Triton's path.

    The kernel's parameters must be the tensors, then the scalars, then the constexprs."""

    def __init__(self, fn, **options):
        from triton import knobs
        from triton.runtime.jit import JITFunction

        self._hooks = knobs.runtime  # launch hooks, set by profilers such as proton, need Triton's path
        self.fn = fn
        self.options = options
        self.bindable = isinstance(fn, JITFunction)  # not under TRITON_INTERPRET
        self._bound: dict[tuple, tuple] = {}

    def __call__(self, key: tuple, tensors: Sequence[torch.Tensor | None], geometry: Callable[[], Geometry]) -> None:
        bind = self.bindable and tensors[0].is_cuda  # not meta (AOT recording) nor interpreted CPU tensors
        if bind:
            device = torch.cuda.current_device()
            bound = self._bound.get((device, key))
            if bound is not None and not _hooked(self._hooks.launch_enter_hook, self._hooks.launch_exit_hook):
                run, grid, function, metadata, tail = bound
                run(*grid, torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None,
                    *tensors, *tail)
                return
        geo = geometry()
        kernel = self.fn[geo.grid](*tensors, *geo.scalars, **(geo.constexprs or {}), **self.options)
        if bind and kernel is not None:
            if len(self._bound) >= CACHE_LIMIT:
                self._bound.clear()
            self._bound[(device, key)] = self._bind(kernel, geo, len(tensors))

    def _bind(self, kernel, geo: Geometry, n_tensors: int) -> tuple:
        """The compiled kernel's launcher and the arguments after the tensors, in parameter order."""
        names = [p.name for p in self.fn.params]
        given = {**dict(zip(names[n_tensors:], geo.scalars)), **(geo.constexprs or {})}
        tail = tuple(given[n] if n in given else self.fn.params[i].default for i, n in enumerate(names)
                     if i >= n_tensors)
        grid = (*geo.grid, 1, 1)[:3]
        return kernel.run, grid, kernel.function, kernel.packed_metadata, tail


def _hooked(*hooks) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps them in (empty) hook chains, older ones as None."""
    return any(getattr(hook, "calls", hook) for hook in hooks)
