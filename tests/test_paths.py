"""The experiment runner finds the repository's folders from any working directory.

``dsfuse.bench.paths.repo_root`` is the checkout the package is imported from, or
``$DSFUSE_ROOT``; configs, model geometry and output folders are found from it,
never from the current directory.
"""

import shutil
from pathlib import Path

import pytest
import yaml

from dsfuse.bench import paths

REPO = Path(__file__).resolve().parents[1]


def test_repo_root_is_the_checkout(monkeypatch):
    monkeypatch.delenv(paths.ENV_VAR, raising=False)
    assert paths.repo_root() == REPO
    assert paths.smoke_root() == REPO / "build" / "smoke"
    assert paths.repo_path("experiments/text_rope/model.yaml") == REPO / "experiments" / "text_rope" / "model.yaml"
    assert paths.repo_path(REPO / "x.yaml") == REPO / "x.yaml"  # absolute paths are kept
    assert paths.relative(REPO / "experiments" / "text_rope" / "raw") == "experiments/text_rope/raw"


def test_repo_root_honours_env(tmp_path, monkeypatch):
    (tmp_path / "experiments").mkdir()
    monkeypatch.setenv(paths.ENV_VAR, str(tmp_path))
    monkeypatch.chdir(REPO)  # the working directory does not matter
    assert paths.repo_root() == tmp_path.resolve()
    assert paths.smoke_root() == tmp_path.resolve() / "build" / "smoke"
    assert paths.repo_path("experiments/a.yaml") == tmp_path.resolve() / "experiments" / "a.yaml"


def test_repo_root_errors_name_the_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.ENV_VAR, str(tmp_path))  # no experiments/ there
    with pytest.raises(FileNotFoundError, match=paths.ENV_VAR):
        paths.repo_root()
    monkeypatch.delenv(paths.ENV_VAR)
    monkeypatch.setattr(paths, "_PACKAGE_ROOT", tmp_path)  # an installed copy outside any checkout
    with pytest.raises(FileNotFoundError, match=f"set {paths.ENV_VAR}"):
        paths.repo_root()


def test_cli_path_prefers_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(paths.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("a: 1\n")
    assert paths.cli_path("mine.yaml") == tmp_path.resolve() / "mine.yaml"
    assert paths.cli_path("experiments/text_rope/configs/smoke.yaml") == (
        REPO / "experiments" / "text_rope" / "configs" / "smoke.yaml")


def test_smoke_run_from_another_directory(tmp_path, monkeypatch):
    """``python -m dsfuse.bench run engram_gate --smoke`` (the quickest op's smoke run) from outside the
    repository: the default config, the model geometry it names (a path relative to the repository) and the
    output folder are the repository's."""
    from dsfuse.bench.__main__ import run

    monkeypatch.delenv(paths.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    run_dir = run("engram_gate", None, smoke=True)
    try:
        assert run_dir.is_absolute()
        assert run_dir.parent == REPO / "build" / "smoke" / "experiments" / "engram_gate" / "raw"
        written = yaml.safe_load((run_dir / "config.yaml").read_text())
        smoke = yaml.safe_load((REPO / "experiments" / "engram_gate" / "configs" / "smoke.yaml").read_text())
        assert written == smoke  # the default smoke config was found and used
        assert (run_dir / "samples.csv").exists() and (run_dir / "cases.csv").exists()
        assert list(tmp_path.iterdir()) == []  # nothing written to the working directory
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_gate_inputs_default_config_from_another_directory(tmp_path, monkeypatch):
    """The tuning scripts' inputs: the default config (h200.yaml) and its model geometry, from any directory."""
    import torch

    from dsfuse.bench.engram_gate import gate_inputs

    monkeypatch.delenv(paths.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    x, kv, weight, mask, dout, eps = gate_inputs(2, torch.device("cpu"))
    model = yaml.safe_load((REPO / "experiments" / "engram_gate" / "model.yaml").read_text())
    assert x.shape == (2, model["hc_mult"], model["hidden_size"])
    assert eps == model["rms_norm_eps"]
