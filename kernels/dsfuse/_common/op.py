"""One declaration per kernel-backed op: custom op, fake, autograd formula and eager fast path.

An op module writes its launch once, as a plain function with type annotations, and
declares it::

    rope = declare_op("text_rope", _rope_alloc, fake=..., setup=_save, backward=_grad)

The declaration makes

* a ``torch.library`` custom op ``dsfuse::<name>`` (schema from the annotations) with
  its fake (shape/dtype propagation) and, when ``backward`` is given, its autograd
  formula: what ``torch.compile(fullgraph=True)`` traces as one opaque node;
* an ``autograd.Function`` built from the same ``setup``/``backward`` pair for eager
  calls, which skip the dispatcher (tens of microseconds of host time per call);
* a call, ``rope(*args)``, that takes the custom op while ``torch.compile`` traces, the
  ``autograd.Function`` when a tensor argument requires grad under grad mode, and the
  plain launch otherwise.

``setup(ctx, inputs, output)`` and ``backward(ctx, *grads)`` follow
``torch.library.register_autograd``, except that ``backward`` returns the gradients of
the leading inputs only (the declaration pads the rest with ``None``); a backward that calls declared ops gets the eager
fast path eagerly and the custom ops under compilation, with one formula for both.
Ops that write into arguments name them in ``mutates`` (their custom op returns
nothing; the eager call returns what the launch returns); ``dirty`` names an argument
that a differentiable in-place op rewrites (eager autograd only: custom ops cannot
return an alias of an input). ``views(*args)`` gives extra outputs that are views of the
inputs (e.g. the v part of a packed qkv row): eagerly the ``autograd.Function`` returns
them and hands their gradients to ``backward``; under compilation they are plain views
outside the custom op, their gradients flow through torch's own view backward, and
``backward`` receives ``None`` for them. ``aliasing(*args)`` returns the ``(outputs,
inputs)`` dicts of [`check_outputs_free`][dsfuse._common.validation.check_outputs_free] for an op that
writes into arguments: the custom op checks them at run time (tracing has no addresses;
eager calls were validated before the launch, and launchers never check).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor


class DeclaredOp:
    """A declared op; call it like the launch function it wraps (positional arguments)."""

    def __init__(self, name: str, launch: Callable, *, fake: Callable | None = None, mutates: Sequence[str] = (),
                 setup: Callable | None = None, backward: Callable | None = None, dirty: str | None = None,
                 non_differentiable: Sequence[int] = (), views: Callable | None = None,
                 aliasing: Callable | None = None):
        if (setup is None) != (backward is None):
            raise ValueError(f"{name}: setup and backward come together")
        self.name = f"dsfuse::{name}"
        self.launch = launch
        self._untraceable_grad = bool(mutates) and backward is not None
        self.views = views
        params = list(inspect.signature(launch).parameters)
        dirty_index = params.index(dirty) if dirty is not None else None
        impl = _checking(launch, aliasing) if aliasing is not None else launch
        self.custom_op = torch.library.custom_op(self.name, _returning_none(impl) if mutates else impl,
                                                 mutates_args=tuple(mutates))
        if fake is not None:
            self.custom_op.register_fake(fake)
        self.function = None
        if backward is not None:
            backward = _padded(backward, len(params))
            if not mutates:
                self.custom_op.register_autograd(backward, setup_context=setup)
            self.function = _autograd_function(name, self._eager, setup, backward, dirty_index,
                                               tuple(non_differentiable))

    def _eager(self, *args):
        return self.launch(*args) if self.views is None else (*self.launch(*args), *self.views(*args))

    def __call__(self, *args):
        if _tracing(args):
            if self._untraceable_grad and torch.is_grad_enabled() and any(
                    isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                raise RuntimeError(f"{self.name}: writes into its arguments, so torch.compile cannot carry its "
                                   "gradient formula; call it eagerly or without autograd")
            out = self.custom_op(*args)
            return out if self.views is None else (*out, *self.views(*args))
        if self.function is not None and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self.function.apply(*args)
        return self._eager(*args)

    def __repr__(self) -> str:
        return f"DeclaredOp({self.name})"


_UNTRACED = frozenset({torch.Tensor, torch.nn.Parameter, bool, int, float, str, type(None)})  # skip isinstance


def _tracing(args) -> bool:
    """True while torch.compile traces: dynamo, or AOT autograd tracing a backward formula with
    fake/functional tensors (where ``is_compiling()`` is False): the custom op must be called."""
    return torch.compiler.is_compiling() or any(
        type(a) not in _UNTRACED and isinstance(a, (FakeTensor, FunctionalTensor)) for a in args)


def tracing(*args) -> bool:
    """True while torch.compile traces these arguments (see `_tracing`): no data, no addresses."""
    return _tracing(args)


def declare_op(name: str, launch: Callable, **kwargs) -> DeclaredOp:
    """Declare ``launch`` as the op ``dsfuse::<name>`` (see the module docstring)."""
    return DeclaredOp(name, launch, **kwargs)


def declare_backend_ops(entry, name: str, call: str, build: Callable[[str], Callable | tuple[Callable, dict]],
                        **kwargs) -> dict[str, DeclaredOp]:
    """One declared op per fused backend of ``entry`` (an op's
    [`OpBackends`][dsfuse._common.backends.OpBackends]) that serves ``call``: ``dsfuse::<name>`` for
    the op's first backend, ``dsfuse::<name>_<backend>`` for every other (its twin, so that
    ``backend="<backend>"`` traces under ``torch.compile(fullgraph=True)`` too).

    ``build(backend)`` gives that backend's launch function (annotated: its schema), or
    ``(launch, options)`` with keyword arguments of ``declare_op`` that depend on the backend (e.g.
    a ``backward`` that calls the backend's own backward op); ``kwargs`` are those of every
    backend. Returns ``{backend: op}``."""
    ops = {}
    for backend in entry.serving(call):
        built = build(backend)
        launch, options = built if isinstance(built, tuple) else (built, {})
        suffix = "" if backend == entry.first else f"_{backend}"
        ops[backend] = DeclaredOp(f"{name}{suffix}", launch, **kwargs, **options)
    return ops


def _padded(backward: Callable, n_inputs: int) -> Callable:
    """A formula returns the gradients of the leading inputs; the rest (flags, shapes) get None."""

    def run(ctx, *grads):
        result = backward(ctx, *grads)
        if not isinstance(result, tuple) or len(result) > n_inputs:
            raise TypeError(f"a backward formula returns a tuple of at most {n_inputs} gradients, got {type(result)}")
        return (*result, *(None,) * (n_inputs - len(result)))

    return run


def _checking(launch: Callable, aliasing: Callable) -> Callable:
    """The launch with the aliasing check of its written arguments, for the custom op: while
    torch.compile traces, validation sees fake tensors without addresses, so the check runs here,
    on the real tensors. Eager calls were checked by the public function's validation."""
    from dsfuse._common.validation import check_outputs_free

    def run(*args):
        check_outputs_free(*aliasing(*args))
        return launch(*args)

    return _shaped_like(run, launch)


def _returning_none(launch: Callable) -> Callable:
    """The launch as a mutating custom op sees it: same parameters, no result."""

    def run(*args):
        launch(*args)

    return _shaped_like(run, launch, returns_none=True)


def _shaped_like(run: Callable, launch: Callable, returns_none: bool = False) -> Callable:
    """Give ``run`` the name, parameters and annotations of ``launch`` (torch infers the schema from them)."""
    sig = inspect.signature(launch)
    run.__signature__ = sig.replace(return_annotation=None) if returns_none else sig
    run.__annotations__ = {**launch.__annotations__, **({"return": None} if returns_none else {})}
    run.__name__ = launch.__name__
    return run


def _autograd_function(name, launch, setup, backward, dirty, non_differentiable):
    """The eager twin of the custom op's autograd registration."""

    def forward(ctx, *args):
        output = launch(*args)
        if dirty is not None:
            ctx.mark_dirty(args[dirty])
        setup(ctx, args, output)
        if non_differentiable:
            ctx.mark_non_differentiable(*(output[i] for i in non_differentiable))
        return output

    return type(f"{name}_function", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})
