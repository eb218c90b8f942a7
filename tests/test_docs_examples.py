"""Every code example a reader sees runs as written on a CPU machine: the ```python blocks of the README,
of every docs page and of every docstring the API pages render. Each block runs in a fresh process as a
single-rank job (so an example that starts a process group runs too), with the environment CI has.

Fragments that are not meant to run (recipes, math written as code) use ```py or ```text instead. An
example that needs CUDA (a CUDA Graph) starts with the line ``# needs CUDA`` and runs with the GPU tests."""

import ast
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def _blocks(text: str) -> list[str]:
    return [textwrap.dedent(m["body"]) for m in FENCE.finditer(text)]


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    return [doc for n in nodes if (doc := ast.get_docstring(n, clean=True))]


def examples() -> list[tuple[str, str]]:
    found = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        found += [(f"{page.relative_to(ROOT)}#{i}", code) for i, code in enumerate(_blocks(page.read_text()))]
    for module in sorted((ROOT / "kernels" / "dsfuse").rglob("*.py")):
        codes = [code for doc in _docstrings(module) for code in _blocks(doc)]
        found += [(f"{module.relative_to(ROOT)}#{i}", code) for i, code in enumerate(codes)]
    return found


EXAMPLES = examples()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_examples_are_found():
    names = {name.split("#")[0] for name, _ in EXAMPLES}
    assert {"README.md", "docs/ops/text_rope.md", "docs/ops/vision_rope.md", "docs/ops/engram_gate.md",
            "docs/ops/gdn.md"} <= names


CUDA_ONLY = "# needs CUDA"  # an example's first line when it cannot run on a CPU (a CUDA Graph): GPU tests run it


@pytest.mark.parametrize("name,code", [
    pytest.param(name, code, marks=pytest.mark.gpu) if code.startswith(CUDA_ONLY) else (name, code)
    for name, code in EXAMPLES], ids=[name for name, _ in EXAMPLES])
def test_example_runs(name, code, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "kernels"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{name} failed:\n{code}\n{done.stderr[-3000:]}"
