"""Shared validation helpers."""

import pytest
import torch

from dsfuse._common import check_no_internal_overlap, check_no_overlap, memory_span, resolve_backend


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


def test_resolve_backend():
    assert resolve_backend("auto", [], on_cuda=True) == "triton"
    assert resolve_backend("auto", [], on_cuda=False) == "reference"
    assert resolve_backend("auto", ["x"], on_cuda=True) == "reference"
    assert resolve_backend("reference", [], on_cuda=True) == "reference"
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: a; b"):
        resolve_backend("triton", ["a", "b"], on_cuda=True)
    with pytest.raises(ValueError, match="backend: expected one of"):
        resolve_backend("fast", [], on_cuda=True)
