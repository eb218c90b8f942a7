"""The host-time experiment: its calls run on every op's current API, and its table judges targets."""

import pandas as pd
import pytest
import torch

from dsfuse.bench import experiments, host_time, report, tables


@pytest.mark.parametrize("op", sorted(experiments()))
def test_every_call_runs(op):
    """Each call of every op with an experiment runs once on CPU (the reference where the call picks
    ``auto``, Triton in the interpreter where it names it), so an API change cannot break the run."""
    calls = host_time.op_calls(op, torch.device("cpu"))
    assert {provider for _, provider, _ in calls} >= {"dsfuse", "eager PyTorch"}
    assert len({(call, provider) for call, provider, _ in calls}) == len(calls)  # one row each
    for call, provider, fn in calls:
        fn()


def test_gdn_rows_are_the_forward_and_the_autograd_step_of_both_providers():
    names = [(call, provider) for call, provider, _ in host_time.op_calls("gdn", torch.device("cpu"))]
    for call in ("forward", "autograd forward+backward"):
        assert (call, "dsfuse") in names and (call, "eager PyTorch") in names


def test_host_time_and_report_do_not_import_each_other():
    """host_time measures and renders through report; report never imports host_time (no circle)."""
    import ast
    import inspect

    def imported(module) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        return names

    assert "dsfuse.bench.host_time" not in imported(report)
    assert not any(name.startswith("dsfuse.bench.report") for name in imported(tables))


def test_table_medians_and_targets():
    """Medians per call and provider; the ratio targets are multiples of torch.add in the same run; an
    autograd step must beat eager PyTorch's."""
    rows = [dict(call=c, provider=p, sample=i, host_us=v)
            for c, p, vals in (("forward", "dsfuse", (30, 40, 34)), ("forward", "eager PyTorch", (60, 61, 62)),
                               ("backward", "dsfuse", (80, 80, 80)),
                               ("autograd forward+backward", "dsfuse", (250, 190, 260)),
                               ("autograd forward+backward", "eager PyTorch", (240, 241, 242)),
                               ("torch.add (1 kernel)", "baseline", (9, 10, 11)),
                               ("bare launch", "baseline", (12, 13, 14)))
            for i, v in enumerate(vals)]
    got = tables.host_time_table(pd.DataFrame(rows), {"forward": 3.5, "backward": 7}).set_index("call")
    assert got.loc["forward", "dsfuse us"] == "34.0" and got.loc["forward", "eager PyTorch us"] == "61.0"
    assert got.loc["forward", "x torch.add"] == "3.4" and got.loc["forward", "target"] == "<= 3.5x torch.add"
    assert got.loc["forward", "met"] == "yes" and got.loc["backward", "met"] == "NO"
    assert got.loc["autograd forward+backward", "target"] == "< eager PyTorch"
    assert got.loc["autograd forward+backward", "met"] == "NO"  # 250 > 241
    assert got.loc["bare launch", "baseline us"] == "13.0" and got.loc["bare launch", "met"] == ""


def test_cutedsl_target_judges_whole_calls_only():
    """The CuTe DSL column judges each call against 15 us; the rows of a call's parts are not judged."""
    rows = [dict(call=c, provider="dsfuse cutedsl", sample=i, host_us=v)
            for c, vals in (("forward", (14, 15, 16)), ("backward (functional)", (20, 21, 22)),
                            ("forward part: compiled function alone (TVM-FFI call, 6 tensors)", (30, 30, 30)))
            for i, v in enumerate(vals)]
    got = tables.host_time_table(pd.DataFrame(rows)).set_index("call")
    column = "cutedsl <= 15 us"
    assert got.loc["forward", column] == "yes" and got.loc["backward (functional)", column] == "NO"
    assert got.loc["forward part: compiled function alone (TVM-FFI call, 6 tensors)", column] == ""


def test_a_committed_run_renders_its_table_and_figures():
    """The committed host-time runs render through report (anchor, GPU, table) as before the move."""
    run_dir = report.latest_host_time("vision_rope", "h200")
    text = report.render_host_time("vision_rope", run_dir)
    assert f'<a id="host-time-{run_dir.name}"></a>' in text and "#### Host time per eager call (NVIDIA H200)" in text
    assert "| backward op (forward call)" in text
    figures = report.host_time_figures(run_dir)
    assert figures["backward op (forward call)"]["dsfuse"] > 0
