"""env.json: what a run ran on."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

PACKAGES = ("torch", "triton", "nvidia-cutlass-dsl", "fla-core", "liger-kernel", "numpy")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        root = Path(__file__).resolve().parents[3]
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


def collect(device: torch.device) -> dict:
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
    return env
