"""scripts/ncu_backends.py: its table assigns each profiled kernel to the call that launched it."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ncu_backends", ROOT / "scripts" / "ncu_backends.py")
ncu_backends = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_backends)


def _csv_row(values) -> str:
    return ",".join(f'"{v}"' for v in values)


def test_render_splits_kernels_by_marker(tmp_path):
    """ncu's raw CSV (a units row under the header, thousands separators): kernels after the marker of
    grid k belong to call k of calls.txt; the markers are not rows; durations in us, bytes in MB."""
    head = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
            "Grid Size", "Device", "CC"]
    units = [""] * len(head) + ["ns", "byte", "byte", "%", "%", "%", "%", "register/thread", "", ""]

    def kernel(i, name, grid, ns):
        return _csv_row([i, 1, "python3", "h", name, 1, 7, "(128, 1, 1)", f"({grid}, 1, 1)", 0, "9.0", ns,
                         "1,048,576", "2,000,000", 80.5, 20.1, 60.2, 75.0, 40, grid, 128])

    lines = ["==PROF== Connected to process", _csv_row(head + ncu_backends.METRICS), _csv_row(units),
             kernel(0, "ncu_marker", 1, "2,000"), kernel(1, "_rope_bwd(int)", 1000, "36,500"),
             kernel(2, "ncu_marker", 2, "1,000"), kernel(3, "kernel_cutlass_kernel_dsfuseengram_gatecutedsl_Forward_object_at__tensorptrbf16_0", 500, "30,000"), kernel(4, "dw_sum", 10, "5,000")]
    (tmp_path / "ncu.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "calls.txt").write_text("first call\nsecond call\n")
    ncu_backends.render(tmp_path, tmp_path / "out.md")
    rows = [line for line in (tmp_path / "out.md").read_text().splitlines() if line.startswith("|")][2:]
    assert [r.split("|")[1].strip() for r in rows] == ["first call", "second call", "second call"]
    assert [r.split("|")[2].strip() for r in rows] == ["rope_bwd", "Forward (CuTe DSL)", "dw_sum"]
    first = [c.strip() for c in rows[0].split("|")]
    assert first[3:6] == ["36.5", "1", "2"]  # us, MB read, MB written


def test_render_reads_the_committed_compacted_profile(tmp_path):
    """The committed profile (`experiments/engram_gate/raw/ncu/...`) is stored compacted (``ncu.csv.gz``,
    ``scripts/compact_raw.py``): rendering it gives the table its plain CSV gave."""
    import gzip
    import shutil

    run = ROOT / "experiments" / "engram_gate" / "raw" / "ncu" / "20261201-023640-h200"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "ncu.csv").write_bytes(gzip.decompress((run / "ncu.csv.gz").read_bytes()))
    shutil.copy(run / "calls.txt", plain / "calls.txt")
    ncu_backends.render(run, tmp_path / "from-gz.md")
    ncu_backends.render(plain, tmp_path / "from-plain.md")
    rows = [[line for line in (tmp_path / name).read_text().splitlines() if line.startswith("|")]
            for name in ("from-gz.md", "from-plain.md")]
    assert rows[0] == rows[1] and len(rows[0]) > 3
