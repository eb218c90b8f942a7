"""Where the repository's experiment folders are, whatever the working directory.

The experiments read and write the repository's own folders: ``experiments/<op>/``
(configs, model geometry, raw runs, plots), ``results/`` (tables) and
``build/smoke/`` (smoke runs). Package code finds them through `repo_root`,
never through the current directory:

* ``DSFUSE_ROOT``, when set, names the repository root (for a copy of the
  package installed outside the checkout);
* otherwise the root is the checkout the package is imported from: the package
  lives at ``<repo>/kernels/dsfuse``.

Either way the root must hold an ``experiments/`` folder; if it does not,
`repo_root` raises `FileNotFoundError` saying how to set ``DSFUSE_ROOT``.

Relative paths written in configs (``model_config: experiments/<op>/model.yaml``)
and the defaults of package functions are relative to the repository root
(`repo_path`). A path typed on a command line is taken relative to the
current directory when it exists there, and otherwise relative to the
repository root (`cli_path`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV_VAR = "DSFUSE_ROOT"
DEFAULT_REPO_URL = "https://github.com/dsfuse/dsfuse"  # when mkdocs.yml names none
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # <repo>/kernels/dsfuse/bench/paths.py -> <repo>


def repo_root() -> Path:
    """The repository root (absolute): ``$DSFUSE_ROOT`` if set, else the checkout holding the package."""
    env = os.environ.get(ENV_VAR)
    root = Path(env).expanduser().resolve() if env else _PACKAGE_ROOT
    if not (root / "experiments").is_dir():
        if env:
            raise FileNotFoundError(f"{ENV_VAR}={env}: no experiments/ folder in {root}; "
                                    f"set {ENV_VAR} to the dsfuse repository root (the folder holding experiments/)")
        raise FileNotFoundError(f"dsfuse is imported from {Path(__file__).resolve().parents[1]}, which is not inside a "
                                f"repository checkout (no experiments/ folder in {root}); set {ENV_VAR} to the "
                                "dsfuse repository root (the folder holding experiments/)")
    return root


def repo_path(path: str | os.PathLike) -> Path:
    """``path`` if absolute, else ``path`` relative to the repository root (never the working directory)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else repo_root() / path


def cli_path(path: str | os.PathLike) -> Path:
    """A path given on a command line: relative to the working directory when it exists there, else to the root."""
    path = Path(path).expanduser()
    return path.resolve() if path.is_absolute() or path.exists() else repo_root() / path


def smoke_root() -> Path:
    """``<repo>/build/smoke``: where smoke runs (CPU, interpreter) write, apart from measured data."""
    return repo_root() / "build" / "smoke"


def relative(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root, as text, when it lies inside it (for generated files); else as is."""
    path = Path(path)
    try:
        return path.resolve().relative_to(repo_root()).as_posix()
    except ValueError:
        return path.as_posix()


def repo_url() -> str:
    """The repository's web address (``repo_url`` of mkdocs.yml, else `DEFAULT_REPO_URL`), no trailing slash."""
    try:
        text = (repo_root() / "mkdocs.yml").read_text()
    except OSError:
        text = ""
    found = re.search(r"^repo_url:\s*['\"]?([^'\"\s#]+)", text, flags=re.MULTILINE)
    return (found.group(1) if found else DEFAULT_REPO_URL).rstrip("/")


def raw_url(path: str | os.PathLike, branch: str = "main") -> str:
    """Web address of a repository folder (a raw run): ``<repo_url>/tree/<branch>/<path from the root>``."""
    return f"{repo_url()}/tree/{branch}/{relative(path)}"


def raw_file(run_dir: str | os.PathLike, name: str) -> Path:
    """``run_dir / name``, or its compacted form ``name + ".gz"`` where only that exists: committed raw
    CSVs above `COMPACT_BYTES` are stored gzip-compressed (``scripts/compact_raw.py``), and pandas
    reads either by the suffix."""
    path = Path(run_dir) / name
    gz = path.with_name(path.name + ".gz")
    return gz if not path.exists() and gz.exists() else path


COMPACT_BYTES = 16 * 1024  # raw CSVs and JUnit files at least this large are committed compressed (scripts/compact_raw.py)


def junit_files(run_dir: str | os.PathLike) -> list[Path]:
    """The GPU test sessions stored with a run: its ``junit-gpu*.xml``, plain or compacted (``.gz``), by name."""
    run_dir = Path(run_dir)
    return sorted([*run_dir.glob("junit-gpu*.xml"), *run_dir.glob("junit-gpu*.xml.gz")])


def junit_root(path: str | os.PathLike):
    """The parsed root element of a JUnit file, plain or gzip-compressed."""
    import gzip
    import xml.etree.ElementTree as ET

    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path) as f:
            return ET.parse(f).getroot()
    return ET.parse(path).getroot()
