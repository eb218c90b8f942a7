"""Public API of the Engram gate.

Layers: the backends' launchers (``dsfuse.engram_gate.triton``, and ``dsfuse.engram_gate.cutedsl``
for ``backend="cutedsl"``, imported on first use), reached through the registry (``BACKENDS``); the
functional entry points
``engram_gate_forward`` / ``engram_gate_backward`` (caller-owned outputs, saved
state and workspace allowed); ``EngramGatePlan``, the prepared form that validates
and compiles once, then executes with no allocation, no JIT and no host synchronisation
(CUDA Graph capturable); ``engram_gate``, differentiable through the declared ops
(``dsfuse._common.declare_backend_ops``) ``dsfuse::engram_gate_fwd`` / ``dsfuse::engram_gate_bwd``
(Triton) and ``dsfuse::engram_gate_fwd_cutedsl`` / ``dsfuse::engram_gate_bwd_cutedsl`` (CuTe DSL), so
``torch.compile(fullgraph=True)`` traces either backend as opaque nodes.
"""

from __future__ import annotations

import torch

from dsfuse._common import BACKENDS as FUSED_BACKENDS
from dsfuse._common import (
    KERNEL_DTYPES, REFERENCE, check_aligned, check_contiguous, check_dtype, check_out, check_outputs_free,
    check_same_device, check_same_dtype, check_shape, check_tensor, check_tensors, declare_backend_ops, on_stream,
    register,
)
from dsfuse._common.plans import Plans
from dsfuse.engram_gate.reference import engram_gate_reference

__all__ = ["EngramGatePlan", "engram_gate", "engram_gate_backward", "engram_gate_forward"]

FUSED_DTYPES = KERNEL_DTYPES
BACKENDS = register("engram_gate")  # auto's order per GPU family: the backend packages' tables
# the public functions' verdicts (checks passed, backend chosen) by call signature
FORWARD_PLANS, GATE_PLANS = Plans(BACKENDS, "forward"), Plans(BACKENDS, "forward")


# -- validation ------------------------------------------------------------------------------


def _check_rows(name: str, t: torch.Tensor, dim: int) -> None:
    """[N, S, D] with contiguous rows (any row stride)."""
    if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != dim):
        raise ValueError(f"{name}: expected contiguous [S, D] rows (strides [*, {dim}, 1]), got strides "
                         f"{list(t.stride())}")


