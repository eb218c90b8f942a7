"""Test configuration.

* Without CUDA, Triton kernels run in the interpreter (``TRITON_INTERPRET=1`` is
  set before anything imports Triton) on CPU tensors.
* GPU tests carry ``@pytest.mark.gpu``. The CPU command deselects them
  (``-m "not gpu"``); ``scripts/gpu_job.sh`` selects them with
  ``DSFUSE_REQUIRE_GPU=1``, under which a missing GPU is an error, not a skip.
* Every ``torch.empty*`` allocation is filled with NaN (integers with their
  maximum) so an output element a kernel forgets to write fails the test.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

REQUIRE_GPU = os.environ.get("DSFUSE_REQUIRE_GPU") == "1"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# The CuTe DSL backend's tests skip without the `cutedsl` extra; DSFUSE_REQUIRE_CUTEDSL=1 (a GPU job
# meant to test that backend) makes a missing package an error instead of a skip.
REQUIRE_CUTEDSL = os.environ.get("DSFUSE_REQUIRE_CUTEDSL") == "1"


def cutedsl_or_skip() -> None:
    """At a test module's top: skip the module without the `cutedsl` extra (an error under
    DSFUSE_REQUIRE_CUTEDSL=1)."""
    from dsfuse._common import cutedsl

    if cutedsl.installed():
        return
    if REQUIRE_CUTEDSL:
        raise RuntimeError("DSFUSE_REQUIRE_CUTEDSL=1 but the cutedsl extra (nvidia-cutlass-dsl, apache-tvm-ffi) "
                           "is not installed")
    pytest.skip("needs the cutedsl extra: pip install 'dsfuse[cutedsl]'", allow_module_level=True)


def _fused_backends():
    from dsfuse._common import cutedsl

    skip = not cutedsl.installed() and not REQUIRE_CUTEDSL
    return ["triton", pytest.param("cutedsl", marks=pytest.mark.skipif(skip, reason="needs the cutedsl extra"))]


FUSED_BACKENDS = _fused_backends()  # parametrise a test over both fused backends


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            if REQUIRE_GPU:
                raise pytest.UsageError("DSFUSE_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_job.sh on one)"))


def _poison(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # the allocation may be a leaf that requires grad
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool and t.numel():
            t.fill_(torch.iinfo(t.dtype).max)
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    real = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}
    for name, fn in real.items():
        def poisoned(*args, _fn=fn, **kwargs):
            return _poison(_fn(*args, **kwargs))
        monkeypatch.setattr(torch, name, poisoned)
    yield
