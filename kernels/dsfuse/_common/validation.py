"""Argument validation shared by every op.

Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong
shape, layout, device or aliasing) with a message that names the argument, what
was expected and what was given. Checks are plain ``if``/``raise``, never
``assert``, so they survive ``python -O``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def check_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_tensors(tensors: dict[str, object], ndim: int | None = None, layout: str = "") -> None:
    """Each value must be a tensor (``TypeError``) and, when ``ndim`` is given, have that many dims
    (``ValueError`` naming ``layout``, e.g. ``"[N, S, D]"``, else the number of dims)."""
    for name, t in tensors.items():
        check_tensor(name, t)
        if ndim is not None and t.ndim != ndim:
            raise ValueError(f"{name}: expected {layout or f'{ndim} dims'}, got shape {list(t.shape)}")


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    """``t.dtype`` must be one of ``allowed`` (``TypeError`` otherwise)."""
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name}: expected dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {str(ref.dtype).removeprefix('torch.')} (that of {ref_name}), "
                        f"got {str(t.dtype).removeprefix('torch.')}")


def check_contiguous(name: str, t: torch.Tensor, storage: str = "") -> None:
    """``t`` must be contiguous (``storage`` names the expected layout in the message)."""
    if not t.is_contiguous():
        what = f" {storage}" if storage else ""
        raise ValueError(f"{name}: expected contiguous{what} storage, got strides {list(t.stride())}")


def check_aligned(name: str, t: torch.Tensor, alignment: int = 16) -> None:
    """The data pointer must be a multiple of ``alignment`` bytes (skipped while tracing: fake
    tensors have no addresses)."""
    if addresses_known() and t.data_ptr() % alignment:
        raise ValueError(f"{name}: expected a {alignment}-byte aligned data pointer, got address {t.data_ptr():#x}")


def check_out(name: str, t: object, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A caller-owned output: a tensor of exactly ``shape``, ``dtype`` and ``device``."""
    check_tensor(name, t)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name}: expected a {str(dtype).removeprefix('torch.')} tensor of shape {list(shape)} on "
                         f"{device}, got {str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}")
    return t


def addresses_known() -> bool:
    """False while ``torch.compile`` traces with fake tensors (no data pointers to compare)."""
    return not torch.compiler.is_compiling()


def check_outputs_free(outputs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]) -> None:
    """Outputs written by the op: no element aliases another of the same output, and no output
    shares memory with an input or another output. Applied on every backend path."""
    for name, t in outputs.items():
        if t is not None:
            check_no_internal_overlap(name, t)
    if addresses_known():
        check_no_overlap(outputs, inputs)


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], what: str = "") -> None:
    """Check ``t.shape`` against ``expected``; ``None`` entries match any size."""
    shape = tuple(t.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {want}{extra}, got {list(shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors must live on one device; return it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name}: expected device {first.device} (the device of {first_name}), got {t.device}")
    return first.device


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """Half-open byte range ``[start, end)`` that ``t`` can touch in its storage."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    if t.is_contiguous():  # the common case, without a loop over the dims
        return (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        extent = (size - 1) * stride
        if extent < 0:
            lo += extent
        else:
            hi += extent
    item = t.element_size()
    return (t.data_ptr() + lo * item, t.data_ptr() + (hi + 1) * item)


def check_no_overlap(outputs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]) -> None:
    """No output may share memory with an input or with another output.

    The test is conservative: two tensors whose byte ranges intersect are
    rejected even if their strides would interleave without touching.
    """
    outs = [(n, t, memory_span(t)) for n, t in outputs.items() if t is not None]
    if not outs:
        return
    others = [(n, t, memory_span(t)) for n, t in inputs.items() if t is not None]
    for i, (oname, out, (o_lo, o_hi)) in enumerate(outs):
        for name, t, (lo, hi) in others + outs[i + 1 :]:
            if lo < o_hi and o_lo < hi and t.device == out.device:
                raise ValueError(
                    f"{oname}: must not overlap {name} in memory "
                    f"({oname} bytes [{o_lo:#x}, {o_hi:#x}), {name} bytes [{lo:#x}, {hi:#x}))"
                )


def check_no_internal_overlap(name: str, t: torch.Tensor) -> None:
    """Reject tensors in which two indices address the same element (e.g. expanded views)."""
    if t.is_contiguous():  # dense: every element has its own address
        return
    dims = sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    max_offset = 0  # largest offset reachable with the smaller-stride dims (a sufficient test)
    for stride, size in dims:
        if stride <= max_offset:
            raise ValueError(
                f"{name}: expected a tensor whose elements do not alias each other, "
                f"got shape {list(t.shape)} with strides {list(t.stride())}"
            )
        max_offset += (size - 1) * stride
