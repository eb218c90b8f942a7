"""Execute every notebook (``notebooks/*.ipynb``) from the repository root.

    python scripts/run_notebooks.py --smoke      # CI: parameters cell replaced by SMOKE = True
    python scripts/run_notebooks.py              # the notebooks' own parameters (GPU when present)
    python scripts/run_notebooks.py --smoke --param 'CONFIG="my.yaml"' notebooks/text_rope.ipynb

A notebook fails when a cell raises: its last check cell raises when a dsfuse provider failed a
check of the run (dsfuse.bench.checks). The runner then names the notebook and exits with status 1.

Outputs are not written back: notebooks are stored without outputs.
"""

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="inject SMOKE = True into the parameters cell")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=EXPR",
                        help="a line appended to the parameters cell (repeatable)")
    parser.add_argument("notebooks", nargs="*", type=Path, default=sorted((ROOT / "notebooks").glob("*.ipynb")))
    args = parser.parse_args()
    injected = (["SMOKE = True"] if args.smoke else []) + args.param
    failed = []
    for path in (p.resolve() for p in args.notebooks):
        nb = nbformat.read(path, as_version=4)
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        if injected:
            cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
            if not cells:
                raise SystemExit(f"{path}: no cell tagged 'parameters'")
            cells[0].source += "".join(f"\n{line}  # injected by scripts/run_notebooks.py" for line in injected)
        try:
            NotebookClient(nb, timeout=1800, kernel_name="python3",
                           resources={"metadata": {"path": str(ROOT)}}).execute()
        except CellExecutionError as exc:  # the others still run; the exit status says it failed
            failed.append(str(shown))
            print(f"FAILED {shown}: {exc}", file=sys.stderr)
            continue
        print(f"executed {shown}" + (" (smoke)" if args.smoke else ""))
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
