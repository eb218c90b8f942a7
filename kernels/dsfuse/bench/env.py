"""env.json: what a run ran on, and whether the kernels it measured are still the current source.

* :func:`collect`: the run's environment (GPU, driver, CUDA, package versions, commit, date) and,
  for an op, ``kernel_sources``: the sha256 of the files that determine its kernels
  (:func:`kernel_files`).
* :func:`gpu_key`: the folder name of a GPU, derived from its device name (``"NVIDIA H200"`` ->
  ``h200``); results, plots and configs are found per GPU by this name, never typed.
* :func:`source_state`: whether an op's kernel source changed since a run (by the recorded hash,
  else by comparing the code (docstrings aside) with the run's commit through git; ``unknown`` without either).
"""

from __future__ import annotations

import ast
import datetime as dt
import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # <repo>/kernels/dsfuse

PACKAGES = ("torch", "triton", "nvidia-cutlass-dsl", "fla-core", "liger-kernel", "numpy")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str, root: Path | None = None) -> str | None:
    try:
        root = root or Path(__file__).resolve().parents[3]
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=20,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def collect(device: torch.device, op: str | None = None) -> dict:
    """The environment of a run on ``device``; with ``op``, also the hash of its kernel sources."""
    env = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "device": str(device),
    }
    # A copy of the tree sent to another machine may carry no .git, or a stale one: the
    # commit passed in DSFUSE_GIT_COMMIT wins over what git reports there.
    given = os.environ.get("DSFUSE_GIT_COMMIT")
    env.update(
        git_commit=given or _git("rev-parse", "HEAD"),
        git_dirty=None if given else bool(_git("status", "--porcelain", "--untracked-files=no")),
        git_commit_source="DSFUSE_GIT_COMMIT" if given else "git",
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu_name=props.name,
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_cache_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            driver=_driver(),
        )
    else:
        env.update(gpu_name=None, cpu=platform.processor() or platform.machine())
    if op is not None and kernel_files(op):
        env["kernel_sources"] = kernel_sources(op)
    return env


# -- the GPU's folder name -------------------------------------------------------------------


def gpu_key(gpu_name: str | None) -> str:
    """Folder name of a GPU from its device name: ``"NVIDIA H200"`` -> ``h200``, ``"NVIDIA B200"`` ->
    ``b200``, ``"NVIDIA H200 NVL"`` -> ``h200-nvl``; no GPU (``None``: a CPU smoke run) -> ``cpu``."""
    if not gpu_name:
        return "cpu"
    name = re.sub(r"^nvidia\s+", "", gpu_name.strip(), flags=re.IGNORECASE).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown-gpu"


# -- the kernel sources of an op and whether they changed since a run ------------------------


def _module_file(module: str, package_dir: Path) -> Path | None:
    """The file of module ``dsfuse.<...>``, if it is a module of the package (packages themselves,
    their ``__init__.py``, are not followed: they gather the API, not the kernels)."""
    parts = module.split(".")
    if parts[0] != "dsfuse" or len(parts) < 2:
        return None
    path = package_dir.joinpath(*parts[1:]).with_suffix(".py")
    return path if path.is_file() else None


