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


# Triton's interpreter is chosen before dsfuse is imported; dsfuse's kernels also read the mode at
# each launch (dsfuse._common.triton_jit), so the order could not break the run either way.
SETUP = """import os

import torch

smoke = (not torch.cuda.is_available()) if SMOKE is None else SMOKE
if smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels run in the interpreter on CPU tensors

from dsfuse.bench.paths import repo_root  # noqa: E402

root = repo_root()  # experiments/, results/ and build/ are found from here, not from the working directory
print(f"repository: {root}; mode: {'SMOKE (CPU interpreter)' if smoke else torch.cuda.get_device_name()}")"""


def check_cell(op: str) -> str:
    """The cell that fails the notebook (and scripts/run_notebooks.py, and CI) when a dsfuse provider
    failed a check of the run."""
    return f"""from dsfuse.bench.checks import require_passed

require_passed("{op}", run_dir)  # every provider's checks; raises when a dsfuse provider failed one"""


# What an op's notebook adds to the common introduction and cells.
EXTRA_INTRO = {
    "gdn": """ On a GPU it also times each Triton stage and
measures each provider's peak memory (`experiments/gdn/stage_times.py`, into the run's `stages/`
folder) and renders `results/<gpu>/gdn_stages.md`.""",
}
EXTRA_CELLS = {
    "gdn": [new_code_cell("""import subprocess
import sys

if not smoke:  # which stage takes what share (CUDA Graph, L2 evicted), and each provider's peak memory
    stages = run_dir / "stages"
    script = root / "experiments" / "gdn" / "stage_times.py"
    subprocess.run([sys.executable, str(script), str(stages)], check=True)
    table = root / "results" / gpu / "gdn_stages.md"
    subprocess.run([sys.executable, str(script), "--render", str(stages), str(table)], check=True)
    display(Markdown(table.read_text()))""")],
}


def make(op: str, title: str) -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(f"""# {title}: rerun the experiment

Reruns `experiments/{op}/` on the GPU this kernel finds, with that GPU's config
(`experiments/{op}/configs/<gpu>.yaml`: `h200.yaml` on an H200, `b200.yaml` on a B200; another GPU
needs `CONFIG`), writes a new raw run under `experiments/{op}/raw/<run-id>/`, regenerates this GPU's
`results/<gpu>/{op}.md` and plots (no other GPU's files), and shows them.{EXTRA_INTRO.get(op, "")}
Without a CUDA GPU it runs the **smoke** configuration instead: Triton in its interpreter on tiny
shapes, every provider still checked, outputs under `build/smoke/`. Smoke numbers measure nothing.

Run it after `bash scripts/setup.sh` (kernel: the `.venv` Python); it finds the repository's folders
itself (`dsfuse.bench.paths.repo_root`), whatever the working directory."""),
        new_code_cell(f"""# Parameters
SMOKE = None   # None: smoke run exactly when no CUDA GPU is present; True/False to force
CONFIG = None  # None: the GPU's experiments/{op}/configs/<gpu>.yaml (h200.yaml, b200.yaml), or configs/smoke.yaml""",
                      metadata={"tags": ["parameters"]}),
        new_code_cell(SETUP),
        new_code_cell(f"""from dsfuse.bench.__main__ import report, run
from dsfuse.bench.report import run_gpu

run_dir = run("{op}", CONFIG, smoke)
gpu = run_gpu(run_dir)  # results/<gpu>/: this GPU's folder, named from the run's env.json
written = report("{op}", smoke, gpus={{gpu}})"""),
        new_code_cell(f"""from IPython.display import Image, Markdown, display

display(Markdown(next(p for p in written if p.name == "{op}.md").read_text()))
for plot in (p for p in written if p.suffix == ".png"):
    display(Image(filename=str(plot)))"""),
        new_code_cell(check_cell(op)),
        *EXTRA_CELLS.get(op, []),
    ]
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    path = ROOT / "notebooks" / f"{op}.ipynb"
    if path.exists():  # keep the cell ids of the stored notebook: same source, else same place
        old = nbformat.read(path, as_version=4)
        by_source = {c.source: c.id for c in old.cells if "id" in c}
        unmatched = [new for new in nb.cells if new.source not in by_source]
        for new in nb.cells:
            new.id = by_source.get(new.source, new.id)
        used = {new.id for new in nb.cells}
        for i, new in enumerate(nb.cells):
            if new in unmatched and i < len(old.cells) and old.cells[i].get("id") not in used:
                new.id = old.cells[i].id
                used.add(new.id)
    return nb


if __name__ == "__main__":
    op, title = sys.argv[1], sys.argv[2]
    nbformat.write(make(op, title), ROOT / "notebooks" / f"{op}.ipynb")
