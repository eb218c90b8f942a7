"""env.json: what a run ran on, and whether the kernels it measured are still the current source.

* `collect`: the run's environment (GPU, driver, CUDA, package versions, commit, date) and,
  for an op, ``kernel_sources``: the sha256 of the files that determine its kernels
  (`kernel_files`).
* `gpu_key`: the folder name of a GPU, derived from its device name (``"NVIDIA H200"`` ->
  ``h200``); results, plots and configs are found per GPU by this name, never typed.
* `source_state`: whether an op's kernel source changed since a run (by the recorded hash, else by
  comparing the code (docstrings aside) with the run's commit through git, as one collection of
  top-level definitions, so code moved between files is unchanged; ``unknown`` without either).
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

PACKAGES = ("torch", "triton", "nvidia-cutlass-dsl", "apache-tvm-ffi", "fla-core", "liger-kernel", "flash-qla",
            "tilelang", "numpy")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str | None]:
    """The version of each of `PACKAGES` this process imports (None: not installed)."""
    return {name: _version(name) for name in PACKAGES}


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


# environment variables that change how a run allocates, launches or chooses its kernels: env.json
# records those set (a run that needed expandable segments to fit says so)
RECORDED_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING", "TRITON_INTERPRET", "DSFUSE_REQUIRE_CUTEDSL")


def collect(device: torch.device, op: str | None = None) -> dict:
    """The environment of a run on ``device``; with ``op``, also the hash of its kernel sources."""
    env = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "variables": {name: os.environ[name] for name in RECORDED_VARIABLES if name in os.environ},
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


class _Tree:
    """The package's files in the working tree (``commit=None``) or at a commit (through git), as
    paths relative to the package directory."""

    def __init__(self, package_dir: Path, commit: str | None = None):
        self.package_dir, self.commit = package_dir, commit
        self.root = package_dir.parents[1]
        self._files: set[str] | None = None

    def files(self) -> set[str]:
        if self._files is None:
            if self.commit is None:
                self._files = {p.relative_to(self.package_dir).as_posix() for p in self.package_dir.rglob("*.py")}
            else:
                prefix = self.package_dir.relative_to(self.root).as_posix()
                listing = _git("ls-tree", "-r", "--name-only", self.commit, "--", prefix, root=self.root) or ""
                self._files = {name[len(prefix) + 1:] for name in listing.splitlines() if name.endswith(".py")}
        return self._files

    def read(self, name: str) -> str | None:
        if name not in self.files():
            return None
        if self.commit is None:
            return (self.package_dir / name).read_text()
        return _git("show", f"{self.commit}:{self.package_dir.relative_to(self.root).as_posix()}/{name}",
                    root=self.root)


def _module_file(module: str, tree: _Tree, packages: bool = False) -> str | None:
    """The file of module ``dsfuse.<...>``, if it is a module of the package (packages themselves,
    their ``__init__.py``, only with ``packages``: they gather the API, not the kernels)."""
    parts = module.split(".")
    if parts[0] != "dsfuse" or len(parts) < 2:
        return None
    name = "/".join(parts[1:])
    for candidate in (f"{name}.py", f"{name}/__init__.py") if packages else (f"{name}.py",):
        if candidate in tree.files():
            return candidate
    return None


def _imported_files(name: str, tree: _Tree, packages: bool = False) -> set[str]:
    """Package files named by the module-level imports of file ``name`` (``from dsfuse.x import y``
    names ``x`` and, when ``y`` is a module, ``x/y.py``; relative imports resolved from ``name``)."""
    source = tree.read(name)
    if source is None:
        return set()
    here = ".".join(("dsfuse",) + tuple(name.removesuffix(".py").split("/"))[:-1])
    found: set[str] = set()
    for node in ast.parse(source, filename=name).body:
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
        found |= {f for f in (_module_file(m, tree, packages) for m in modules if m) if f is not None}
    return found


def _backend_names(op: str) -> tuple[str, ...]:
    """The backends whose kernels ``op``'s calls can reach: those of its registry entry that serve a
    call (a backend with kernels only, one under construction, changes no measured number); every
    kind of the registry (``triton``, ``cutedsl``) for an op it does not know."""
    from dsfuse._common.backends import BACKENDS, load_all_ops

    entry = load_all_ops().get(op)
    return tuple(BACKENDS) if entry is None else tuple(t.backend for t in entry.tables if t.calls)


# imported by kernel modules for a flag or a predicate (interpreting(), addresses_known()), not kernel
# code: the backend registry and the argument checks change what is accepted or chosen, not a kernel.
# A backend package's ``__init__.py`` (its table for the registry) is not kernel code either.
# The AOT compile check (`_common/aot.py`, each kernel module's ``AOT_SPECS`` and its ``_aot_specs``
# builder) says which specialisations CI compiles without a GPU: it changes no launch either.
NOT_KERNEL_CODE = ("_common/backends.py", "_common/validation.py", "_common/aot.py")


def _aot_declaration(node: ast.stmt) -> bool:
    """``AOT_SPECS = ...`` or ``def _aot_specs(...)``: what the AOT check compiles, not kernel code."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == "_aot_specs"
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return any(isinstance(t, ast.Name) and t.id == "AOT_SPECS" for t in targets)


