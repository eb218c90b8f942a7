"""Committed raw CSVs above a size are gzip-compressed (``scripts/compact_raw.py``) and every reader takes
either form (``dsfuse.bench.paths.raw_file``), so the tree stays small enough to travel to the GPU."""

import gzip
import importlib.util
from pathlib import Path

import pandas as pd

from dsfuse.bench import report
from dsfuse.bench.paths import COMPACT_BYTES, raw_file

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("compact_raw", ROOT / "scripts" / "compact_raw.py")
compact_raw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compact_raw)


def test_no_large_plain_raw_csv_is_committed():
    """A fresh run writes plain CSVs: compact them before committing (``python scripts/compact_raw.py``)."""
    assert compact_raw.candidates() == []


def test_compacted_csv_reads_as_the_plain_one_and_is_reproducible(tmp_path):
    run = tmp_path / "20261201-000000-h200"
    run.mkdir()
    frame = pd.DataFrame({"case": ["a"] * 5000, "us": [float(i) / 7 for i in range(5000)]})
    frame.to_csv(run / "samples.csv", index=False)
    plain = (run / "samples.csv").read_bytes()
    assert len(plain) >= COMPACT_BYTES and raw_file(run, "samples.csv") == run / "samples.csv"
    out = compact_raw.compact(run / "samples.csv")
    assert not (run / "samples.csv").exists() and raw_file(run, "samples.csv") == out
    assert gzip.decompress(out.read_bytes()) == plain
    pd.testing.assert_frame_equal(pd.read_csv(raw_file(run, "samples.csv")), frame)
    first = out.read_bytes()
    out.unlink()
    (run / "samples.csv").write_bytes(plain)
    assert compact_raw.compact(run / "samples.csv").read_bytes() == first  # no time or name in the header
    assert report.runs_of(tmp_path) == [run]  # a compacted run is still found


def test_run_folders_under_a_subfolder_of_raw_are_compacted_and_sweeps_are_not(tmp_path):
    """A config's ``raw_subdir`` (``raw/backward_controls/<run-id>/``) and the probes' folders hold runs
    too; ``raw/tuning/`` holds sweeps, which stay plain."""
    big = "x" * COMPACT_BYTES
    paths = {name: tmp_path / "experiments" / "gdn" / "raw" / name for name in (
        "20261201-000000-h200/samples.csv", "backward_controls/20261201-000000-h200/samples.csv",
        "fused-backward/20261201-000000-h200-probe/samples.csv", "tuning/20261201-000000-h200/sweep.csv",
        "notes/samples.csv")}
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(big)
    (tmp_path / "experiments" / "gdn" / "raw" / "backward_controls" / "20261201-000000-h200" / "small.csv").write_text("a\n")
    assert compact_raw.candidates(tmp_path) == sorted(paths[name] for name in (
        "20261201-000000-h200/samples.csv", "backward_controls/20261201-000000-h200/samples.csv",
        "fused-backward/20261201-000000-h200-probe/samples.csv"))


def test_a_compacted_junit_file_summarises_as_the_plain_one(tmp_path):
    """A run's GPU test sessions (``junit-gpu*.xml``) above the size are compacted too; the report reads
    both forms the same, and the status table still counts the session."""
    from dsfuse.bench import status

    run = tmp_path / "experiments" / "gdn" / "raw" / "20261201-000000-h200"
    run.mkdir(parents=True)
    cases = "".join(f'<testcase classname="tests.gdn.test_gdn_api" name="t{i}" time="0.1"/>' for i in range(900))
    failed = '<testcase classname="tests.gdn.test_gdn_api" name="bad"><failure message="x"/></testcase>'
    (run / "junit-gpu.xml").write_text(f'<testsuites><testsuite name="pytest" timestamp="2026-12-01T00:00:00">'
                                       f'{cases}{failed}</testsuite></testsuites>')
    assert (run / "junit-gpu.xml").stat().st_size >= COMPACT_BYTES
    plain = (report.junit_section(run, "gdn"), report._junit_counts(run, "gdn"))
    assert "900 passed, 1 failed" in plain[0][0] and plain[1] == "1 session, 1 failed"
    assert compact_raw.candidates(tmp_path) == [run / "junit-gpu.xml"]
    compact_raw.compact(run / "junit-gpu.xml")
    assert [p.name for p in run.iterdir()] == ["junit-gpu.xml.gz"]
    packed = (report.junit_section(run, "gdn"), report._junit_counts(run, "gdn"))
    assert packed == ([plain[0][0].replace("junit-gpu.xml", "junit-gpu.xml.gz"), ""], plain[1])
    assert status._gpu_tests(tmp_path, "gdn", [run], None) == "1 session(s) with the run"
