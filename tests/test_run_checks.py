"""A run's checks decide its exit status: the bench CLI, the notebooks and their runner, as a new user
runs them (fresh processes, ``TRITON_INTERPRET`` unset: the CLI and the notebook choose the
interpreter themselves, after dsfuse is imported or before it, and the kernels must pass either way)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from dsfuse.bench import checks
from dsfuse.bench.harness import write_csv

ROOT = Path(__file__).resolve().parents[1]


def _fresh_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "kernels")
    return env


@pytest.fixture(scope="module")
def tiny_text_rope_config(tmp_path_factory) -> Path:
    """The text RoPE smoke config cut to one forward and one fwd+bwd case of the q tensor: the same code
    path as the smoke run (every provider checked), a fraction of its interpreter time."""
    config = yaml.safe_load((ROOT / "experiments/text_rope/configs/smoke.yaml").read_text())
    config.update(tensors=["q"], timing={"blocks": 1, "samples": 1})
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _bench(config: Path, plant: str = "") -> subprocess.CompletedProcess:
    """``python -m dsfuse.bench run --smoke text_rope`` in a fresh process, ``plant`` run first (after
    choosing the interpreter: the plant imports kernel modules, and Triton keeps the mode of import)."""
    choose = 'import os; os.environ["TRITON_INTERPRET"] = "1"' if plant else ""
    code = textwrap.dedent(f"""
        import sys
        {choose}
        {plant}
        from dsfuse.bench.__main__ import main
        sys.exit(main(["run", "--smoke", "text_rope", "--config", {str(config)!r}]))
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_fresh_env(), capture_output=True, text=True,
                          timeout=600)


def _validation(tmp_path: Path, rows: list[tuple[str, str, str]]) -> Path:
    write_csv(tmp_path / "validation.csv", [
        dict(case=f"c{i}", mode="fwd", provider=p, role=role, form="", check="bitwise", stage="before", status=status,
             mismatches="", max_abs_diff="", error="boom" if status == "fail" else "")
        for i, (p, role, status) in enumerate(rows)])
    return tmp_path


def test_summary_statuses(tmp_path):
    run_dir = _validation(tmp_path, [
        ("dsfuse", "candidate", "pass"), ("dsfuse", "candidate", "n/a"),
        ("dsfuse-split", "candidate", "pass"), ("dsfuse-split", "candidate", "fail"),
        ("fla", "control", "fail"), ("eager", "control", "pass"), ("liger", "control", "n/a")])
    rows = {r["provider"]: r for r in checks.summarize("op", run_dir)}
    assert {p: r["status"] for p, r in rows.items()} == {
        "dsfuse": "passed", "dsfuse-split": "FAILED", "fla": "flagged", "eager": "passed", "liger": "n/a"}
    assert rows["dsfuse"]["checks"] == "1/1" and rows["dsfuse-split"]["checks"] == "1/2"
    assert "boom" in rows["dsfuse-split"]["first_failure"]
    text = checks.render(list(rows.values()))
    assert "FAILED: 1 dsfuse provider(s)" in text and "op/dsfuse-split" in text and "op/fla" in text
    with pytest.raises(checks.ChecksFailed, match="op/dsfuse-split"):
        checks.require_passed("op", run_dir)


def test_summary_passes_with_flagged_control_only(tmp_path):
    run_dir = _validation(tmp_path, [("dsfuse", "candidate", "pass"), ("fla", "control", "fail")])
    rows = checks.require_passed("op", run_dir)
    assert checks.failures(rows) == []
    assert "every dsfuse provider passed" in checks.render(rows)


def test_summary_of_whole_tower(tmp_path):
    run_dir = _validation(tmp_path, [("dsfuse", "candidate", "pass")])
    write_csv(run_dir / "tower_validation.csv", [dict(geometry="g", bank="b", bitwise_equal=True, max_abs_diff=0.0),
                                                 dict(geometry="h", bank="b", bitwise_equal=False, max_abs_diff=1.0)])
    assert checks.failures(checks.summarize("vision_rope", run_dir)) == ["vision_rope/dsfuse (whole tower)"]


