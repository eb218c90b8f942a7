"""Compact committed raw data: gzip every raw CSV and run-folder JUnit file of at least ``COMPACT_BYTES``
under ``experiments/*/raw/``.

    python scripts/compact_raw.py [--check]

A run folder's ``samples.csv`` (or ``tower_*.csv``) becomes ``samples.csv.gz``, byte-for-byte the
same CSV inside, with a fixed header (no name, no time), so compacting twice gives the same file.
The readers take either form (`dsfuse.bench.paths.raw_file`; a run's GPU test sessions,
``junit-gpu*.xml``, through `dsfuse.bench.paths.junit_files`). A fresh run writes plain CSVs;
compact it before committing, so the tree stays small enough to travel to the GPU machine with the
CuTe DSL runtime (see ``scripts/gpu_install_carry.sh``). ``--check``: list what would be compacted
and exit 1 if anything would.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernels"))

from dsfuse.bench.paths import COMPACT_BYTES  # noqa: E402

RUN_ID = re.compile(r"\d{8}-\d{6}-")


def candidates(root: Path = ROOT) -> list[Path]:
    """Plain raw CSVs and ``junit-gpu*.xml`` of run folders (``experiments/<op>/raw/[<subdir>/]<run-id>/``,
    ids ``YYYYMMDD-HHMMSS-...``: a config's ``raw_subdir`` and the probes' folders too) of at least
    `COMPACT_BYTES`; sweeps (``raw/tuning/``) and other folders keep their plain files."""
    found = [*root.glob("experiments/*/raw/**/*.csv"), *root.glob("experiments/*/raw/**/junit-gpu*.xml")]
    return sorted(p for p in found if RUN_ID.match(p.parent.name) and "tuning" not in p.relative_to(root).parts
                  and p.stat().st_size >= COMPACT_BYTES)


def compact(path: Path) -> Path:
    """Write ``path`` gzip-compressed beside it (mtime 0, no file name in the header), check it, remove ``path``."""
    data = path.read_bytes()
    out = path.with_name(path.name + ".gz")
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    if gzip.decompress(out.read_bytes()) != data:
        raise RuntimeError(f"{out}: does not decompress to {path}")
    path.unlink()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only list what would be compacted (exit 1 if any)")
    args = parser.parse_args(argv)
    todo = candidates()
    for path in todo:
        rel = path.relative_to(ROOT)
        if args.check:
            print(f"would compact {rel} ({path.stat().st_size} bytes)")
        else:
            out = compact(path)
            print(f"{rel}: {path.name} -> {out.name} ({out.stat().st_size} bytes)")
    return 1 if args.check and todo else 0


if __name__ == "__main__":
    raise SystemExit(main())
