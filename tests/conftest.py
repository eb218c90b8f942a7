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
