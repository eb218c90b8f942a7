"""scripts/output_hashes.py on the CPU: record, check, a change, an entry without a recorded fingerprint
(an error unless told to record it), and GDN's outputs on a tiny shape."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "h200_output_fingerprints.json"
spec = importlib.util.spec_from_file_location("output_hashes", REPO / "scripts" / "output_hashes.py")
output_hashes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(output_hashes)


def _tiny(seed: int):
    def outputs(device):
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed)).to(device)
        return {"y": x * 2, "z": x.bfloat16()}
    return outputs


@pytest.fixture
def cases(monkeypatch):
    """The cases the script runs (instead of the registry's): ``{entry: outputs(device)}``."""
    cases = {"tiny": _tiny(0)}
    monkeypatch.setattr(output_hashes, "collect_cases", lambda names=None: dict(cases))
    return cases


def _main(capsys, *args) -> tuple[int, str]:
    code = output_hashes.main([*map(str, args), "--device", "cpu"])
    return code, capsys.readouterr().out


def test_record_check_and_a_change(tmp_path, cases, capsys):
    golden = tmp_path / "golden.json"
    assert _main(capsys, "--write", golden)[0] == 0
    assert json.loads(golden.read_text())["gpu"] == "cpu"
    code, out = _main(capsys, "--check", golden)
    assert code == 0 and "all 2 recorded fingerprints equal (cpu)" in out
    cases["tiny"] = _tiny(1)
    code, out = _main(capsys, "--check", golden)
    assert code == 1 and out.startswith("tiny/y: ") and "tiny/z: " in out


def test_an_entry_without_a_recorded_fingerprint_fails_unless_recorded(tmp_path, cases, capsys):
    golden = tmp_path / "golden.json"
    _main(capsys, "--write", golden)
    before = json.loads(golden.read_text())
    cases["tiny/new"] = _tiny(2)
    code, out = _main(capsys, "--check", golden)
    assert code == 1 and "tiny/new: no recorded entry" in out and "--record-missing" in out
    assert json.loads(golden.read_text()) == before  # a check alone never writes
    code, out = _main(capsys, "--check", golden, "--record-missing")
    assert code == 0 and "tiny/new: no recorded entry" in out and "recorded now" in out
    after = json.loads(golden.read_text())
    assert after["outputs"]["tiny"] == before["outputs"]["tiny"] and set(after["outputs"]["tiny/new"]) == {"y", "z"}
    assert _main(capsys, "--check", golden)[0] == 0


def test_fingerprints_of_another_gpu_are_not_compared(tmp_path, cases, capsys):
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps({"gpu": "NVIDIA H200", "torch": "x", "outputs": {"tiny": {"y": "0"}}}))
    code, out = _main(capsys, "--check", golden, "--record-missing")
    assert code == 0 and "not compared" in out and json.loads(golden.read_text())["outputs"] == {"tiny": {"y": "0"}}


def test_the_golden_file_names_only_registered_entries():
    """Each recorded entry is a case of an op with an experiment (so a check compares all of them)."""
    recorded = json.loads(GOLDEN.read_text())["outputs"]
    assert set(recorded) <= set(output_hashes.collect_cases())


def test_gdn_outputs_on_a_tiny_shape():
    """GDN's fingerprint case at 100 tokens in 2 documents (the reference backend on the CPU): the
    outputs and gradients of one forward+backward, named, shaped, and the same bits twice."""
    from dsfuse.bench import gdn

    def run():
        return gdn.fingerprint_outputs(torch.device("cpu"), tokens=100, documents=2, backend="reference")

    out = run()
    shapes = {name: list(t.shape) for name, t in out.items()}
    assert shapes == {"o": [1, 100, 48, 128], "final_state": [2, 48, 128, 128], "dq": [100, 16 * 128],
                      "dk": [100, 16 * 128], "dv": [100, 48 * 128], "dg": [1, 100, 48], "dbeta": [1, 100, 48],
                      "dh0": [2, 48, 128, 128]}
    assert all(torch.isfinite(t.float()).all() for t in out.values())
    assert {k: output_hashes.describe(t) for k, t in run().items()} == \
        {k: output_hashes.describe(t) for k, t in out.items()}
