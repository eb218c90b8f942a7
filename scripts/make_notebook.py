"""Write notebooks/<op>.ipynb from the one template every op's notebook follows.

    python scripts/make_notebook.py text_rope "Text RoPE"

The notebook reruns the op's experiment on the GPU it finds (a smoke run on CPU
without one), regenerates the op's tables and plots, and displays them. Its
first code cell holds the parameters (SMOKE, CONFIG); it is stored without outputs.
Regenerating an existing notebook keeps its cell ids, so only changed text shows in the diff.
"""

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]


def make(op: str, title: str) -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(f"""# {title}: rerun the experiment

Reruns `experiments/{op}/` on the GPU this kernel finds, with that GPU's config
(`experiments/{op}/configs/<gpu>.yaml`: `h200.yaml` on an H200, `b200.yaml` on a B200; another GPU
needs `CONFIG`), writes a new raw run under `experiments/{op}/raw/<run-id>/`, regenerates this GPU's
`results/<gpu>/{op}.md` and plots (no other GPU's files), and shows them.
Without a CUDA GPU it runs the **smoke** configuration instead: Triton in its interpreter on tiny
shapes, every provider still checked, outputs under `build/smoke/`. Smoke numbers measure nothing.

Run it after `bash scripts/setup.sh` (kernel: the `.venv` Python); it finds the repository's folders
itself (`dsfuse.bench.paths.repo_root`), whatever the working directory."""),
        new_code_cell(f"""# Parameters
SMOKE = None   # None: smoke run exactly when no CUDA GPU is present; True/False to force
CONFIG = None  # None: the GPU's experiments/{op}/configs/<gpu>.yaml (h200.yaml, b200.yaml), or configs/smoke.yaml""",
                      metadata={"tags": ["parameters"]}),
        new_code_cell("""import os

import torch

from dsfuse.bench.paths import repo_root

root = repo_root()  # experiments/, results/ and build/ are found from here, not from the working directory
smoke = (not torch.cuda.is_available()) if SMOKE is None else SMOKE
if smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is launched
print(f"repository: {root}; mode: {'SMOKE (CPU interpreter)' if smoke else torch.cuda.get_device_name()}")"""),
        new_code_cell(f"""from dsfuse.bench.__main__ import report, run
from dsfuse.bench.report import run_gpu

run_dir = run("{op}", CONFIG, smoke)
gpu = run_gpu(run_dir)  # results/<gpu>/: this GPU's folder, named from the run's env.json
written = report("{op}", smoke, gpus={{gpu}})"""),
        new_code_cell(f"""from IPython.display import Image, Markdown, display

display(Markdown(next(p for p in written if p.name == "{op}.md").read_text()))
for plot in (p for p in written if p.suffix == ".png"):
    display(Image(filename=str(plot)))"""),
    ]
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    path = ROOT / "notebooks" / f"{op}.ipynb"
    if path.exists():  # keep the cell ids of the stored notebook
        old = nbformat.read(path, as_version=4)
        if len(old.cells) == len(cells):
            for new, prev in zip(nb.cells, old.cells):
                if "id" in prev:
                    new.id = prev.id
    return nb


if __name__ == "__main__":
    op, title = sys.argv[1], sys.argv[2]
    nbformat.write(make(op, title), ROOT / "notebooks" / f"{op}.ipynb")