def _imported_files(path: Path, package_dir: Path) -> set[Path]:
    """Package files named by the module-level imports of ``path`` (``from dsfuse.x import y`` names
    ``x`` and, when ``y`` is a module, ``x/y.py``; relative imports resolved from ``path``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = ".".join(("dsfuse",) + path.relative_to(package_dir).with_suffix("").parts[:-1])
    found: set[Path] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            modules = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {f for f in (_module_file(m, package_dir) for m in modules if m) if f is not None}
    return found


BACKEND_MODULES = ("triton", "cutedsl")  # the kernel modules of an op, one per backend
# imported by kernel modules for a flag or a predicate (interpreting(), addresses_known()), not kernel
# code: the backend registry and the argument checks change what is accepted or chosen, not a kernel
NOT_KERNEL_CODE = ("_common/backends.py", "_common/validation.py")


def kernel_files(op: str, package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The files that determine ``op``'s kernels, of every backend: ``dsfuse/<op>/<backend>.py`` or
    every ``.py`` under ``dsfuse/<op>/<backend>/`` (``triton``, ``cutedsl``), and, transitively, the
    package modules they import at module level (not the packages' ``__init__.py`` that Python runs
    on the way, nor ``NOT_KERNEL_CODE``). Sorted; empty for an unknown op."""
    op_dir = package_dir / op
    todo = []
    for backend in BACKEND_MODULES:
        todo += sorted(op_dir.glob(f"{backend}/**/*.py"))
        todo += [op_dir / f"{backend}.py"] if (op_dir / f"{backend}.py").is_file() else []
    files: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in files:
            continue
        files.add(path)
        todo += sorted(_imported_files(path, package_dir) - files)
    skip = {package_dir / name for name in NOT_KERNEL_CODE}
    return sorted(files - skip)


def kernel_sources(op: str, package_dir: Path = PACKAGE_DIR) -> dict:
    """``{"sha256": ..., "files": [...]}`` of :func:`kernel_files` (paths relative to the repository)."""
    root = package_dir.parents[1]
    digest = hashlib.sha256()
    names = []
    for path in kernel_files(op, package_dir):
        name = path.relative_to(root).as_posix()
        names.append(name)
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return {"sha256": digest.hexdigest(), "files": names}


def source_state(op: str, env: dict, package_dir: Path = PACKAGE_DIR) -> dict:
    """Whether the kernels a run measured are the current source.

    Returns ``state`` (``current``, ``changed`` or ``unknown``), ``how`` (``hash`` or ``git``),
    ``commit`` (the run's), ``files`` (the kernel files compared) and ``since`` (for ``git``: the
    commits that touched them after the run's commit, newest first, and ``uncommitted`` when the
    working tree differs from HEAD). A run that recorded ``kernel_sources`` of the same files with
    the current hash is current. Otherwise the files at the run's commit are compared with the
    working tree as code (``git show``, parsed, docstrings dropped: an edit of prose alone is not a
    kernel change); a run that hashed another set of files (a backend added since) is compared the
    same way. Without git (or the commit) a differing hash says ``changed``, no hash ``unknown``.
    """
    root = package_dir.parents[1]
    commit = env.get("git_commit")
    now = kernel_sources(op, package_dir)
    out = dict(state="unknown", how=None, commit=commit, files=now["files"], since=[], uncommitted=False)
    recorded = env.get("kernel_sources") or {}
    same_files = bool(recorded.get("sha256")) and recorded.get("files") == now["files"]
    if same_files and recorded["sha256"] == now["sha256"]:
        out.update(how="hash", state="current")
        return out
    if not commit or not now["files"] or _git("cat-file", "-e", f"{commit}^{{commit}}", root=root) is None:
        if same_files:
            out.update(how="hash", state="changed")
        return out
    out["how"] = "git"
    differ = [name for name in now["files"] if _code_at(commit, name, root) != _code((root / name).read_text())]
    if not differ:  # a tree with uncommitted changes at the run: the commit is not all it measured
        out["state"] = "unknown" if env.get("git_dirty") else "current"
        return out
    out["state"] = "changed"
    log = _git("log", "--format=%h", f"{commit}..HEAD", "--", *differ, root=root)
    out["since"] = log.split() if log else []
    out["uncommitted"] = bool(_git("status", "--porcelain", "--", *differ, root=root))
    return out


def _code_at(commit: str, name: str, root: Path) -> str | None:
    """The code of file ``name`` at ``commit`` (``None`` where it did not exist)."""
    source = _git("show", f"{commit}:{name}", root=root)
    return None if source is None else _code(source)


def _code(source: str) -> str:
    """A module's code without its docstrings (and comments, which the parser drops)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)
