"""Shared validation helpers."""

import importlib
import importlib.util
import logging

import pytest
import torch
from conftest import DEVICES
from dsfuse._common import (
    OpBackends,
    check_no_internal_overlap,
    check_no_overlap,
    memory_span,
    no_reasons,
)
from dsfuse._common.backends import BACKENDS, BackendTable, load_all_ops


def test_memory_span_of_views():
    base = torch.empty(10, 8)
    item = base.element_size()
    assert memory_span(base) == (base.data_ptr(), base.data_ptr() + 80 * item)
    view = base[2:4, 1:3]
    lo, hi = memory_span(view)
    assert lo == base.data_ptr() + (2 * 8 + 1) * item and hi == base.data_ptr() + (3 * 8 + 3) * item
    flipped = base.t()
    assert memory_span(flipped) == memory_span(base)
    assert memory_span(base[:0])[0] == memory_span(base[:0])[1]


def test_overlap_detection():
    base = torch.empty(10, 8)
    check_no_overlap({"out": base[:5]}, {"x": base[5:]})
    with pytest.raises(ValueError, match="out: must not overlap x"):
        check_no_overlap({"out": base[:6]}, {"x": base[5:]})
    with pytest.raises(ValueError, match="a: must not overlap b"):
        check_no_overlap({"a": base[:, :3], "b": base[:, 2:]}, {})
    check_no_overlap({"out": torch.empty(3)}, {"x": torch.empty(3), "none": None})


def test_internal_overlap():
    check_no_internal_overlap("t", torch.empty(4, 5).t())
    check_no_internal_overlap("t", torch.empty(4, 5)[:, ::2])
    with pytest.raises(ValueError, match="t: expected a tensor whose elements do not alias"):
        check_no_internal_overlap("t", torch.empty(1, 5).expand(4, 5))
    with pytest.raises(ValueError, match="do not alias"):
        check_no_internal_overlap("t", torch.empty(10).as_strided((4, 4), (2, 1)))


def _table(backend, dtypes, auto=None, reasons=no_reasons):
    return BackendTable(backend, dtypes=dtypes, calls={"run": reasons}, kernels=(), load=lambda: {"run": None},
                        auto=auto or {})


def test_backend_choice(monkeypatch):
    """``auto`` takes the reference on the CPU and the family's first serving backend on CUDA;
    a named backend that cannot serve raises with every reason."""
    entry = OpBackends("toy", (_table("triton", (torch.float32,)),))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert entry.choose("auto", cpu, torch.float32) == "reference"  # the interpreter is never auto's pick
    assert entry.choose("triton", cpu, torch.float32) == "triton"
    assert entry.choose("reference", cuda, torch.float32) == "reference"
    monkeypatch.setattr("dsfuse._common.backends._FAMILIES", {0: "sm_90"})
    assert entry.choose("auto", cuda, torch.float32) == "triton"
    assert entry.choose("auto", cuda, torch.float64) == "reference"
    assert entry.choose("auto", cuda, torch.float32, ["input x requires grad"]) == "reference"
    with pytest.raises(ValueError, match="backend='triton' cannot serve this toy call: dtype float64 is not one of "
                                         "float32; input x requires grad"):
        entry.choose("triton", cuda, torch.float64, ["input x requires grad"])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"tensors are on cpu \(Triton needs CUDA, or TRITON_INTERPRET=1 for CPU\)"):
        entry.choose("triton", cpu, torch.float32)
    with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'triton', 'reference'\) for toy"):
        entry.choose("fast", cpu, torch.float32)


def test_backend_preference_per_family(monkeypatch):
    """With two fused backends, ``auto`` follows the family's measured order and skips one that cannot serve."""
    asked = []
    refusing = lambda *args: asked.append(args) or ["head dim 6 is not a multiple of 8"]
    entry = OpBackends("toy", (_table("triton", (torch.float32,)),
                               _table("cutedsl", (torch.float32, torch.float16), auto={"sm_100": 0})))
    refused = OpBackends("toy", (_table("triton", (torch.float32,)),
                                 _table("cutedsl", (torch.float32, torch.float16), auto={"sm_100": 0},
                                        reasons=refusing)))
    assert entry.preference == {"sm_100": ("cutedsl", "triton")}
    cuda = torch.device("cuda", 0)
    object.__setattr__(BACKENDS["cutedsl"], "installed", True)
    try:
        monkeypatch.setattr("dsfuse._common.backends._FAMILIES", {0: "sm_100"})
        assert entry.choose("auto", cuda, torch.float32, call="run") == "cutedsl"
        assert refused.choose("auto", cuda, torch.float32, call="run", args=(1,)) == "triton"  # its own reasons
        assert asked == [(1,)]
        with pytest.raises(ValueError, match="backend='cutedsl' cannot serve this toy call: head dim 6"):
            refused.choose("cutedsl", cuda, torch.float32, call="run", args=(2,))  # by name: every reason
        with pytest.raises(ValueError, match="the CuTe DSL backend has no other kernel for toy"):
            entry.choose("cutedsl", cuda, torch.float32, call="other")
        monkeypatch.setattr("dsfuse._common.backends._FAMILIES", {0: "sm_90"})
        assert entry.choose("auto", cuda, torch.float32) == "triton"  # unlisted family: the order of the tables
        assert entry.choose("auto", cuda, torch.float16) == "cutedsl"  # triton cannot serve fp16 here
        object.__setattr__(BACKENDS["cutedsl"], "installed", False)
        monkeypatch.setattr("dsfuse._common.backends._FAMILIES", {0: "sm_100"})
        assert refused.choose("auto", cuda, torch.float32, call="run", args=(3,)) == "triton"
        assert asked == [(1,), (2,)]  # not installed: its own reasons are not asked (its module needs the package)
        with pytest.raises(ValueError, match=r"needs the packages cutlass and tvm_ffi \(pip install 'dsfuse\[cutedsl\]'\)"):
            entry.choose("cutedsl", cuda, torch.float32)
    finally:
        object.__setattr__(BACKENDS["cutedsl"], "installed", all(importlib.util.find_spec(m) is not None
                                                                 for m in ("cutlass", "tvm_ffi")))


