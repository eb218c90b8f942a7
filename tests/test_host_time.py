"""The host-time experiment: its calls run on every op's current API, and its table judges targets."""

import pandas as pd
import pytest
import torch

from dsfuse.bench import host_time


@pytest.mark.parametrize("op", sorted(host_time.OPS))
def test_every_call_runs(op):
    """Each listed call runs once on CPU (Triton in the interpreter), so an API change cannot break the run."""
    for call, provider, fn in host_time.OPS[op](torch.device("cpu")):
        fn()


def test_table_medians_and_targets():
    rows = [dict(call=c, provider=p, sample=i, host_us=v)
            for c, p, vals in (("forward", "dsfuse", (30, 40, 34)), ("forward", "eager PyTorch", (60, 61, 62)),
                               ("autograd forward+backward", "dsfuse", (250, 190, 260)),
                               ("bare launch", "baseline", (12, 13, 14)))
            for i, v in enumerate(vals)]
    got = host_time.table(pd.DataFrame(rows)).set_index("call")
    assert got.loc["forward", "dsfuse us"] == "34.0" and got.loc["forward", "met"] == "yes"
    assert got.loc["forward", "eager PyTorch us"] == "61.0"
    assert got.loc["autograd forward+backward", "met"] == "NO"
    assert got.loc["bare launch", "baseline us"] == "13.0" and got.loc["bare launch", "met"] == ""


def test_cutedsl_target_judges_whole_calls_only():
    """The CuTe DSL column judges each call against 15 us; the rows of a call's parts are not judged."""
    rows = [dict(call=c, provider="dsfuse cutedsl", sample=i, host_us=v)
            for c, vals in (("forward", (14, 15, 16)), ("backward (functional)", (20, 21, 22)),
                            ("forward part: compiled function alone (TVM-FFI call, 6 tensors)", (30, 30, 30)))
            for i, v in enumerate(vals)]
    got = host_time.table(pd.DataFrame(rows)).set_index("call")
    column = "cutedsl <= 15 us"
    assert got.loc["forward", column] == "yes" and got.loc["backward (functional)", column] == "NO"
    assert got.loc["forward part: compiled function alone (TVM-FFI call, 6 tensors)", column] == ""
