"""Verdicts of a public function's checks and backend choice, reused by the call's signature.

A public function validates its arguments and chooses a backend; both read only what the
signature holds: per tensor (a plain tensor or parameter) its dtype, shape, strides, device, ``requires_grad`` and data
pointer modulo 16; the other arguments as given (flags, ``backend``); grad mode and whether Triton
runs in its interpreter (``TRITON_INTERPRET``, which the backends' reasons read). The first call
of a signature runs the full path and stores its verdict (e.g. the chosen backend); later calls
with the same signature reuse it and run only the checks that read more than the signature
(overlap of outputs with inputs, which reads addresses). While ``torch.compile`` traces there is
no signature (fake tensors have no addresses), and an argument that is not what the signature
expects (a fake tensor, a list, a stream) gives none either: such calls take the full path, whose
checks raise the usual errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsfuse._common.backends import interpreting
from dsfuse._common.launch import CACHE_LIMIT

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_KEYED = _PLAIN | {bool, int, float, str, type(None)}


class Plans:
    """One public function's verdicts by signature (see the module docstring): the backend that
    serves ``call`` of the op whose registry is ``backends``."""

    def __init__(self, backends=None, call: str | None = None) -> None:
        self._verdicts: dict[tuple, Any] = {}
        self._backends, self._call = backends, call

    def backend(self, key: tuple | None, decide: Callable[[], str], recheck: Callable[[], None] | None = None) -> str:
        """The backend for this call. A signature seen before: the backend chosen for its first
        call (logged as reused), after ``recheck()``, the checks that read more than the signature
        (addresses). Else ``decide()``: the full path (every check, then the choice), whose result
        is kept for later calls."""
        found = self.get(key)
        if found is None:
            return self.put(key, decide())
        if recheck is not None:
            recheck()
        return self._backends.reused(found, self._call) if self._backends is not None else found

    def key(self, *args: Any) -> tuple | None:
        """The call's signature, or ``None`` where there is none (tracing, an unexpected argument)."""
        if torch.compiler.is_compiling():
            return None
        if not _KEYED.issuperset(map(type, args)):  # a fake tensor (no address), a list, a stream, ...
            return None
        return (torch.is_grad_enabled(), interpreting(), *[
            (a.dtype, a.shape, a.stride(), a.device, a.requires_grad, a.data_ptr() % 16) if type(a) in _PLAIN else a
            for a in args])

    def get(self, key: tuple | None) -> Any:
        """The verdict stored for ``key`` (``None``: run the full path)."""
        return None if key is None else self._verdicts.get(key)

    def put(self, key: tuple | None, verdict: Any) -> Any:
        """Store ``verdict`` (not ``None``) for ``key``; return it."""
        if key is not None:
            if len(self._verdicts) >= CACHE_LIMIT:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict
