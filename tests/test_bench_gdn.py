"""The Gated DeltaNet experiment (``dsfuse.bench.gdn``): cases and floors, the providers' plumbing,
and the CPU smoke run of ``experiments/gdn/configs/smoke.yaml``.

The smoke run (``test_smoke_config_on_cpu``) runs the Triton forward AND backward stages in the
interpreter, through every mode and both views: about a minute on a CPU (marked ``slow``). It has no
``importorskip``: if the Triton backward stages do not import or run, it fails, loudly, instead of
skipping. ``test_every_mode_with_the_reference_backend`` covers the same plumbing in seconds with
``chunk_gdn(backend="reference")``.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from dsfuse.bench import gdn, harness, report

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "experiments" / "gdn" / "configs"


def test_cases_and_floors_at_the_brief_shape():
    """32,768 tokens in five documents (none a multiple of 64), (16, 48), 128; floors by hand."""
    config = harness.load_config(CONFIGS / "h200.yaml")
    cases = gdn.cases(config)
    assert [c.name for c in cases] == [f"T32768{hv}_{l2}_{m}" for hv in ("", "_hv32") for l2 in ("l2", "nol2")
                                       for m in ("fwd", "bwd", "fwd+bwd", "ckpt", "layer")]
    assert {c.params["value_heads"] for c in cases if "_hv32" in c.name} == {32}
    p = cases[0].params
    bounds = p["bounds"]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    assert len(lengths) == 5 and bounds[-1] == 32768 and all(n % 64 for n in lengths)
    assert (p["heads"], p["value_heads"], p["head_dim"], p["hidden"]) == (16, 48, 128, 2048)
    t, n, hv, d = 32768, 5, 48, 128
    qkv, o, state, gates = t * (2 * 16 + 48) * d * 2, t * hv * d * 2, n * hv * d * d * 4, t * hv * (4 + 2)
    fwd = qkv + gates + state + o + state
    bwd = qkv + gates + state + o + state + qkv + gates + state
    by_mode = {c.mode: c for c in cases if c.params["l2norm"] and c.params["value_heads"] == 48}
    assert by_mode["fwd"].bytes == fwd and by_mode["bwd"].bytes == bwd
    assert by_mode["fwd+bwd"].bytes == fwd + bwd and by_mode["ckpt"].bytes == 2 * fwd + bwd
    chunks = sum(math.ceil(m / 64) for m in lengths)
    assert gdn.chunk_flops(128, 128) == (11_621_717, 32_505_856)
    assert by_mode["fwd"].flops == 11_621_717 * chunks * hv
    assert by_mode["layer"].flops == by_mode["fwd+bwd"].flops + 3 * 2 * t * 2048 * (2 * 16 + 48) * d
    assert gdn.tolerances(config) == (0.005, 0.005, 0.008, 0.008, 0.008, 0.02, 0.02, 0.008, 0.008)
    with pytest.raises(ValueError, match="multiple of 64"):
        gdn.document_bounds(300, [64, 236])


@pytest.mark.parametrize("value_heads", [[40], [0], ["48"]])
def test_value_heads_must_be_multiples_of_the_qk_heads(value_heads):
    config = harness.load_config(CONFIGS / "h200.yaml") | {"value_heads": value_heads}
    with pytest.raises(ValueError, match="value_heads"):
        gdn.cases(config)


def test_fla_applies_only_where_installed():
    case = gdn.cases(harness.load_config(CONFIGS / "smoke.yaml"))[0]
    (fla,) = gdn.providers({"providers": ["fla"]})
    reason = fla.applies(case)
    try:
        import fla as _  # noqa: F401
    except ImportError:
        assert reason and "flash-linear-attention" in reason
    else:
        assert reason is None


def test_flashqla_applies_only_where_installed_and_not_to_the_layer_step():
    cases = {c.mode: c for c in gdn.cases(harness.load_config(CONFIGS / "smoke.yaml")) if c.params["l2norm"]}
    (flashqla, fla_contiguous) = gdn.providers({"providers": ["flashqla", "fla-contiguous"]})
    try:
        import flash_qla as _  # noqa: F401
    except ImportError:
        assert "FlashQLA (flash_qla) is not importable" in flashqla.applies(cases["fwd"])
    else:
        assert flashqla.applies(cases["fwd"]) is None and "no contiguous form" in flashqla.applies(cases["layer"])
    assert fla_contiguous.applies(cases["layer"])  # not installed, or no contiguous form: never None
    assert flashqla.role == fla_contiguous.role == "control"


def _tiny_config(**changes) -> dict:
    """The smoke config at an even smaller shape (two documents of 33 and 37 tokens, H = 1, HV = 2)."""
    config = harness.load_config(CONFIGS / "smoke.yaml")
    return config | dict(tokens=70, documents=[33, 37], l2norm=[False],
                         model_overrides={"num_k_heads": 1, "num_v_heads": 2, "head_dim": 16, "hidden_size": 8},
                         **changes)


def test_every_mode_with_the_reference_backend(tmp_path):
    """Every mode and both views through the harness (chunk_gdn's reference backend: seconds); the
    packed provider's gradients are the three parts of one packed row."""
    config = _tiny_config(backend="reference")
    run_dir = harness.run_experiment(gdn, config, tmp_path, torch.device("cpu"), run_id="r1")
    validation = pd.read_csv(run_dir / "validation.csv", keep_default_na=False)
    assert set(validation["status"]) == {"pass"}, validation[validation["status"] != "pass"].to_string()
    samples = pd.read_csv(run_dir / "samples.csv")
    timed = set(zip(samples["case"], samples["provider"]))
    assert {(c.name, p) for c in gdn.cases(config) for p in config["providers"]} <= timed

    case = next(c for c in gdn.cases(config) if c.mode == "fwd+bwd")
    (packed,) = gdn.providers(config | {"providers": ["dsfuse-packed"]})
    outputs = packed.build(case, gdn.make_inputs(case, torch.device("cpu"), seed=0))()
    dq, dk, dv = outputs[2:5]
    assert dq.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()
    assert dk.data_ptr() - dq.data_ptr() == dq.shape[1] * dq.element_size()


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd", "layer"])
def test_the_reference_in_pieces_of_heads_is_the_whole_one(mode, monkeypatch):
    """`dsfuse.bench.gdn.reference` in pieces of whole qk heads (`reference_head_groups`, forced here
    by a small `REFERENCE_PIECE`) gives the one-piece reference's outputs, every head in its place,
    to float64's rounding; the groups cover every qk head once, at least one a piece."""
    assert gdn.reference_head_groups(131072, 16, 48) == [(h, h + 5) for h in range(0, 15, 5)] + [(15, 16)]
    assert gdn.reference_head_groups(32768, 16, 48) == [(0, 16)]
    assert gdn.reference_head_groups(1 << 22, 2, 4) == [(0, 1), (1, 2)]
    config = _tiny_config(backend="reference") | dict(
        l2norm=[True], model_overrides={"num_k_heads": 2, "num_v_heads": 4, "head_dim": 16, "hidden_size": 8})
    case = next(c for c in gdn.cases(config) if c.mode == mode)
    p = case.params
    inputs = gdn.make_inputs(case, torch.device("cpu"), seed=0)
    whole = gdn.reference(case, inputs)
    monkeypatch.setattr(gdn, "REFERENCE_PIECE", 1)
    assert gdn.reference_head_groups(p["tokens"], p["heads"], p["value_heads"]) == [(0, 1), (1, 2)]
    pieces = gdn.reference(case, inputs)
    assert len(pieces) == len(whole)
    for a, b in zip(pieces, whole):
        assert a.shape == b.shape and a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd", "ckpt"])
def test_contiguous_form_equals_split_views(mode):
    """`_build`'s contiguous form (the controls' best case: separate contiguous q, k, v as the leaves)
    returns what the split views return, bit for bit, in the row gradient's parts' shapes; the layer
    step has no contiguous form."""
    config = _tiny_config(backend="reference")
    case = next(c for c in gdn.cases(config) if c.mode == mode)
    inputs = gdn.make_inputs(case, torch.device("cpu"), seed=0)
    split = gdn._build(gdn.split_views, gdn.dsfuse_gdn)(case, inputs)()
    contiguous = gdn._build(None, gdn.dsfuse_gdn, contiguous=True)(case, inputs)()
    assert len(split) == len(contiguous) == (2 if mode == "fwd" else 8)
    for a, b in zip(split, contiguous):
        assert a.shape == b.shape and torch.equal(a, b)
    layer = next(c for c in gdn.cases(config) if c.mode == "layer")
    with pytest.raises(ValueError, match="no contiguous form"):
        gdn._build(None, gdn.dsfuse_gdn, contiguous=True)(layer, gdn.make_inputs(layer, torch.device("cpu"), seed=0))


@pytest.mark.slow
def test_smoke_config_on_cpu(tmp_path):
    """``experiments/gdn/configs/smoke.yaml`` through ``run_experiment`` on the CPU: the Triton stages in
    the interpreter, every mode, both views, checked against FP64; then the report with its sections.
    Minutes, not seconds (the interpreter); fails (never skips) if the Triton backward is missing."""
    config = harness.load_config(CONFIGS / "smoke.yaml")
    assert config["backend"] == "triton" and config["providers"] == ["dsfuse-packed", "dsfuse-split"]
    run_dir = harness.run_experiment(gdn, config, tmp_path / "raw", torch.device("cpu"), run_id="smoke")
    validation = pd.read_csv(run_dir / "validation.csv", keep_default_na=False)
    assert set(validation["status"]) == {"pass"}, validation[validation["status"] != "pass"].to_string()
    assert set(validation["stage"]) == {"before", "after-eager"}
    samples = pd.read_csv(run_dir / "samples.csv")
    assert set(samples["case"]) - {"copy"} == {c.name for c in gdn.cases(config)}
    report.render("gdn", tmp_path / "raw", tmp_path / "results", tmp_path / "plots", smoke=True)
    text = (tmp_path / "results" / "cpu" / "gdn.md").read_text()
    assert "SMOKE RUN" in text  # and report_extra's sections, one level down under the GPU's heading:
    assert "\n#### Packed views against plain split views\n" in text and "\n#### FLOPs\n" in text


def test_the_long_document_config():
    """``h200-long.yaml``: one document and five of 32,768 and of 131,072 tokens (a single document may
    be a whole number of chunks), named by their count; its runs go to ``raw/long/``, apart from the
    runs the tables read; chunk_gdn's split rule cuts the one-document cases, not the five documents
    of 32,768 tokens."""
    from dsfuse.bench.__main__ import raw_root
    from dsfuse.gdn.split import RULE, split_for

    config = harness.load_config(CONFIGS / "h200-long.yaml")
    cases = gdn.cases(config)
    assert [c.name for c in cases if c.mode == "fwd" and c.params["value_heads"] == 48] == [
        "T32768_n1_l2_fwd", "T32768_n5_l2_fwd", "T131072_n1_l2_fwd", "T131072_n5_l2_fwd"]
    bounds = {c.name: c.params["bounds"] for c in cases}
    assert bounds["T32768_n1_l2_fwd"] == [0, 32768] and bounds["T131072_n1_l2_fwd"] == [0, 131072]
    assert bounds["T32768_n5_l2_fwd"] == gdn.document_bounds(32768, 5)
    split = {name: split_for(tuple(b), RULE, 64) is not None for name, b in bounds.items()}
    assert split["T32768_n1_l2_fwd"] and split["T131072_n1_l2_fwd"] and split["T131072_n5_l2_fwd"]
    assert not split["T32768_n5_l2_fwd"]
    assert raw_root(REPO / "raw", config) == REPO / "raw" / "long"
    assert raw_root(REPO / "raw", {}) == REPO / "raw"
    with pytest.raises(ValueError, match="raw_subdir"):
        raw_root(REPO / "raw", {"raw_subdir": "../elsewhere"})
    with pytest.raises(ValueError, match="own result files"):  # results/<gpu>/<op>_tuning.md is the op's
        raw_root(REPO / "raw", {"raw_subdir": "tuning"})
    with pytest.raises(ValueError, match="document_counts"):
        gdn.cases(config | {"documents": 5})
    with pytest.raises(ValueError, match="multiple of 64"):  # several documents still end in a partial chunk
        gdn.document_bounds(128, [64, 64])


def _synthetic_run(run_dir: Path, memory: list[dict] | None) -> Path:
    """A GPU run folder of two cases and four providers (the config's order is neither alphabetical nor
    memory.csv's), with ``memory`` as its memory.csv (none: a run made before memory was measured)."""
    import json

    import yaml

    providers = ["dsfuse-split", "flashqla", "dsfuse-packed", "fla"]
    cases = ["T64_l2_fwd", "T64_l2_fwd+bwd"]
    run_dir.mkdir(parents=True)
    samples = [dict(case="copy", mode="copy", provider="copy", regime="evicted", clock="graph", block=0, sample=0,
                    us=1.0)]
    samples += [dict(case=c, mode=c.split("_")[-1], provider=p, regime="evicted", clock="graph", block=0, sample=0,
                     us=10.0 + i) for c in cases for i, p in enumerate(providers)]
    pd.DataFrame(samples).to_csv(run_dir / "samples.csv", index=False)
    pd.DataFrame([dict(case=c, mode="", provider=p, role="control", form="", check="relrms", stage="before",
                       status="pass", mismatches=0, max_abs_diff=0.0, error="")
                  for c in cases for p in providers]).to_csv(run_dir / "validation.csv", index=False)
    pd.DataFrame([dict(case="copy", mode="copy", bytes=1_000_000, flops=0, params="{}")]
                 + [dict(case=c, mode=c.split("_")[-1], bytes=1_000_000, flops=10**9, params="{}")
                    for c in cases]).to_csv(run_dir / "cases.csv", index=False)
    (run_dir / "env.json").write_text(json.dumps(dict(gpu_name="NVIDIA H200")))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dict(providers=providers)))
    if memory is not None:
        pd.DataFrame(memory).to_csv(run_dir / "memory.csv", index=False)
    return run_dir


def test_report_extra_tables_each_providers_extra_peak_memory(tmp_path):
    """One row per case, one column per provider in the config's order, whole MiB; n/a where a provider
    has no row; between the packed/split table and the FLOPs; no such section for a run without memory.csv."""
    peaks = {("T64_l2_fwd", "fla"): 1234.4, ("T64_l2_fwd", "dsfuse-packed"): 99.6,
             ("T64_l2_fwd", "dsfuse-split"): 100.2, ("T64_l2_fwd", "flashqla"): 7.0,
             ("T64_l2_fwd+bwd", "fla"): 4321.0, ("T64_l2_fwd+bwd", "dsfuse-packed"): 2048.4,
             ("T64_l2_fwd+bwd", "dsfuse-split"): 2560.6}  # flashqla has no fwd+bwd row
    memory = [dict(case=c, mode=c.split("_")[-1], provider=p, peak_mib=v, retained_mib=0.0)
              for (c, p), v in peaks.items()]
    lines = gdn.report_extra(_synthetic_run(tmp_path / "with", memory))
    headings = [line for line in lines if line.startswith("### ")]
    assert headings == ["### Packed views against plain split views", "### Extra peak memory", "### FLOPs"]
    start = lines.index("### Extra peak memory")
    assert "torch.cuda.max_memory_allocated" in lines[start + 2] and "`bwd`" in lines[start + 2]
    table = lines[start + 4].splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    assert cells[0] == ["case", "dsfuse-split", "flashqla", "dsfuse-packed", "fla"]
    assert cells[2:] == [["T64_l2_fwd", "100", "7", "100", "1234"],
                         ["T64_l2_fwd+bwd", "2561", "n/a", "2048", "4321"]]

    without = gdn.report_extra(_synthetic_run(tmp_path / "without", None))
    assert "### FLOPs" in without and not any("peak memory" in line.lower() for line in without)