def _kernel_names(op: str, tree: _Tree, scope: str = "kernels") -> list[str]:
    """`kernel_files` of ``tree``, as paths relative to the package directory."""
    todo = []
    for backend in _backend_names(op):
        todo += sorted(n for n in tree.files() if n.startswith(f"{op}/{backend}/") and not n.endswith("/__init__.py"))
        todo += [f"{op}/{backend}.py"] if f"{op}/{backend}.py" in tree.files() else []
    skip = NOT_KERNEL_CODE
    if scope == "host":  # an eager call's path: the public function, its checks, the choice, the launch
        todo += [f"{op}/api.py"] if f"{op}/api.py" in tree.files() else []
        skip = ("_common/aot.py",)
    elif scope != "kernels":
        raise ValueError(f"scope: expected 'kernels' or 'host', got {scope!r}")
    names: set[str] = set()
    while todo:
        name = todo.pop()
        if name in names or name in skip:  # not code of the scope, nor what it imports
            continue
        names.add(name)
        todo += sorted(_imported_files(name, tree, packages=scope == "host") - names)
    return sorted(n for n in names if not n.endswith("/__init__.py"))


def kernel_files(op: str, package_dir: Path = PACKAGE_DIR, scope: str = "kernels") -> list[Path]:
    """The files that determine ``op``'s kernels, of every backend that serves a call: ``dsfuse/<op>/<backend>.py`` or
    every ``.py`` under ``dsfuse/<op>/<backend>/`` (``triton``, ``cutedsl``) but the package's
    ``__init__.py`` (its table for the registry), and, transitively, the package modules they
    import at module level (not the packages' ``__init__.py`` that Python runs on the way, nor
    ``NOT_KERNEL_CODE``). Sorted; empty for an unknown op. ``scope="host"``: what an eager call's
    host time depends on as well: the op's ``api.py`` and the package modules it imports (the
    checks, the backend choice and the launch path; the AOT check aside)."""
    return [package_dir / name for name in _kernel_names(op, _Tree(package_dir), scope)]


def kernel_sources(op: str, package_dir: Path = PACKAGE_DIR, scope: str = "kernels") -> dict:
    """``{"sha256": ..., "files": [...]}`` of `kernel_files` (paths relative to the repository)."""
    root = package_dir.parents[1]
    digest = hashlib.sha256()
    names = []
    for path in kernel_files(op, package_dir, scope):
        name = path.relative_to(root).as_posix()
        names.append(name)
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return {"sha256": digest.hexdigest(), "files": names}