def _check_inputs(x, kv, weight, token_mask, eps, clamp) -> tuple[int, int, int]:
    check_tensors({"x": x, "kv": kv, "weight": weight, "token_mask": token_mask})
    check_tensors({"x": x}, ndim=3, layout="[N, S, D]")
    n, streams, dim = x.shape
    check_dtype("x", x, FUSED_DTYPES + (torch.float64,))
    check_shape("kv", kv, (n, (streams + 1) * dim), "S keys then one value per token")
    check_same_dtype("kv", kv, "x", x)
    if kv.stride(1) != 1:
        raise ValueError(f"kv: expected unit channel stride, got strides {list(kv.stride())}")
    check_dtype("weight", weight, (torch.float32,))
    check_shape("weight", weight, (streams, dim), "q_weight * k_weight per stream")
    if not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [S, D] tensor, got strides {list(weight.stride())}")
    check_dtype("token_mask", token_mask, (torch.bool,))
    check_shape("token_mask", token_mask, (n,))
    if token_mask.stride(0) != 1 and n > 1:
        raise ValueError(f"token_mask: expected a contiguous tensor, got stride {token_mask.stride(0)}")
    _check_rows("x", x, dim)
    check_same_device(x=x, kv=kv, weight=weight, token_mask=token_mask)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps: expected a float >= 0 (the model's rms_norm_eps), got {eps!r}")
    if not isinstance(clamp, (int, float)) or clamp <= 0:
        raise ValueError(f"clamp: expected a float > 0, got {clamp!r}")
    return n, streams, dim


def _check_out(name: str, t: torch.Tensor | None, shape, dtype, device, rows_dim: int | None = None) -> None:
    """A caller-owned tensor of the gate: ``[N, S, D]`` with contiguous rows (``rows_dim``) or contiguous."""
    if t is None:
        return
    check_out(name, t, shape, dtype, device)
    if rows_dim is not None:
        _check_rows(name, t, rows_dim)
    else:
        check_contiguous(name, t)


def _check_forward_outputs(x, kv, weight, token_mask, out, saved) -> None:
    n, streams, dim = x.shape
    _check_out("out", out, (n, streams, dim), x.dtype, x.device, rows_dim=dim)
    _check_out("saved", saved, (n, streams, 4), torch.float32, x.device)
    _check_outputs_free(x, kv, weight, token_mask, out, saved)


def _check_outputs_free(x, kv, weight, token_mask, out, saved) -> None:
    check_outputs_free({"out": out, "saved": saved}, {"x": x, "kv": kv, "weight": weight, "token_mask": token_mask})


def _check_backward_args(dout, x, kv, weight, token_mask, saved, dx, dkv, dweight, workspace,
                         workspace_elements) -> None:
    """Everything but the inputs (checked by ``_check_inputs``): gradients in, outputs, aliasing.
    ``workspace_elements``: the sizing of the backend that runs the call."""
    n, streams, dim = x.shape
    check_tensor("dout", dout)
    _check_out("dout", dout, (n, streams, dim), x.dtype, x.device, rows_dim=dim)
    check_tensor("saved", saved)
    _check_out("saved", saved, (n, streams, 4), torch.float32, x.device)
    _check_out("dx", dx, (n, streams, dim), x.dtype, x.device, rows_dim=dim)
    _check_out("dkv", dkv, tuple(kv.shape), kv.dtype, x.device)
    _check_out("dweight", dweight, (streams, dim), torch.float32, x.device)
    if workspace is not None:
        need = workspace_elements(n, streams, dim)
        check_tensor("workspace", workspace)
        if workspace.dtype != torch.float32 or workspace.numel() < need or not workspace.is_contiguous() \
                or workspace.device != x.device:
            raise ValueError(f"workspace: expected a contiguous fp32 tensor of at least {need} elements on "
                             f"{x.device}, got {workspace.dtype} with {workspace.numel()} on {workspace.device}")
    check_outputs_free({"dx": dx, "dkv": dkv, "dweight": dweight, "workspace": workspace},
                       {"dout": dout, "x": x, "kv": kv, "weight": weight, "token_mask": token_mask, "saved": saved})


# -- functional ------------------------------------------------------------------------------


def _choose_forward(x, kv, weight, token_mask, eps, clamp, backend, outputs: tuple = ()) -> str:
    """The forward's checks that its signature decides (``outputs``: ``(out, saved)`` of the
    functional forward), and the backend chosen for it."""
    _check_inputs(x, kv, weight, token_mask, eps, clamp)
    if outputs:
        _check_forward_outputs(x, kv, weight, token_mask, *outputs)
    return BACKENDS.choose(backend, x.device, x.dtype, call="forward", args=(x, kv, weight, token_mask, *outputs))


def engram_gate_forward(
    x: torch.Tensor,
    kv: torch.Tensor,
    weight: torch.Tensor,
    token_mask: torch.Tensor,
    *,
    eps: float,
    clamp: float = 1e-6,
    out: torch.Tensor | None = None,
    saved: torch.Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate forward: residual output and the caller-owned saved state.

    Args:
        x: ``[N, S, D]`` residual streams (bf16 in the model), contiguous ``[S, D]`` rows.
        kv: ``[N, (S + 1) * D]`` projection output: S keys then the shared value, unit channel stride.
        weight: fp32 ``[S, D]``, the model's ``q_weight * k_weight``.
        token_mask: bool ``[N]``: False for image tokens and padding (their gate is 0).
        eps: the model's ``rms_norm_eps`` (1e-20 in the released config).
        clamp: lower bound of ``|dot|`` under the signed square root.
        out: caller-owned ``[N, S, D]`` output in ``x``'s dtype (contiguous rows).
        saved: caller-owned fp32 ``[N, S, 4]`` (gate, dot, rx, rk), contiguous. The
            backward reads it; the caller keeps it alive until then.
        stream: CUDA stream to run on (default: the current stream).
        backend: ``"auto"``, ``"triton"``, ``"cutedsl"`` or ``"reference"``. ``"cutedsl"`` (by
            name only; ``auto`` takes Triton) asks in addition ``D`` a multiple of ``16 / itemsize``
            channels and 16-byte aligned data pointers and row strides.

    Returns:
        The pair ``(out, saved)``, within the tolerances on the op's page of the fp64
            reference; masked tokens' output equals ``x`` exactly.

    Examples:
        The forward of one layer's gate, then its backward from the saved state:

        ```python
        import torch
        from dsfuse.engram_gate import engram_gate_backward, engram_gate_forward

        device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the reference
        bf16 = dict(device=device, dtype=torch.bfloat16)
        x = torch.randn(64, 4, 5120, **bf16)             # [N, S, D]
        kv = torch.randn(64, 5 * 5120, **bf16)           # [N, (S + 1) D]
        weight = torch.randn(4, 5120, device=device)     # fp32 [S, D]
        token_mask = torch.ones(64, dtype=torch.bool, device=device)
        out, saved = engram_gate_forward(x, kv, weight, token_mask, eps=1e-20)
        dout = torch.randn_like(out)
        dx, dkv, dweight = engram_gate_backward(
            dout, x, kv, weight, token_mask, saved, eps=1e-20
        )
        ```
    """
    which = FORWARD_PLANS.backend(FORWARD_PLANS.key(backend, x, kv, weight, token_mask, eps, clamp, out, saved),
                                  lambda: _choose_forward(x, kv, weight, token_mask, eps, clamp, backend, (out, saved)),
                                  lambda: _check_outputs_free(x, kv, weight, token_mask, out, saved))
    n, streams = x.shape[0], x.shape[1]
    with on_stream(stream, x.device):
        if which == REFERENCE:
            ref_out, ref_saved = engram_gate_reference(x, kv, weight, token_mask, eps=eps, clamp=clamp)
            return ((ref_out if out is None else out.copy_(ref_out)),
                    (ref_saved if saved is None else saved.copy_(ref_saved)))
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
        saved = torch.empty((n, streams, 4), dtype=torch.float32, device=x.device) if saved is None else saved
        BACKENDS.load(which)["forward"](x, kv, weight, token_mask, out, saved, eps=eps, clamp=clamp)
        return out, saved


def engram_gate_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    kv: torch.Tensor,
    weight: torch.Tensor,
    token_mask: torch.Tensor,
    saved: torch.Tensor,
    *,
    eps: float,
    clamp: float = 1e-6,
    dx: torch.Tensor | None = None,
    dkv: torch.Tensor | None = None,
    dweight: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate backward from the saved state: ``dx``, packed ``dkv`` and a deterministic ``dweight``.

    Args:
        dout: ``[N, S, D]`` gradient of the output, dtype of ``x``, contiguous rows.
        x: the forward's ``x``.
        kv: the forward's ``kv``.
        weight: the forward's ``weight``.
        token_mask: the forward's ``token_mask``.
        saved: fp32 ``[N, S, 4]`` written by the forward on these inputs.
        eps: the forward's ``eps`` (the reference backend recomputes with it).
        clamp: the forward's clamp.
        dx: caller-owned ``[N, S, D]`` in ``x``'s dtype.
        dkv: caller-owned ``[N, (S + 1) * D]`` in ``kv``'s dtype: the S key gradients then
            the value gradient, ready for the ``wkv`` weight- and input-gradient GEMMs.
        dweight: caller-owned fp32 ``[S, D]``, summed over tokens in a fixed order.
        workspace: fp32 contiguous, at least ``workspace_elements(N, S, D)`` elements of the
            backend that runs the call (``dsfuse.engram_gate.triton``, or
            ``dsfuse.engram_gate.cutedsl`` for ``backend="cutedsl"``; allocated when omitted;
            overwritten).
        stream: CUDA stream to run on.
        backend: ``"auto"``, ``"triton"``, ``"cutedsl"`` or ``"reference"`` (see
            ``engram_gate_forward``). The saved state of either fused backend's forward serves
            either backward.

    Returns:
        The triple ``(dx, dkv, dweight)``; repeated calls on the same inputs are bitwise equal.
    """
    n, streams, dim = _check_inputs(x, kv, weight, token_mask, eps, clamp)
    # the workspace is sized by the backend asked for (validated before the choice, like the rest); auto,
    # the reference or a backend not installed: the op's first backend
    asked = backend if backend in BACKENDS.kernels and FUSED_BACKENDS[backend].installed else BACKENDS.first
    sizing = BACKENDS.load(asked)["workspace_elements"]
    _check_backward_args(dout, x, kv, weight, token_mask, saved, dx, dkv, dweight, workspace, sizing)
    which = BACKENDS.choose(backend, x.device, x.dtype, call="backward",
                            args=(dout, x, kv, weight, saved, dx, dkv, dweight, workspace))
    with on_stream(stream, x.device):
        if which == REFERENCE:
            grads = _reference_backward(dout, x, kv, weight, token_mask, eps, clamp)
            return tuple(g if o is None else o.copy_(g) for g, o in zip(grads, (dx, dkv, dweight)))
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if dx is None else dx
        dkv = torch.empty(kv.shape, dtype=kv.dtype, device=x.device) if dkv is None else dkv
        dweight = torch.empty((streams, dim), dtype=torch.float32, device=x.device) if dweight is None else dweight
        sizing = BACKENDS.load(which)["workspace_elements"]  # the backend chosen (auto may pick another)
        if workspace is None:
            workspace = torch.empty(sizing(n, streams, dim), dtype=torch.float32, device=x.device)
        elif workspace.numel() < sizing(n, streams, dim):
            raise ValueError(f"workspace: expected at least {sizing(n, streams, dim)} fp32 elements for the {which} "
                             f"backend, got {workspace.numel()}")
        BACKENDS.load(which)["backward"](dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=clamp)
        return dx, dkv, dweight


def _reference_backward(dout, x, kv, weight, token_mask, eps, clamp):
    """The model's own backward: autograd of the fp32 reference."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (x, kv, weight)]
        out, _ = engram_gate_reference(*leaves, token_mask, eps=eps, clamp=clamp)
        return torch.autograd.grad(out, leaves, dout)


# -- prepared plan ---------------------------------------------------------------------------


def _metadata(tensors: tuple) -> tuple | None:
    """All that a plan's checks read of one call's tensors: address, sizes, strides, dtype, device
    (``None`` where one is not a tensor with an address, e.g. while torch.compile traces: checked)."""
    try:
        return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in tensors)
    except (AttributeError, RuntimeError, TypeError, NotImplementedError):
        return None


class EngramGatePlan:
    """Validated, compiled Engram gate for a fixed geometry; executes without allocating.

    ``EngramGatePlan(streams=4, dim=5120, max_tokens=8192, device="cuda", eps=1e-20)``
    compiles both directions (one warm-up launch each), allocates the backward
    workspace for ``max_tokens``, and binds to ``device``. ``forward`` and
    ``backward`` then check only tensor metadata (shapes, dtypes, strides, devices,
    aliasing: no host synchronisation), allocate nothing and compile nothing, so they
    can be captured in a CUDA Graph. A call whose tensors have the addresses, sizes,
    strides, dtypes and devices of the previous call's in the same direction is not
    checked again (a loop that reuses its buffers pays for the checks once). Outputs,
    saved state and the stream are the caller's; pass a different ``saved`` buffer to
    any call (rebinding).

    Args:
        streams: ``S``, the number of residual streams.
        dim: ``D``, the width of a stream.
        max_tokens: the largest ``N`` the plan executes (sizes the backward workspace).
        device (torch.device | str): the CUDA device the plan binds to (``"cuda"``: the
            current one).
        eps: the model's ``rms_norm_eps`` (1e-20 in the released config).
        clamp: lower bound of ``|dot|`` under the signed square root.
        dtype: the dtype of ``x``, ``kv`` and their gradients (bf16, fp16 or fp32).
        backend: a fused backend, ``"triton"`` or ``"cutedsl"`` (default ``None``: the op's first,
            Triton): the kernels the plan compiles at construction and runs (``"cutedsl"`` also
            checks the 128-bit layout of every call's tensors: 16-byte aligned data pointers and
            row strides).

    Examples:
        One training step's gate captured in a CUDA Graph and replayed on new inputs
        written into the same buffers:

        ```python
        # needs CUDA (a CUDA Graph)
        import torch
        from dsfuse.engram_gate import EngramGatePlan

        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        x, kv = torch.randn(4096, 4, 5120, **bf16), torch.randn(4096, 5 * 5120, **bf16)
        weight = torch.randn(4, 5120, device="cuda")
        token_mask = torch.ones(4096, dtype=torch.bool, device="cuda")
        dout = torch.randn_like(x)
        plan = EngramGatePlan(
            streams=4, dim=5120, max_tokens=8192, device="cuda", eps=1e-20
        )
        out = torch.empty_like(x)
        saved = torch.empty(x.shape[0], 4, 4, device="cuda")  # fp32
        dx, dkv, dweight = (torch.empty_like(t) for t in (x, kv, weight))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan.forward(x, kv, weight, token_mask, out, saved)
            plan.backward(dout, x, kv, weight, token_mask, saved, dx, dkv, dweight)
        graph.replay()
        ```
    """

    def __init__(self, *, streams: int = 4, dim: int = 5120, max_tokens: int, device, eps: float,
                 clamp: float = 1e-6, dtype: torch.dtype = torch.bfloat16, backend: str | None = None):
        self.streams, self.dim, self.max_tokens = streams, dim, max_tokens
        # the device with its index ("cuda" -> "cuda:0"), as tensors report theirs
        self.device = torch.empty(0, device=device).device
        self.dtype, self.eps, self.clamp = dtype, float(eps), float(clamp)
        if max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {max_tokens}")
        if dtype not in FUSED_DTYPES:
            raise TypeError(f"dtype: expected one of bf16, fp16, fp32, got {dtype}")
        backend = BACKENDS.first if backend is None else backend
        if backend not in BACKENDS.kernels:
            names = " or ".join(repr(name) for name in BACKENDS.kernels)
            raise ValueError(f"backend: expected {names} for a plan, got {backend!r}")
        self.backend = backend
        title = FUSED_BACKENDS[backend].title
        if reasons := FUSED_BACKENDS[backend].reasons_against(self.device):
            raise ValueError(f"device: the plan runs the {title} kernels: {'; '.join(reasons)}")
        warm_up = self._warm_up_inputs()
        if reasons := BACKENDS.own_reasons(backend, "backward", warm_up["backward"]):
            raise ValueError(f"dim: the plan runs the {title} kernels: {'; '.join(reasons)}")
        kernels = BACKENDS.load(backend)
        self._launch_forward, self._launch_backward = kernels["forward"], kernels["backward"]
        self._workspace_elements = kernels["workspace_elements"]
        self.workspace = torch.empty(self._workspace_elements(max_tokens, streams, dim), dtype=torch.float32,
                                     device=self.device)
        self._checked = {"forward": None, "backward": None}  # the metadata of each direction's last checked call
        self._warm_up()

    def _warm_up_inputs(self) -> dict:
        """A 2-token problem of the plan's geometry: the arguments of each direction's launch but the
        workspace (``backward``: without it)."""
        s, d, dev = self.streams, self.dim, self.device
        x = torch.zeros(2, s, d, dtype=self.dtype, device=dev)
        kv = torch.zeros(2, (s + 1) * d, dtype=self.dtype, device=dev)
        w = torch.zeros(s, d, dtype=torch.float32, device=dev)
        mask = torch.ones(2, dtype=torch.bool, device=dev)
        out, saved = torch.empty_like(x), torch.empty(2, s, 4, device=dev)
        return {"forward": (x, kv, w, mask, out, saved),
                "backward": (x, x, kv, w, saved, out, torch.empty_like(kv), torch.empty(s, d, device=dev))}

    def _warm_up(self) -> None:
        """One launch of each kernel on a 2-token problem: compiles what execution will run."""
        inputs = self._warm_up_inputs()
        self._launch_forward(*inputs["forward"], eps=self.eps, clamp=self.clamp)
        self._launch_backward(*inputs["backward"], self.workspace, clamp=self.clamp)

    def _check(self, call: str, args: tuple, x, kv, weight, token_mask, **tensors) -> int:
        """Metadata checks of one execution (no synchronisation) of ``call`` with the launch arguments
        ``args``; returns N."""
        n = x.shape[0] if isinstance(x, torch.Tensor) else 0
        tensors = dict(x=x, kv=kv, weight=weight, token_mask=token_mask) | tensors
        if not 1 <= n <= self.max_tokens:
            raise ValueError(f"x: expected 1 <= N <= max_tokens = {self.max_tokens}, got N = {n}")
        for name, t in tensors.items():
            check_tensor(name, t)
            if t.device != self.device:
                raise ValueError(f"{name}: expected device {self.device} (the plan's), got {t.device}")
            check_aligned(name, t)  # another alignment would be another compiled specialisation
        _check_inputs(x, kv, weight, token_mask, self.eps, self.clamp)
        if reasons := BACKENDS.own_reasons(self.backend, call, args):
            raise ValueError(f"the plan runs the {FUSED_BACKENDS[self.backend].title} kernels: " + "; ".join(reasons))
        if x.dtype != self.dtype or tuple(x.shape[1:]) != (self.streams, self.dim):
            raise ValueError(f"x: expected {self.dtype} [N, {self.streams}, {self.dim}] (the plan's), got "
                             f"{x.dtype} {list(x.shape)}")
        return n

    def forward(self, x, kv, weight, token_mask, out, saved, stream: torch.cuda.Stream | None = None):
        """Run the gate forward into caller-owned ``out`` and ``saved``.

        Args:
            x (torch.Tensor): ``[N, S, D]`` in the plan's dtype, ``1 <= N <= max_tokens``,
                contiguous ``[S, D]`` rows.
            kv (torch.Tensor): ``[N, (S + 1) * D]``: S keys then the shared value, unit
                channel stride.
            weight (torch.Tensor): fp32 ``[S, D]``, contiguous.
            token_mask (torch.Tensor): bool ``[N]``, contiguous.
            out (torch.Tensor): ``[N, S, D]`` in ``x``'s dtype (contiguous rows), written.
            saved (torch.Tensor): fp32 ``[N, S, 4]`` (gate, dot, rx, rk), contiguous,
                written; the backward reads it.
            stream: CUDA stream to run on (default: the current stream).

        Returns:
            (tuple[torch.Tensor, torch.Tensor]): The pair ``(out, saved)``, the tensors passed in.
        """
        seen = _metadata((x, kv, weight, token_mask, out, saved))
        if seen is None or seen != self._checked["forward"]:
            self._check("forward", (x, kv, weight, token_mask, out, saved), x, kv, weight, token_mask, out=out,
                        saved=saved)
            _check_forward_outputs(x, kv, weight, token_mask, out, saved)
            self._checked["forward"] = seen
        with on_stream(stream, self.device):
            self._launch_forward(x, kv, weight, token_mask, out, saved, eps=self.eps, clamp=self.clamp)
        return out, saved

    def backward(self, dout, x, kv, weight, token_mask, saved, dx, dkv, dweight,
                 stream: torch.cuda.Stream | None = None):
        """Run the gate backward from ``saved`` into caller-owned gradients, in the plan's workspace.

        Args:
            dout (torch.Tensor): ``[N, S, D]`` gradient of ``out``, dtype of ``x``,
                contiguous rows.
            x (torch.Tensor): the forward's ``x``.
            kv (torch.Tensor): the forward's ``kv``.
            weight (torch.Tensor): the forward's ``weight``.
            token_mask (torch.Tensor): the forward's ``token_mask``.
            saved (torch.Tensor): fp32 ``[N, S, 4]`` written by the forward on these inputs.
            dx (torch.Tensor): ``[N, S, D]`` in ``x``'s dtype, written.
            dkv (torch.Tensor): ``[N, (S + 1) * D]`` in ``kv``'s dtype, written: the S key
                gradients then the value gradient.
            dweight (torch.Tensor): fp32 ``[S, D]``, written (summed over tokens in a fixed
                order).
            stream: CUDA stream to run on (default: the current stream).

        Returns:
            (tuple[torch.Tensor, torch.Tensor, torch.Tensor]): The triple ``(dx, dkv, dweight)``,
                the tensors passed in; bitwise reproducible.
        """
        seen = _metadata((dout, x, kv, weight, token_mask, saved, dx, dkv, dweight))
        if seen is None or seen != self._checked["backward"]:
            self._check("backward", (dout, x, kv, weight, saved, dx, dkv, dweight, self.workspace), x, kv, weight,
                        token_mask, dout=dout, saved=saved, dx=dx, dkv=dkv, dweight=dweight)
            _check_backward_args(dout, x, kv, weight, token_mask, saved, dx, dkv, dweight, self.workspace,
                                 self._workspace_elements)
            self._checked["backward"] = seen
        with on_stream(stream, self.device):
            self._launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, self.workspace, clamp=self.clamp)
        return dx, dkv, dweight


# -- differentiable --------------------------------------------------------------------------


def _backward(backend: str):
    def _backward(dout: torch.Tensor, x: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor,
                  clamp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Launch on the inputs of a validated forward into new gradients and workspace."""
        n, streams, dim = x.shape
        kernels = BACKENDS.load(backend)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dkv = torch.empty(kv.shape, dtype=kv.dtype, device=x.device)
        dweight = torch.empty((streams, dim), dtype=torch.float32, device=x.device)
        workspace = torch.empty(kernels["workspace_elements"](n, streams, dim), dtype=torch.float32, device=x.device)
        BACKENDS.check_at_run_time(backend, "backward", (dout, x, kv, weight, saved))
        kernels["backward"](dout, x, kv, weight, saved, dx, dkv, dweight, workspace, clamp=clamp)
        return dx, dkv, dweight

    return _backward


backward_ops = declare_backend_ops(BACKENDS, "engram_gate_bwd", "backward", _backward,
                                   fake=lambda dout, x, kv, weight, saved, clamp: (
                                       torch.empty_like(x), torch.empty_like(kv), weight.new_empty(weight.shape)))


def _save(ctx, inputs, output):
    x, kv, weight, _, _, clamp = inputs
    ctx.save_for_backward(x, kv, weight, output[1])
    ctx.clamp = clamp


def _forward(backend: str):
    def _forward(x: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, token_mask: torch.Tensor, eps: float,
                 clamp: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch on validated inputs into new ``out`` and ``saved``."""
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        saved = torch.empty((x.shape[0], x.shape[1], 4), dtype=torch.float32, device=x.device)
        # here, not in engram_gate: under torch.compile only the op sees addresses
        BACKENDS.check_at_run_time(backend, "forward", (x, kv, weight, token_mask))
        BACKENDS.load(backend)["forward"](x, kv, weight, token_mask, out, saved, eps=eps, clamp=clamp)
        return out, saved

    def _forward_grad(ctx, dout, dsaved):
        """``x``, ``kv`` and ``weight`` get gradients from the saved state; the mask and ``saved`` do not."""
        x, kv, weight, saved = ctx.saved_tensors
        return backward_ops[backend](dout.contiguous(), x, kv, weight, saved, ctx.clamp)

    return _forward, {"backward": _forward_grad}


forward_ops = declare_backend_ops(BACKENDS, "engram_gate_fwd", "forward", _forward, setup=_save,
                                  non_differentiable=(1,), fake=lambda x, kv, weight, token_mask, eps, clamp: (
                                      torch.empty_like(x), x.new_empty((x.shape[0], x.shape[1], 4),
                                                                       dtype=torch.float32)))


def engram_gate(x: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, token_mask: torch.Tensor, *, eps: float,
                clamp: float = 1e-6, backend: str = "auto") -> torch.Tensor:
    """Differentiable gate: ``out`` ``[N, S, D]``; autograd runs the fused backward from the saved state.

    The arguments are those of [engram_gate_forward][dsfuse.engram_gate.engram_gate_forward];
    ``x``, ``kv`` and ``weight`` get gradients, ``token_mask`` does not. The backward runs on the
    forward's backend; both fused backends trace under ``torch.compile(fullgraph=True)`` as
    custom ops.

    Examples:
        ```python
        import torch
        from dsfuse.engram_gate import engram_gate

        device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the reference
        bf16 = dict(device=device, dtype=torch.bfloat16, requires_grad=True)
        x, kv = torch.randn(64, 4, 5120, **bf16), torch.randn(64, 5 * 5120, **bf16)
        weight = torch.randn(4, 5120, device=device, requires_grad=True)
        token_mask = torch.ones(64, dtype=torch.bool, device=device)
        out = engram_gate(x, kv, weight, token_mask, eps=1e-20)
        out.backward(torch.randn_like(out))  # x.grad, kv.grad (packed like kv), weight.grad
        ```
    """
    which = GATE_PLANS.backend(GATE_PLANS.key(backend, x, kv, weight, token_mask, eps, clamp),
                               lambda: _choose_forward(x, kv, weight, token_mask, eps, clamp, backend))
    if which == REFERENCE:
        return engram_gate_reference(x, kv, weight, token_mask, eps=eps, clamp=clamp)[0]
    return forward_ops[which](x, kv, weight, token_mask, float(eps), float(clamp))[0]
