"""experiments/gdn/ncu_sass_summary.py: Nsight Compute's SASS page summed per stretch between CTA
barriers (the barrier counted with the stretch it ends) and per opcode, predicates stripped."""

import gzip
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ncu_sass_summary", ROOT / "experiments" / "gdn" / "ncu_sass_summary.py")
ncu_sass_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_sass_summary)


def test_stretches_and_opcodes(tmp_path):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
              "stall_short_sb", "stall_barrier (Not Issued)"]
    rows = [("0x0", "LDG.E R2, [R4]", 10, 100, 0, 0, 0),
            ("0x1", "BAR.SYNC.DEFER_BLOCKING 0x0", 30, 20, 30, 0, 0),
            ("0x2", "@!P0 HMMA.16816.F32.BF16 R8, R4, R2, R8", 50, 440, 0, 40, 0),
            ("0x3", "HMMA.16816.F32.BF16 R12, R4, R2, R12", 10, 440, 0, 10, 0)]
    lines = ['"Kernel Name","k"', ",".join(f'"{h}"' for h in header)]
    lines += [",".join(f'"{v}"' for v in row) for row in rows]
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")

    df = ncu_sass_summary.read(path)
    assert list(df["opcode"]) == ["LDG", "BAR", "HMMA", "HMMA"]
    assert list(df["stretch"]) == [0, 0, 1, 1]  # the barrier closes the first stretch
    text = ncu_sass_summary.summary(df)
    assert "| 1 | 0-1 | 40.0% | 12.0% |" in text and "| 2 | 2-3 | 60.0% | 88.0% |" in text
    assert "| HMMA | 60.0% | 88.0% | short_sb 100% |" in text and "barrier 100%" in text