SOURCES_KEY = {"kernels": "kernel_sources", "host": "host_sources"}  # where env.json records each scope's hash


def source_state(op: str, env: dict, package_dir: Path = PACKAGE_DIR, scope: str = "kernels") -> dict:
    """Whether the kernels a run measured are the current source.

    Returns ``state`` (``current``, ``changed`` or ``unknown``), ``how`` (``hash`` or ``git``),
    ``commit`` (the run's), ``files`` (the kernel files compared) and ``since`` (for ``git``: the
    commits that touched the differing files after the run's commit, newest first, and
    ``uncommitted`` when the working tree differs from HEAD there). A run that recorded
    ``kernel_sources`` of the same files with the current hash is current. Otherwise the op's
    kernel files at the run's commit are compared with the working tree's as code: every top-level
    statement but the imports, parsed, docstrings dropped, collected over the op's kernel files and
    sorted (an edit of prose alone, or code moved between files or renamed files, is not a kernel
    change); a run that hashed another set of files (a backend added since) is compared the same
    way. Without git (or the commit) a differing hash says ``changed``, no hash ``unknown``.
    ``scope="host"`` (a host-time run): the same over `kernel_files`' host scope.
    """
    root = package_dir.parents[1]
    commit = env.get("git_commit")
    now = kernel_sources(op, package_dir, scope)
    out = dict(state="unknown", how=None, commit=commit, files=now["files"], since=[], uncommitted=False, scope=scope)
    recorded = env.get(SOURCES_KEY[scope]) or {}
    same_files = bool(recorded.get("sha256")) and recorded.get("files") == now["files"]
    if same_files and recorded["sha256"] == now["sha256"]:
        out.update(how="hash", state="current")
        return out
    if not commit or not now["files"] or _git("cat-file", "-e", f"{commit}^{{commit}}", root=root) is None:
        if same_files:
            out.update(how="hash", state="changed")
        return out
    out["how"] = "git"
    then_tree, now_tree = _Tree(package_dir, commit), _Tree(package_dir)
    then = {name: _definitions(then_tree.read(name)) for name in _kernel_names(op, then_tree, scope)}
    current = {name: _definitions(now_tree.read(name)) for name in _kernel_names(op, now_tree, scope)}
    all_then = sorted(d for defs in then.values() for d in defs)
    all_now = sorted(d for defs in current.values() for d in defs)
    if all_then == all_now:  # a tree with uncommitted changes at the run: the commit is not all it measured
        out["state"] = "unknown" if env.get("git_dirty") else "current"
        return out
    out["state"] = "changed"
    only_then, only_now = set(all_then) - set(all_now), set(all_now) - set(all_then)
    if not (only_then or only_now):  # the same definitions, another count of one of them
        only_then, only_now = set(all_then), set(all_now)
    prefix = package_dir.relative_to(root).as_posix()
    differ = sorted({f"{prefix}/{name}" for name, defs in then.items() if only_then & set(defs)}
                    | {f"{prefix}/{name}" for name, defs in current.items() if only_now & set(defs)})
    out["differ"] = differ
    log = _git("log", "--format=%h", f"{commit}..HEAD", "--", *differ, root=root)
    out["since"] = log.split() if log else []
    out["uncommitted"] = bool(_git("status", "--porcelain", "--", *differ, root=root))
    return out


def _definitions(source: str | None) -> list[str]:
    """The code of a module's top-level statements but its imports and docstring, one string each
    (docstrings and comments dropped, positions not recorded: a definition moved to another file or
    line reads the same)."""
    if source is None:
        return []
    tree = _strip_docstrings(ast.parse(source))
    return [ast.dump(node) for node in tree.body
            if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)) and not _aot_declaration(node)]


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _code(source: str) -> str:
    """A module's code without its docstrings (and comments, which the parser drops)."""
    return ast.dump(_strip_docstrings(ast.parse(source)))
