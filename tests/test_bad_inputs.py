"""Every op refuses a bad argument the same way on every backend path.

Each case builds fresh, otherwise valid CPU inputs, breaks one thing and calls the public
entry point with ``backend`` = ``"reference"``, every fused backend of the op that runs on the CPU
(from the registry: Triton, in its interpreter) and ``"auto"``. The exception type and message must
be the same for all: validation runs before the backend is chosen, so whichever backend would serve
the call, it is refused alike. (A backend that runs on CUDA only meets these refusals in its op's
folder, ``tests/<op>/``, whose bad-input tests take the ``backend`` fixture on the GPU too.)
"""

import re

import pytest
import torch
from conftest import registry, runs_on_cpu

from dsfuse.engram_gate import engram_gate, engram_gate_backward, engram_gate_forward
from dsfuse.gdn import chunk_gdn
from dsfuse.text_rope import apply_rope
from dsfuse.vision_rope import vision_cos_sin, vision_rope_attention_front, vision_rope_backward

PREFIX_OP = {"rope": "text_rope", "vision": "vision_rope", "front": "vision_rope", "gate": "engram_gate",
             "gdn": "gdn"}  # a case name's first word -> its op


def backends(name: str) -> tuple[str, ...]:
    """The paths a case is refused on: the reference, each fused backend of its op that runs on the
    CPU, and auto."""
    fused = [t.backend for t in registry(PREFIX_OP[name.split()[0]]).tables if runs_on_cpu(t.backend)]
    return ("reference", *fused, "auto")


def _rope(**change):
    gen = torch.Generator().manual_seed(0)
    args = dict(values=torch.randn(2, 5, 3, 16, generator=gen), angles=torch.randn(2, 5, 4, generator=gen))
    args |= {k: v(args) if callable(v) else v for k, v in change.items()}
    return lambda backend, a=args: apply_rope(backend=backend, **a)


