"""Execute every notebook (``notebooks/*.ipynb``) from the repository root.

    python scripts/run_notebooks.py --smoke      # CI: parameters cell replaced by SMOKE = True
    python scripts/run_notebooks.py              # the notebooks' own parameters (GPU when present)

Outputs are not written back: notebooks are stored without outputs.
"""

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="inject SMOKE = True into the parameters cell")
    parser.add_argument("notebooks", nargs="*", type=Path, default=sorted((ROOT / "notebooks").glob("*.ipynb")))
    args = parser.parse_args()
    for path in (p.resolve() for p in args.notebooks):
        nb = nbformat.read(path, as_version=4)
        if args.smoke:
            cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
            if not cells:
                raise SystemExit(f"{path}: no cell tagged 'parameters'")
            cells[0].source += "\nSMOKE = True  # injected by scripts/run_notebooks.py --smoke\n"
        NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"executed {shown}" + (" (smoke)" if args.smoke else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