@pytest.mark.slow
def test_cli_smoke_run_checks_dsfuse_kernels(tiny_text_rope_config):
    """The kernels run under the interpreter although the CLI sets it after importing them."""
    done = _bench(tiny_text_rope_config)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.split("Checks of this run")[1]
    assert "FAILED" not in summary and "every dsfuse provider passed its checks" in summary
    rows = {ln.split()[1]: ln.split()[2:5] for ln in summary.splitlines() if ln.startswith("text_rope ")}
    assert rows["dsfuse"] == ["candidate", "4/4", "passed"]  # 2 cases x (before, after-eager)
    assert rows["dsfuse-inplace"] == ["candidate", "2/2", "passed"]  # forward only


@pytest.mark.slow
def test_cli_planted_wrong_result_fails_the_run(tiny_text_rope_config):
    plant = ("import dsfuse.text_rope.triton.kernels as k; _launch = k.launch_rope; "
             "k.launch_rope = lambda *a, **kw: _launch(*a, **kw).add_(1.0)")
    done = _bench(tiny_text_rope_config, plant)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: 2 dsfuse provider(s) failed their checks: text_rope/dsfuse, text_rope/dsfuse-inplace" in done.stdout


@pytest.mark.slow
def test_cli_planted_wrong_control_is_flagged(tiny_text_rope_config):
    plant = ("import dsfuse.bench.text_rope as b; _ref = b.rope_reference_inplace; "
             "b.rope_reference_inplace = lambda *a, **k: _ref(*a, **k).add_(1.0)")
    done = _bench(tiny_text_rope_config, plant)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "flagged controls (not used as baselines): text_rope/eager-inplace" in done.stdout


@pytest.mark.slow
def test_notebook_smoke_run_checks_dsfuse_kernels(tiny_text_rope_config):
    done = subprocess.run([sys.executable, "scripts/run_notebooks.py", "--smoke", "--param",
                           f"CONFIG = {str(tiny_text_rope_config)!r}", "notebooks/text_rope.ipynb"],
                          cwd=ROOT, env=_fresh_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "executed notebooks/text_rope.ipynb (smoke)" in done.stdout


def test_notebook_runner_fails_on_a_failing_cell(tmp_path):
    import nbformat  # here, not at import: the GPU machine collects this module without the notebook tools

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("SMOKE = None", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("from dsfuse.bench.checks import ChecksFailed\n"
                                  "assert SMOKE is True\nraise ChecksFailed('planted: op/dsfuse')"),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path = tmp_path / "planted.ipynb"
    nbformat.write(nb, path)
    done = subprocess.run([sys.executable, "scripts/run_notebooks.py", "--smoke", str(path)], cwd=ROOT,
                          env=_fresh_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "planted: op/dsfuse" in done.stderr and "1 notebook(s) failed" in done.stderr


def test_every_notebook_ends_its_run_with_the_check():
    import nbformat

    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        sources = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        assert any(f'require_passed("{path.stem}", run_dir)' in s for s in sources), path.name


def test_cli_cases_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """``--cases`` selects the cases of one op's config: with two ops named, the parser refuses it;
    an empty selection (``--cases ,``) is refused by the harness, not read as the whole config; no run
    folder is made either way."""
    from dsfuse.bench import __main__ as cli

    made = []
    monkeypatch.setattr(cli, "raw_root", lambda raw, config: made.append(raw) or tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli.main(["run", "--smoke", "text_rope", "gdn", "--cases", "T1_fwd"])
    assert stop.value.code == 2 and "exactly one op" in capsys.readouterr().err
    with pytest.raises(ValueError, match="non-empty list"):
        cli.main(["run", "--smoke", "text_rope", "--cases", " , "])
    assert not list(tmp_path.iterdir())