def _vision_bwd(**change):
    h, t, d = 2, 9, 8
    gen = torch.Generator().manual_seed(1)
    cos, sin = vision_cos_sin(t, 1, d // 2)
    args = dict(dq_htd=torch.randn(h, t, d, generator=gen), dk_hdt=torch.randn(h, d, t, generator=gen),
                dv_htd=torch.randn(h, t, d, generator=gen), cos=cos, sin=sin)
    args |= {k: v(args) if callable(v) else v for k, v in change.items()}
    return lambda backend, a=args: vision_rope_backward(backend=backend, **a)


def _vision_front(**change):
    h, t, d = 2, 9, 8
    cos, sin = vision_cos_sin(t, 1, d // 2)
    args = dict(qkv=torch.randn(t, 3 * h * d, generator=torch.Generator().manual_seed(2)), cos=cos, sin=sin, heads=h)
    args |= {k: v(args) if callable(v) else v for k, v in change.items()}
    return lambda backend: vision_rope_attention_front(args["qkv"], args["cos"], args["sin"], args["heads"],
                                                       backend=backend)


def _gate_inputs():
    n, s, d = 6, 4, 32
    gen = torch.Generator().manual_seed(3)
    return dict(x=torch.randn(n, s, d, generator=gen), kv=torch.randn(n, (s + 1) * d, generator=gen),
                weight=torch.rand(s, d, generator=gen), token_mask=torch.rand(n, generator=gen) > 0.2)


def _gate_fwd(**change):
    args = _gate_inputs()
    args |= {k: v(args) if callable(v) else v for k, v in change.items()}
    return lambda backend, a=args: engram_gate_forward(eps=1e-6, backend=backend, **a)


def _gate_bwd(**change):
    args = _gate_inputs()
    n, s, d = args["x"].shape
    args |= dict(dout=torch.randn(n, s, d), saved=torch.rand(n, s, 4))
    args |= {k: v(args) if callable(v) else v for k, v in change.items()}
    return lambda backend, a=args: engram_gate_backward(eps=1e-6, backend=backend, **a)


def _gate(**change):
    args = _gate_inputs()
    args |= {k: v(args) if callable(v) else v for k, v in change.items()}
    return lambda backend: engram_gate(args["x"], args["kv"], args["weight"], args["token_mask"], eps=1e-6,
                                       backend=backend)


def _gdn(**change):
    gen = torch.Generator().manual_seed(4)
    t, h, hv, d = 70, 2, 4, 16
    args = dict(q=torch.randn(1, t, h, d, generator=gen), k=torch.randn(1, t, h, d, generator=gen),
                v=torch.randn(1, t, hv, d, generator=gen), g=-torch.rand(1, t, hv, generator=gen),
                beta=torch.rand(1, t, hv, generator=gen), cu_seqlens=torch.tensor([0, 30, 70], dtype=torch.int32))
    args |= {k: v(args) if callable(v) else v for k, v in change.items()}
    return lambda backend, a=args: chunk_gdn(backend=backend, **a)


CASES = {
    # text RoPE
    "rope values int": (_rope(values=lambda a: a["values"].int()), TypeError, "values: expected a floating-point"),
    "rope values not a tensor": (_rope(values=[1.0]), TypeError, "values: expected a torch.Tensor"),
    "rope angles fp64": (_rope(angles=lambda a: a["angles"].double()), TypeError, "angles: expected dtype"),
    "rope too many pairs": (_rope(angles=torch.randn(2, 5, 9)), ValueError, "angles: expected 1 <= P"),
    "rope out wrong shape": (_rope(out=torch.empty(2, 5, 3, 15)), ValueError, "out: expected shape"),
    "rope out is values": (_rope(out=lambda a: a["values"]), ValueError, "out: must not overlap values"),
    "rope out expanded": (_rope(out=torch.empty(1, 5, 3, 16).expand(2, 5, 3, 16)), ValueError,
                          "out: expected a tensor whose elements do not alias"),
    "rope inplace with out": (_rope(inplace=True, out=torch.empty(2, 5, 3, 16)), ValueError,
                              "out: must be None when inplace=True"),
    "rope inplace on a leaf": (_rope(values=lambda a: a["values"].requires_grad_(), inplace=True), ValueError,
                               "values: a leaf tensor that requires grad"),
    "rope out with grad": (_rope(values=lambda a: a["values"].requires_grad_(), out=torch.empty(2, 5, 3, 16)),
                           ValueError, "out: apply_rope with out= does not support autograd"),
    # vision RoPE backward
    "vision int32 gradients": (_vision_bwd(dq_htd=lambda a: a["dq_htd"].int(), dk_hdt=lambda a: a["dk_hdt"].int(),
                                           dv_htd=lambda a: a["dv_htd"].int()), TypeError, "dq_htd: expected dtype in"),
    "vision dtype mismatch": (_vision_bwd(dv_htd=lambda a: a["dv_htd"].double()), TypeError,
                              r"dv_htd: expected dtype float32 \(that of dq_htd\)"),
    "vision dk in HTD": (_vision_bwd(dk_hdt=torch.randn(2, 9, 8)), ValueError, r"dk_hdt: expected shape \[H, D, T\]"),
    "vision dq strided": (_vision_bwd(dq_htd=torch.randn(9, 2, 8).transpose(0, 1)), ValueError,
                          r"dq_htd: expected contiguous \[H, T, D\] storage"),
    "vision misaligned": (_vision_bwd(dq_htd=torch.randn(2 * 9 * 8 + 1)[1:].view(2, 9, 8)), ValueError,
                          "dq_htd: expected a 16-byte aligned data pointer"),
    "vision cos fp64": (_vision_bwd(cos=lambda a: a["cos"].double()), TypeError, r"cos: expected dtype in \(float32\)"),
    "vision out wrong dtype": (_vision_bwd(out=torch.empty(9, 48, dtype=torch.bfloat16)), ValueError,
                               r"out: expected a float32 tensor of shape \[9, 48\]"),
    "vision out overlaps dv": (_vision_bwd(dv_htd=lambda a: torch.randn(9 * 48)[: 2 * 9 * 8].view(2, 9, 8)),
                               None, None),  # built below: the output shares storage with dv
    # vision RoPE front
    "front qkv int": (_vision_front(qkv=lambda a: a["qkv"].long()), TypeError, "qkv: expected dtype in"),
    "front heads": (_vision_front(heads=0), TypeError, "heads: expected a positive int"),
    "front odd width": (_vision_front(qkv=torch.randn(9, 47)), ValueError, r"qkv: expected \[T, 3 \* heads \* D\]"),
    "front channel stride": (_vision_front(qkv=torch.randn(48, 9).t()), ValueError, "qkv: expected unit channel"),
    # Engram gate forward
    "gate x int": (_gate_fwd(x=lambda a: a["x"].int()), TypeError, "x: expected dtype in"),
    "gate kv dtype": (_gate_fwd(kv=lambda a: a["kv"].double()), TypeError, r"kv: expected dtype float32 \(that of x\)"),
    "gate weight bf16": (_gate_fwd(weight=lambda a: a["weight"].bfloat16()), TypeError, "weight: expected dtype in"),
    "gate mask int": (_gate_fwd(token_mask=lambda a: a["token_mask"].int()), TypeError, "token_mask: expected dtype"),
    "gate negative eps": (None, None, None),  # built below (eps is a keyword)
    "gate out is x": (_gate_fwd(out=lambda a: a["x"]), ValueError, "out: must not overlap x"),
    "gate saved inside kv": (_gate_fwd(saved=lambda a: a["kv"].view(-1)[: 6 * 4 * 4].view(6, 4, 4)), ValueError,
                             "saved: must not overlap kv"),
    "gate out rows strided": (_gate_fwd(out=torch.empty(6, 32, 4).transpose(1, 2)), ValueError,
                              r"out: expected contiguous \[S, D\] rows"),
    # Engram gate backward
    "gate dx is dout": (_gate_bwd(dx=lambda a: a["dout"]), ValueError, "dx: must not overlap dout"),
    "gate dkv is kv": (_gate_bwd(dkv=lambda a: a["kv"]), ValueError, "dkv: must not overlap kv"),
    "gate dweight is weight": (_gate_bwd(dweight=lambda a: a["weight"]), ValueError, "dweight: must not overlap weight"),
    "gate workspace small": (_gate_bwd(workspace=torch.empty(10)), ValueError, "workspace: expected a contiguous fp32"),
    "gate saved wrong shape": (_gate_bwd(saved=torch.rand(6, 4, 3)), ValueError, r"saved: expected a float32 tensor"),
    # Gated DeltaNet
    "gdn heads not grouped": (_gdn(v=torch.randn(1, 70, 3, 16)), ValueError, "v: the value heads HV = 3 must be"),
    "gdn k shape": (_gdn(k=torch.randn(1, 70, 2, 32)), ValueError, r"k: expected shape \[1, 70, 2, 16\]"),
    "gdn g bf16": (_gdn(g=lambda a: a["g"].bfloat16()), TypeError, r"g: expected dtype in \(float32\)"),
    "gdn v dtype": (_gdn(v=lambda a: a["v"].double()), TypeError, r"v: expected dtype float32 \(that of q\)"),
    "gdn cu_seqlens from 1": (_gdn(cu_seqlens=torch.tensor([1, 30, 70])), ValueError, "cu_seqlens: expected non-decr"),
    "gdn cu_seqlens short": (_gdn(cu_seqlens=torch.tensor([0, 30, 69])), ValueError, "from 0 to T = 70"),
    "gdn cu_seqlens decreasing": (_gdn(cu_seqlens=torch.tensor([0, 40, 30, 70])), ValueError, "non-decreasing"),
    "gdn cu_seqlens float": (_gdn(cu_seqlens=torch.tensor([0.0, 70.0])), TypeError, "cu_seqlens: expected dtype"),
    "gdn cu_seqlens batch 2": (_gdn(**{n: (lambda a, n=n: a[n].expand(2, *a[n].shape[1:]))
                                       for n in ("q", "k", "v", "g", "beta")}), ValueError, "expected B = 1"),
    "gdn state shape": (_gdn(initial_state=torch.zeros(1, 4, 16, 16)), ValueError, r"initial_state: expected shape"),
    "gdn scale": (_gdn(scale=-1.0), ValueError, "scale: expected a float > 0"),
    "gdn state strided": (_gdn(initial_state=torch.zeros(2, 4, 16, 16).transpose(-1, -2)), ValueError,
                          r"initial_state: expected contiguous \[N, HV, K, V\] storage"),
    "gdn state not a tensor": (_gdn(initial_state=[0.0]), TypeError, "initial_state: expected a torch.Tensor"),
    # Engram gate, differentiable
    "gate autograd x 2d": (_gate(x=torch.randn(6, 128)), ValueError, r"x: expected \[N, S, D\]"),
}


def _overlapping_out(backend):
    h, t, d = 2, 9, 8
    storage = torch.randn(t * 3 * h * d)
    dv = storage[: h * t * d].view(h, t, d)
    cos, sin = vision_cos_sin(t, 1, d // 2)
    return vision_rope_backward(torch.randn(h, t, d), torch.randn(h, d, t), dv, cos, sin, out=storage.view(t, 48),
                                backend=backend)


def _negative_eps(backend):
    a = _gate_inputs()
    return engram_gate_forward(a["x"], a["kv"], a["weight"], a["token_mask"], eps=-1.0, backend=backend)


CASES["vision out overlaps dv"] = (_overlapping_out, ValueError, "out: must not overlap dv_htd")
CASES["gate negative eps"] = (_negative_eps, ValueError, "eps: expected a float >= 0")


def _outcome(call, backend):
    """(exception type, message) of one call on ``backend``."""
    try:
        call(backend)
    except (TypeError, ValueError) as exc:
        return type(exc), re.sub(r"0x[0-9a-f]+", "0x..", str(exc))  # fresh inputs per call: other addresses
    return None, "accepted"


# Inputs valid for the op that a fused kernel cannot read: auto falls back (on CUDA), the reference
# serves them, and backend="triton" refuses naming the reason, never a launcher error.
KERNEL_LIMITS = {
    "vision strided cos": (_vision_bwd(cos=lambda a: torch.randn(9, 8)[:, ::2], sin=lambda a: torch.randn(9, 8)[:, ::2]),
                           "cos has frequency stride 2"),
    "front strided cos": (_vision_front(cos=lambda a: torch.randn(9, 8)[:, ::2], sin=lambda a: torch.randn(9, 8)[:, ::2]),
                          "cos has frequency stride 2"),
    "gate wider than the kernels": (_gate_fwd(x=torch.randn(2, 1, 16385), kv=torch.randn(2, 2 * 16385),
                                              weight=torch.rand(1, 16385), token_mask=torch.ones(2, dtype=torch.bool)),
                                    "D = 16385 is above the kernels' limit"),
}


@pytest.mark.parametrize("name", sorted(KERNEL_LIMITS))
def test_kernel_limits_are_backend_reasons(name):
    call, reason = KERNEL_LIMITS[name]
    call("reference")
    call("auto")
    with pytest.raises(ValueError, match=f"backend='triton' cannot serve this .* call: .*{reason}"):
        call("triton")


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_alike_on_every_backend(name):
    call, exc, match = CASES[name]
    outcomes = {backend: _outcome(call, backend) for backend in backends(name)}
    kinds = {kind for kind, _ in outcomes.values()}
    messages = {message for _, message in outcomes.values()}
    assert kinds == {exc} and len(messages) == 1, outcomes
    assert re.search(match, messages.pop()), outcomes