def test_auto_never_on_a_family_a_table_excludes():
    entry = OpBackends("toy", (_table("triton", (torch.float32,)),
                               _table("cutedsl", (torch.float32,), auto={"sm_90": None, "sm_100": 0})))
    assert entry.preference == {"sm_90": ("triton",), "sm_100": ("cutedsl", "triton")}


def test_twin_ops_are_declared_once_per_backend():
    """``declare_backend_ops``: the first backend's op carries the plain name, every other backend's
    its suffix (the names compiled graphs hold: ``dsfuse::vision_rope_bwd_cutedsl``, ...)."""
    from dsfuse._common.backends import OPS

    load_all_ops()
    from dsfuse.engram_gate import api as eg_api
    from dsfuse.vision_rope import api as vr_api

    assert {b: op.name for b, op in vr_api.backward_ops.items()} == {
        "triton": "dsfuse::vision_rope_bwd", "cutedsl": "dsfuse::vision_rope_bwd_cutedsl"}
    assert {b: op.name for b, op in vr_api.backward_into_ops.items()} == {
        "triton": "dsfuse::vision_rope_bwd_out", "cutedsl": "dsfuse::vision_rope_bwd_out_cutedsl"}
    assert {b: op.name for b, op in vr_api.forward_ops.items()} == {"triton": "dsfuse::vision_rope_fwd"}
    assert {b: op.name for b, op in eg_api.forward_ops.items()} == {
        "triton": "dsfuse::engram_gate_fwd", "cutedsl": "dsfuse::engram_gate_fwd_cutedsl"}
    assert {b: op.name for b, op in eg_api.backward_ops.items()} == {
        "triton": "dsfuse::engram_gate_bwd", "cutedsl": "dsfuse::engram_gate_bwd_cutedsl"}
    assert OPS["gdn"].first == "triton"


def test_cutedsl_tables_import_without_the_extra():
    """A CuTe DSL backend's table imports nothing of ``cutlass`` (its kernel module does, on first use)."""
    code = ("import sys\n"
            "import dsfuse.vision_rope, dsfuse.engram_gate\n"
            "from dsfuse._common.backends import OPS\n"
            "assert 'cutedsl' in OPS['vision_rope'].kernels and 'cutedsl' in OPS['engram_gate'].kernels\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('cutlass', 'tvm_ffi')]\n")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_op_is_registered():
    """Importing the package's op folders registers each op with its kernel modules (what the AOT check reads)."""
    ops = load_all_ops()
    assert {"text_rope", "vision_rope", "engram_gate"} <= set(ops)
    for entry in ops.values():
        assert entry.kernels, entry.op
        for backend, modules in entry.kernels.items():
            if not BACKENDS[backend].installed:  # e.g. cutedsl without the extra: its modules need the package
                continue
            for module in modules:
                assert importlib.import_module(module).AOT_SPECS, module


@pytest.mark.parametrize("device", DEVICES)
def test_declared_op_traces_as_custom_op_in_forward_and_backward(device):
    """Under torch.compile the launch only ever sees real tensors: dynamo traces the custom op, and
    AOT autograd's trace of the backward formula (fake/functional tensors, ``is_compiling()`` False)
    calls the custom op too, not the eager launch."""
    from dsfuse._common import declare_op

    seen = []

    def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
        seen.append(type(x))
        return x * factor

    def _save(ctx, inputs, output):
        ctx.factor = inputs[1]

    def _grad(ctx, g):
        return (scale(g, ctx.factor),)

    scale = declare_op(f"test_scale_traced_{device}", _scale, setup=_save, backward=_grad,
                       fake=lambda x, factor: torch.empty_like(x))
    x = torch.randn(5, device=device, requires_grad=True)
    out = torch.compile(lambda t: scale(t, 3.0) + 1, fullgraph=True, backend="aot_eager")(x)
    out.backward(torch.ones(5, device=device))
    assert torch.equal(x.grad, torch.full((5,), 3.0, device=device))
    assert seen and all(t is torch.Tensor for t in seen), seen
    seen.clear()
    y = torch.randn(4, device=device, requires_grad=True)
    scale(y, 2.0).sum().backward()  # eager: the autograd.Function, its backward the plain launch
    assert torch.equal(y.grad, torch.full((4,), 2.0, device=device)) and seen == [torch.Tensor, torch.Tensor]


# -- the staleness mark (dsfuse.bench.env): kernel code moved between files is unchanged ---------



def test_choice_is_logged_with_its_reason(caplog):
    """A call says which backend served it, and why, on the dsfuse logger at debug level."""
    from dsfuse.text_rope import apply_rope, rope_angles, yarn_inv_freq

    angles = rope_angles(torch.arange(5)[None], yarn_inv_freq(8, 1e4))
    q = torch.randn(1, 5, 2, 16)
    with caplog.at_level(logging.DEBUG, logger="dsfuse"):
        apply_rope(q, angles)
        apply_rope(q, angles, backend="triton")
    messages = [r.getMessage() for r in caplog.records if r.name == "dsfuse"]
    assert any("backend 'reference' served (asked 'auto'): tensors on cpu" in m for m in messages), messages
    assert any("backend 'triton' served (asked 'triton')" in m for m in messages), messages
    caplog.clear()
    apply_rope(q, angles)  # nothing at the default level
    assert not [r for r in caplog.records if r.name == "dsfuse"]
