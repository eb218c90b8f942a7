"""Results per GPU: folders named from env.json, citable runs, the staleness mark, the config
chosen by the GPU's name, the one ratio definition, and the figures the pages' prose quotes."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

from dsfuse.bench import env, experiments, report, tables
from dsfuse.bench.__main__ import check_flush, config_for

REPO = Path(__file__).resolve().parents[1]
H200_RUN = REPO / "experiments" / "text_rope" / "raw" / "20261129-073943-h200"
B200_L2 = 126 * 10**6


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _simulated_b200(raw: Path) -> str:
    """A copy of the committed H200 run, its env.json rewritten as a B200's (the B200 run of the tests)."""
    run_id = H200_RUN.name.replace("-h200", "-b200").replace("20261129", "20261130")
    shutil.copytree(H200_RUN, raw / run_id)
    path = raw / run_id / "env.json"
    data = json.loads(path.read_text())
    data["gpu_name"] = "NVIDIA B200"
    path.write_text(json.dumps(data))
    return run_id


def test_gpu_key_from_the_device_name():
    assert env.gpu_key("NVIDIA H200") == "h200" and env.gpu_key("NVIDIA B200") == "b200"
    assert env.gpu_key("NVIDIA H200 NVL") == "h200-nvl" and env.gpu_key("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert env.gpu_key(None) == "cpu"


def test_a_b200_run_renders_into_its_own_folder_and_leaves_the_h200_files_alone(tmp_path):
    raw, results, plots = tmp_path / "raw", tmp_path / "results", tmp_path / "plots"
    shutil.copytree(H200_RUN, raw / H200_RUN.name)
    report.render("text_rope", raw, results, plots, gpus={"h200"})
    h200_before = _files(results / "h200") | {f"plots/{k}": v for k, v in _files(plots / "h200").items()}
    assert set(h200_before) >= {"text_rope.md", "text_rope_runs.md", "text_rope.json", "plots/text_rope_fwd.png"}

    b200_run = _simulated_b200(raw)
    written = report.render("text_rope", raw, results, plots, gpus={"b200"})
    assert all("h200" not in p.relative_to(tmp_path).as_posix() for p in written)
    h200_after = _files(results / "h200") | {f"plots/{k}": v for k, v in _files(plots / "h200").items()}
    assert h200_after == h200_before  # same bytes, not even rewritten

    table = (results / "b200" / "text_rope.md").read_text()
    assert f'<a id="run-{b200_run}"></a>' in table and "### NVIDIA B200" in table and "NVIDIA H200" not in table
    assert f"raw/{b200_run}`" in table  # its raw folder (outside the checkout here: the path, not a link)
    assert (plots / "b200" / "text_rope_fwd.png").exists()
    assert json.loads((results / "b200" / "text_rope.json").read_text())["newest"] == b200_run
    index = (results / "text_rope_all_gpus.md").read_text()
    assert index.index("b200/text_rope.md") < index.index("h200/text_rope.md")  # every GPU, one include each
    assert "b200/text_rope_runs.md" in index and "h200/text_rope_runs.md" in index

    report.render("text_rope", raw, results, plots)  # all GPUs again: the H200's files do not change
    assert _files(results / "h200") == {k: v for k, v in h200_before.items() if not k.startswith("plots/")}


def test_runs_of_a_config_kept_apart_render_under_their_own_stem(tmp_path):
    """A run under ``raw/<sub>/`` whose config names ``raw_subdir: <sub>`` (GDN's long documents) gets
    ``<op>_<sub>.md``, ``_runs.md``, ``.json``, plots in ``plots/<gpu>/<sub>/`` and its own index; the
    op's own tables read only the op's own runs. A folder of runs without that config line is not
    rendered."""
    raw, results, plots = tmp_path / "raw", tmp_path / "results", tmp_path / "plots"
    shutil.copytree(H200_RUN, raw / H200_RUN.name)
    apart = raw / "long" / H200_RUN.name.replace("20261129", "20261130")
    shutil.copytree(H200_RUN, apart)
    config = yaml.safe_load((apart / "config.yaml").read_text()) | {"raw_subdir": "long"}
    (apart / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copytree(H200_RUN, raw / "other" / H200_RUN.name)  # no raw_subdir: not a config kept apart
    report.render("text_rope", raw, results, plots)
    assert report.apart_folders(raw) == ["long"]
    assert json.loads((results / "h200" / "text_rope_long.json").read_text())["newest"] == apart.name
    assert json.loads((results / "h200" / "text_rope.json").read_text())["newest"] == H200_RUN.name
    apart_table = (results / "h200" / "text_rope_long.md").read_text()
    assert f"long/{apart.name}" in apart_table
    assert "\n#### NVIDIA H200" in apart_table  # one level below the op's own: it sits inside a page section
    assert (results / "h200" / "text_rope_long_runs.md").exists() and (plots / "h200" / "long" / "text_rope_fwd.png").exists()
    index = (results / "text_rope_long_all_gpus.md").read_text()
    assert "h200/text_rope_long.md" in index and "h200/text_rope_long_runs.md" in index
    assert "text_rope_long" not in (results / "text_rope_all_gpus.md").read_text()
    assert not (results / "h200" / "text_rope_other.md").exists()


def test_committed_runs_link_their_raw_folder_on_the_repository():
    from dsfuse.bench.paths import raw_url

    url = "https://github.com/dsfuse/dsfuse/tree/main/experiments/text_rope/raw/" + H200_RUN.name
    assert raw_url(H200_RUN) == url
    added = env._git("log", "-1", "--diff-filter=A", "--format=%h", "--", f"experiments/text_rope/raw/{H200_RUN.name}")
    assert added, "the run's raw folder is committed"
    pinned = url.replace("/tree/main/", f"/tree/{added}/")  # the commit that added the raw data, not a branch
    assert report.raw_link(H200_RUN, "raw") == f"[raw]({pinned})"
    assert report.raw_link(REPO / "build" / "smoke" / "x", "raw") == "`build/smoke/x`"


def test_every_run_of_a_gpu_is_listed_under_its_anchor(tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(H200_RUN, raw / H200_RUN.name)
    shutil.copytree(H200_RUN, raw / "20261201-000000-h200")  # a newer run of the same GPU
    report.render("text_rope", raw, tmp_path / "results", tmp_path / "plots")
    runs = (tmp_path / "results" / "h200" / "text_rope_runs.md").read_text()
    assert f'<a id="run-{H200_RUN.name}"></a>' in runs  # the older run: its anchor is in the index
    assert "[`20261201-000000-h200`](#run-20261201-000000-h200) (tables above)" in runs
    assert '<a id="run-20261201-000000-h200"></a>' in (tmp_path / "results" / "h200" / "text_rope.md").read_text()


# staleness


def _write_run(run_dir: Path, blocks: dict[str, list[tuple[float, float]]], env_json: dict, config: dict,
               copy_us: float = 2.0) -> None:
    """A run folder of ``blocks``' cases (``{case: [(dsfuse us, eager us) per paired block]}``, mode
    fwd, 2 MB each, every check passed) beside a copy of ``copy_us``, with ``env_json`` and ``config``."""
    run_dir.mkdir(parents=True)
    samples = [dict(case="copy", mode="copy", provider="copy", regime="evicted", clock="graph", block=0, sample=0,
                    us=copy_us)]
    samples += [dict(case=case, mode="fwd", provider=p, regime="evicted", clock="graph", block=b, sample=0, us=us)
                for case, pairs in blocks.items() for b, pair in enumerate(pairs)
                for p, us in zip(("dsfuse", "eager"), pair)]
    pd.DataFrame(samples).to_csv(run_dir / "samples.csv", index=False)
    pd.DataFrame([dict(case="copy", mode="copy", bytes=4_000_000, params="{}")]
                 + [dict(case=case, mode="fwd", bytes=2_000_000, params="{}") for case in blocks]
                 ).to_csv(run_dir / "cases.csv", index=False)
    pd.DataFrame([dict(case=case, mode="fwd", provider=p, role=r, form="", check="bitwise", stage="before",
                       status="pass", mismatches=0, max_abs_diff=0.0, error="")
                  for case in blocks for p, r in (("dsfuse", "candidate"), ("eager", "control"))],
                 columns=["case", "mode", "provider", "role", "form", "check", "stage", "status", "mismatches",
                          "max_abs_diff", "error"]).to_csv(run_dir / "validation.csv", index=False)
    (run_dir / "env.json").write_text(json.dumps(dict(gpu_name="NVIDIA B200", sm_count=148, driver="1.2",
                                                      packages=dict(torch="2.x", triton="3.x"), date_utc="today")
                                                 | env_json))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def _tiny_run(run_dir: Path, env_extra: dict) -> None:
    _write_run(run_dir, {"c_fwd": [(10, 20), (10, 40), (20, 30)]}, env_extra,
               dict(targets=[dict(case="c_fwd", provider="dsfuse", max_of_fastest=0.5)]))


def _part(run_dir: Path, times: dict[str, tuple[float, float]], sha: str | None = "a" * 64, config: dict | None = None,
          part: bool = True, copy_us: float = 2.0, env_extra: dict | None = None) -> None:
    """A run of ``times``' cases (``{case: (dsfuse us, eager us)}``, two paired blocks) of one config
    whose target holds ``c_n1_fwd`` within 1.25x of ``c_n5_fwd``; ``part``: the config names them as its
    ``cases`` (a run of a part of it)."""
    body = config or dict(tokens=8, targets=[dict(case="c_n1_fwd", provider="dsfuse",
                                                   max_of_case=dict(case="c_n5_fwd", factor=1.25))])
    _write_run(run_dir, {case: [pair, pair] for case, pair in times.items()},
               dict(git_commit="f" * 40, **(env_extra or {}), **(dict(kernel_sources=dict(sha256=sha, files=[]))
                                                                  if sha else {})),
               body | (dict(cases=list(times)) if part else {}), copy_us)


def test_a_config_run_in_parts_renders_the_newest_part_of_each_case(tmp_path):
    """Where the newest run ran a part of its config, the tables join the runs of that config and
    kernel source, each case from the newest run that measured it; runs of other kernels or another
    config stay out; the runs list marks every run the tables read; a target across two runs says so."""
    raw = tmp_path / "raw"
    _part(raw / "20261201-000000-b200", {"c_n1_fwd": (10.0, 20.0)}, sha="b" * 64)  # other kernels
    _part(raw / "20261201-010000-b200", {"c_n1_fwd": (30.0, 40.0)})  # measured again below
    _part(raw / "20261201-020000-b200", {"c_n5_fwd": (10.0, 12.0)})
    _part(raw / "20261201-030000-b200", {"c_n5_fwd": (1.0, 2.0)}, config=dict(tokens=16))  # another config
    _part(raw / "20261201-040000-b200", {"c_n1_fwd": (12.0, 24.0)})
    report.render("text_rope", raw, tmp_path / "results", tmp_path / "plots")
    table = (tmp_path / "results" / "b200" / "text_rope.md").read_text()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| c_n")]
    assert "These tables read 2 runs" in table
    assert cells[:2] == [["c_n5_fwd", "`20261201-020000-b200`"], ["c_n1_fwd", "`20261201-040000-b200`"]]
    for gone in ("20261201-000000-b200", "20261201-010000-b200", "20261201-030000-b200"):
        assert f'<a id="run-{gone}"></a>' not in table and gone not in table.split("\n", 1)[0]
    ratios = {r[0]: r[5] for r in cells if len(r) > 5 and r[2] == "graph/evicted" and "[" in r[5]}
    assert ratios == {"c_n1_fwd": "2.00 [2.00, 2.00]", "c_n5_fwd": "1.20 [1.20, 1.20]"}  # each within its own run
    assert "1.20x its n5 case across runs met" in table  # 12 us over the other run's 10
    runs = (tmp_path / "results" / "b200" / "text_rope_runs.md").read_text()
    marked = [line for line in runs.splitlines() if "(tables above)" in line]
    assert len(marked) == 2 and "20261201-040000-b200" in marked[0] and "20261201-020000-b200" in marked[1]
    figures = json.loads((tmp_path / "results" / "b200" / "text_rope.json").read_text())
    assert figures["joined"]["cases"] == {"c_n5_fwd": "20261201-020000-b200", "c_n1_fwd": "20261201-040000-b200"}
    assert [t["verdict"] for t in figures["joined"]["targets"]] == ["1.20x its n5 case across runs met"]
    assert [t["verdict"] for t in figures["runs"]["20261201-040000-b200"]["targets"]] == ["its n5 case not measured"]

    _part(raw / "20261201-050000-b200", {"c_n1_fwd": (12.0, 24.0)}, part=False)  # a whole run: its own tables
    report.render("text_rope", raw, tmp_path / "results", tmp_path / "plots")
    table = (tmp_path / "results" / "b200" / "text_rope.md").read_text()
    assert "These tables read" not in table and "its n5 case not measured" in table


def test_joined_parts_keep_each_run_to_its_cases_and_its_ceiling(tmp_path, monkeypatch):
    """Each joined run is summarized at its own copy ceiling and gives the op's own tables only the
    cases it gives (a case measured again by a newer part shows the newer figures alone); a part that
    stopped names what it finished; parts of another environment stay out."""
    raw = tmp_path / "raw"
    _part(raw / "20261201-010000-b200", {"c_n1_fwd": (30.0, 40.0), "c_n5_fwd": (10.0, 12.0)}, copy_us=4.0)
    _part(raw / "20261201-020000-b200", {"c_n5_fwd": (1.0, 2.0)}, env_extra=dict(driver="9.9"))  # another driver
    _part(raw / "20261201-030000-b200", {"c_n1_fwd": (12.0, 24.0)})
    (raw / "20261201-030000-b200" / "UNFINISHED").write_text("2 cases to run; 1 finished\n")
    seen = []

    def report_extra(run_dir, cases=None):
        run = report.load_run(Path(run_dir), cases)
        seen.append((Path(run_dir).name, sorted(set(run["samples"]["case"]))))
        return ["### Extra", "", *sorted(set(run["cases"]["case"]) - {"copy"}), ""]

    real = report.op_function
    monkeypatch.setattr(report, "op_function", lambda op, name, required=True:
                        report_extra if name == "report_extra" else real(op, name, required))
    report.render("text_rope", raw, tmp_path / "results", tmp_path / "plots")
    table = (tmp_path / "results" / "b200" / "text_rope.md").read_text()
    assert seen == [("20261201-010000-b200", ["c_n5_fwd", "copy"]), ("20261201-030000-b200", ["c_n1_fwd", "copy"])]
    assert "20261201-020000-b200" not in table
    floors = {r[0]: r[8] for r in ([c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()
                                   if line.startswith("| c_n")) if len(r) > 9 and "[" in r[5]}
    assert floors == {"c_n1_fwd": "1", "c_n5_fwd": "2"}  # 2 MB at 4 TB/s (2 us copy), at 2 TB/s (4 us)
    assert "**Run `20261201-030000-b200` stopped before its end** (a time limit or an error): of its part, only " \
           "c_n1_fwd finished." in table


def test_parts_without_a_kernel_hash_join_by_commit_only_where_the_tree_was_clean(tmp_path):
    raw = tmp_path / "raw"
    _part(raw / "20261201-010000-b200", {"c_n5_fwd": (10.0, 12.0)}, sha=None, env_extra=dict(git_dirty=False))
    _part(raw / "20261201-020000-b200", {"c_n1_fwd": (12.0, 24.0)}, sha=None, env_extra=dict(git_dirty=False))
    assert list(report.config_parts(report.runs_of(raw)).values()) == report.runs_of(raw)
    for run in report.runs_of(raw):  # a tree of unknown state (a device run given its commit): the newest alone
        data = json.loads((run / "env.json").read_text())
        (run / "env.json").write_text(json.dumps(dict(data, git_dirty=None)))
    assert report.config_parts(report.runs_of(raw)) == {"c_n1_fwd": raw / "20261201-020000-b200"}


def test_a_run_that_timed_no_case_still_renders(tmp_path):
    raw = tmp_path / "raw"
    _part(raw / "20261201-010000-b200", {"c_n5_fwd": (10.0, 12.0)})
    _part(raw / "20261201-020000-b200", {})  # its part's one case timed nothing (the copy alone)
    config = yaml.safe_load((raw / "20261201-020000-b200" / "config.yaml").read_text())
    (raw / "20261201-020000-b200" / "config.yaml").write_text(yaml.safe_dump(dict(config, cases=["c_n1_fwd"])))
    report.render("text_rope", raw, tmp_path / "results", tmp_path / "plots")
    assert "These tables read" in (tmp_path / "results" / "b200" / "text_rope.md").read_text()
    _part(raw / "20261201-030000-b200", {}, part=False)
    report.render("text_rope", raw, tmp_path / "results", tmp_path / "plots")
    table = (tmp_path / "results" / "b200" / "text_rope.md").read_text()
    assert "These tables read" not in table and "dsfuse against the fastest valid control" not in table


STALE = "the kernel source has changed since"


@pytest.mark.parametrize("same", [True, False])
def test_the_staleness_mark_follows_the_recorded_kernel_hash(tmp_path, same):
    sources = env.kernel_sources("text_rope")
    if not same:
        sources = dict(sources, sha256="0" * 64)
    _tiny_run(tmp_path / "raw" / "r1", dict(git_commit="f" * 40, kernel_sources=sources))
    report.render("text_rope", tmp_path / "raw", tmp_path / "results", tmp_path / "plots")
    table = (tmp_path / "results" / "b200" / "text_rope.md").read_text()
    runs = (tmp_path / "results" / "b200" / "text_rope_runs.md").read_text()
    assert (STALE in table) is not same
    assert ("Kernel source unchanged since this run" in table) is same
    assert ("| changed since" in runs) is not same


def test_runs_without_a_hash_are_compared_by_commit():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout")
    old = json.loads((REPO / "experiments" / "engram_gate" / "raw" / "20261129-101731-h200" / "env.json").read_text())
    state = env.source_state("engram_gate", old)  # 3048aae: the Engram kernels changed after it
    assert state["how"] == "git" and state["state"] == "changed" and state["since"]
    assert any(line.startswith('!!! warning "Measured at commit 3048aaeca3') for line in report.state_lines(state))
    assert env.source_state("engram_gate", dict(git_commit="0" * 40))["state"] == "unknown"  # not a commit here
    assert env.source_state("engram_gate", {})["state"] == "unknown"


def _kernel_file(op: str, backend: str) -> str:
    """The first kernel module of ``op``'s ``backend`` in the registry, as a path under ``kernels/dsfuse/``."""
    from dsfuse._common.backends import load_all_ops

    return load_all_ops()[op].kernels[backend][0].removeprefix("dsfuse.").replace(".", "/") + ".py"


def test_a_hash_of_other_files_is_compared_by_commit():
    """A run whose recorded hash covers another set of files (the CuTe DSL backend was added to the
    hashed files after it) is compared by git over the current files, not called changed by its hash."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout")
    run = json.loads((REPO / "experiments" / "engram_gate" / "raw" / "20261201-022130-h200" / "env.json").read_text())
    assert run["kernel_sources"]["files"] == ["kernels/dsfuse/engram_gate/triton.py"]
    assert f"kernels/dsfuse/{_kernel_file('engram_gate', 'cutedsl')}" in env.kernel_sources("engram_gate")["files"]
    assert env.source_state("engram_gate", run)["how"] == "git"


@pytest.fixture
def committed_package(tmp_path):
    """A copy of the package committed in a fresh git repository: ``(package, git, run)``, ``run`` the
    env.json fields of a text RoPE run at that commit."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    package = tmp_path / "kernels" / "dsfuse"
    shutil.copytree(REPO / "kernels" / "dsfuse", package, ignore=shutil.ignore_patterns("__pycache__"))

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "run")
    return package, git, dict(git_commit=git("rev-parse", "HEAD"), kernel_sources=env.kernel_sources("text_rope", package))


def test_an_edit_of_prose_alone_is_not_a_kernel_change(committed_package):
    """Compared by commit, a kernel file whose docstrings or comments changed is current; a code
    change is not (a copy of the package in a fresh git repository)."""
    package, git, run = committed_package
    kernel = package / _kernel_file("text_rope", "triton")
    source = kernel.read_text()
    kernel.write_text(source.replace('"""', '"""Reworded. ', 1) + "\n# a comment\n")
    state = env.source_state("text_rope", run, package)
    assert (state["state"], state["how"]) == ("current", "git")  # the hash differs, the code does not
    kernel.write_text(source + "\nEXTRA = 1\n")
    assert env.source_state("text_rope", run, package)["state"] == "changed"


def test_the_kernel_hash_covers_the_op_kernels_and_their_package_imports(tmp_path):
    package = tmp_path / "dsfuse"
    shutil.copytree(REPO / "kernels" / "dsfuse", package, ignore=shutil.ignore_patterns("__pycache__"))
    files = [p.relative_to(package).as_posix() for p in env.kernel_files("text_rope", package)]
    # the bound launch path (launch.py) is: it is how the kernels run; not api.py, the table (__init__), aot.py
    assert files == ["_common/launch.py", _kernel_file("text_rope", "triton")]
    vision = [p.relative_to(package).as_posix() for p in env.kernel_files("vision_rope", package)]
    assert {_kernel_file("vision_rope", "triton"), _kernel_file("vision_rope", "cutedsl"),
            "_common/cutedsl.py"} <= set(vision)
    before = env.kernel_sources("text_rope", package)["sha256"]
    (package / "text_rope" / "api.py").write_text("# changed\n")
    assert env.kernel_sources("text_rope", package)["sha256"] == before
    with (package / "_common" / "aot.py").open("a") as f:  # the compile check is not kernel code
        f.write("# changed\n")
    assert env.kernel_sources("text_rope", package)["sha256"] == before
    before = env.kernel_sources("vision_rope", package)["sha256"]
    with (package / "_common" / "cutedsl.py").open("a") as f:  # a package module a kernel module imports
        f.write("# changed\n")
    assert env.kernel_sources("vision_rope", package)["sha256"] != before


def test_a_new_run_records_the_kernel_hash():
    import torch

    assert env.collect(torch.device("cpu"), op="engram_gate")["kernel_sources"] == env.kernel_sources("engram_gate")


def test_a_run_records_the_variables_that_change_how_it_runs(monkeypatch):
    """env.json's ``variables``: the allocator's and launch settings set for the run, and only those."""
    import torch

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    monkeypatch.setenv("HOME_OF_SOMETHING_ELSE", "x")
    recorded = env.collect(torch.device("cpu"))["variables"]
    assert recorded["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "CUDA_LAUNCH_BLOCKING" not in recorded and "HOME_OF_SOMETHING_ELSE" not in recorded


# the config chosen by the GPU found


def test_the_config_follows_the_gpu_name():
    configs = REPO / "experiments" / "text_rope" / "configs"
    assert config_for("text_rope", "NVIDIA H200") == configs / "h200.yaml"
    assert config_for("text_rope", "NVIDIA B200") == configs / "b200.yaml"
    assert config_for("text_rope", "NVIDIA H200 NVL") == configs / "h200.yaml"  # the family's
    assert config_for("text_rope", None) == configs / "smoke.yaml"
    with pytest.raises(SystemExit, match="--config"):
        config_for("text_rope", "NVIDIA A100-SXM4-80GB")


PER_GPU = ("timing", "targets", "peak_tflops")  # what a GPU's config may set its own way (peak: a datasheet figure)


@pytest.mark.parametrize("op", sorted(experiments()))
def test_b200_configs_evict_the_b200_l2_and_keep_the_model_geometry(op):
    """Every op with an experiment (from the registry) has an H200 and a B200 config that measure the
    same shapes and providers; the B200's evicts its L2."""
    configs = REPO / "experiments" / op / "configs"
    b200, h200 = (yaml.safe_load((configs / f"{g}.yaml").read_text()) for g in ("b200", "h200"))
    assert b200["timing"]["flush_bytes"] >= 2 * B200_L2
    check_flush(b200, B200_L2, "NVIDIA B200")
    with pytest.raises(SystemExit, match="flush_bytes"):
        check_flush(dict(timing=dict(flush_bytes=B200_L2)), B200_L2, "NVIDIA B200")
    assert {k: v for k, v in b200.items() if k not in PER_GPU} == {k: v for k, v in h200.items() if k not in PER_GPU}
    assert "copy_bytes" in b200["timing"]  # the bandwidth is measured in the run, never typed


# one ratio: control / dsfuse, of the medians


def test_every_table_states_the_ratio_as_control_over_dsfuse(tmp_path):
    """Blocks (dsfuse, eager): (10, 20), (10, 40), (20, 30). Medians 10 and 30: the ratio is 3.00;
    the median of the per-block ratios (2, 4, 1.5) would be 2.00 and the inverse 0.33."""
    _tiny_run(tmp_path / "raw" / "r1", dict(git_commit="f" * 40))
    report.render("text_rope", tmp_path / "raw", tmp_path / "results", tmp_path / "plots")
    text = (tmp_path / "results" / "b200" / "text_rope.md").read_text()
    ratio_row = next(line for line in text.splitlines() if line.startswith("| c_fwd") and "eager 30.0" in line)
    assert "3.00 [1.50, 4.00]" in ratio_row
    target_row = next(line for line in text.splitlines() if "the fastest valid control (latency" in line)
    assert ">= 2.00x the fastest valid control" in target_row and "3.00x eager met" in target_row
    figures = json.loads((tmp_path / "results" / "b200" / "text_rope.json").read_text())
    assert figures["runs"]["r1"]["ratio"]["c_fwd"]["dsfuse"]["graph/evicted"]["ratio"] == 3.0


def test_medians_print_as_plain_decimals():
    table = pd.DataFrame(dict(case=["a", "b"], us=[tables.fmt(1234567.8), tables.fmt(12.0)]))
    assert "1234567.8" in tables.markdown(table) and "e+" not in tables.markdown(table)


# the figures the prose quotes (docs/macros.py)


def _macros():
    spec = importlib.util.spec_from_file_location("docs_macros", REPO / "docs" / "macros.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prose_figures_are_the_tables_figures(tmp_path):
    _tiny_run(tmp_path / "raw" / "r1", dict(git_commit="f" * 40))
    report.render("text_rope", tmp_path / "raw", tmp_path / "results", tmp_path / "plots")
    figures = _macros().Figures(tmp_path, "text_rope", "b200")
    assert figures.us("c_fwd") == "10.0 us" and figures.us("c_fwd", "eager") == "30.0 us"
    assert figures.ratio("c_fwd", spread=True) == "3.00x [1.50, 4.00]" and figures.control("c_fwd") == "`eager`"
    assert figures.run == "[`r1`](#run-r1)" and figures.met("c_fwd") == "met"
    row = dict(provider="dsfuse", target="", goals={"max_of_case": {}})
    at = "graph/evicted"
    figures.fig["targets"] = [dict(row, case="a", verdict="1.10x its n5 case met", **{"clock/cache": at}),
                              dict(row, case="b", verdict="its n5 case not measured", **{"clock/cache": at}),
                              dict(row, case="c", verdict="1.50x its n5 case MISSED", **{"clock/cache": at})]
    assert [figures.met(c) for c in "abc"] == ["met", "not measured", "**missed**"]
    assert figures.met_in(list("abc"), "max_of_case") == "met at 1 of 3 (**missed**: c; not measured: b)"
    assert figures.met_in(["a"], "max_of_case") == "met at all 1"
    with pytest.raises(KeyError):
        figures.us("no_such_case")
    with pytest.raises(FileNotFoundError):
        _macros().Figures(tmp_path, "text_rope", "h200")


def test_tuning_figures_pick_settings_by_pattern_and_compare_them(tmp_path):
    rows = [dict(mode="bwd-shipped", warps=4, us=300.0), dict(mode="bwd-a", warps=4, us=330.0),
            dict(mode="bwd-a", warps=8, us=360.0), dict(mode="bwd-b", warps=4, us=600.0),
            dict(mode="bwd-shipped", warps=8, us=310.0), dict(mode="bwd-c", warps=4, us=None)]
    other = [dict(mode="bwd-shipped", warps=4, us=280.0), dict(mode="bwd-a", warps=4, us=281.5)]
    folder = tmp_path / "results" / "b200"
    folder.mkdir(parents=True)
    (folder / "op.json").write_text(json.dumps(dict(newest="r1", runs=dict(r1={}),
                                                    tuning=dict(sweep=rows, other=other))))
    figures = _macros().Figures(tmp_path, "op", "b200")
    assert figures.tuned("sweep", mode="bwd-a", warps=8) == "360.0 us"  # one setting, as before
    with pytest.raises(KeyError):
        figures.tuned("sweep", mode="bwd-a")  # two settings match
    assert figures.tuned_best("sweep", mode="bwd-[ab]*") == "330.0 us"
    assert figures.tuned_best(["sweep", "other"], mode=["bwd-a", "bwd-b"]) == "281.5 us"
    assert figures.tuned_span("sweep", mode="bwd-*", warps=4) == "300.0 us to 600.0 us"  # no median: left out
    assert figures.tuned_span("sweep", mode="bwd-a", warps=8) == "360.0 us"
    # each setting against the base setting with the same warps: 330/300, 360/310, 600/300
    assert figures.tuned_over("sweep", dict(mode="bwd-shipped"), by=["warps"], mode=["bwd-a", "bwd-b"]) == "10% to 100%"
    assert figures.tuned_apart(["sweep", "other"], dict(mode="bwd-shipped"), by=["warps"], mode="bwd-a") == "50.0 us"
    with pytest.raises(KeyError):
        figures.tuned_over("sweep", dict(mode="bwd-shipped"), mode="bwd-a")  # two base settings, no `by`
    with pytest.raises(KeyError):
        figures.tuned_best("sweep", mode="bwd-z*")
    with pytest.raises(KeyError):
        figures.tuned_best("no-such-sweep", mode="bwd-a")


def test_moved_kernel_code_is_unchanged_and_a_real_change_is_not(committed_package):
    """Compared by commit, the op's kernel code is one collection of top-level definitions: a kernel
    file renamed, or a definition moved to another kernel file of the op, is current; the backend
    package's table (its ``__init__.py``) is not kernel code; a code change is ``changed``."""
    package, git, run = committed_package
    backend = package / "text_rope" / "triton"
    assert [p.relative_to(package).as_posix() for p in env.kernel_files("text_rope", package)] == [
        "_common/launch.py", "text_rope/triton/kernels.py"]  # not the table (__init__.py), not the AOT check
    (backend / "kernels.py").rename(backend / "rope.py")  # a renamed file
    state = env.source_state("text_rope", run, package)
    assert (state["state"], state["how"]) == ("current", "git")
    source = (backend / "rope.py").read_text()
    cut = source.index("def _as_4d(")  # a definition moved to another file of the backend
    end = source.index("\ndef _pow2(")
    (backend / "rope.py").write_text(source[:cut] + source[end + 1:])
    (backend / "shapes.py").write_text("import torch\n\n\n" + source[cut:end] + "\n")
    assert env.source_state("text_rope", run, package)["state"] == "current"
    (backend / "__init__.py").write_text((backend / "__init__.py").read_text() + "\nEXTRA = 1\n")
    assert env.source_state("text_rope", run, package)["state"] == "current"  # the table is not kernel code
    (backend / "shapes.py").write_text((backend / "shapes.py").read_text().replace("return", "return  0 or", 1))
    state = env.source_state("text_rope", run, package)
    assert state["state"] == "changed" and state["uncommitted"]
    git("add", "-A")
    git("commit", "-qm", "a real change")
    state = env.source_state("text_rope", run, package)
    assert state["state"] == "changed" and len(state["since"]) == 1


def test_a_host_time_run_is_judged_over_its_call_path(committed_package):
    """A host-time run's staleness covers the eager call's whole path: the public function, its checks,
    the backend choice, the call plans and the launch, not only the kernels; the AOT check is not on it."""
    package, git, run = committed_package
    files = [p.relative_to(package).as_posix() for p in env.kernel_files("text_rope", package, scope="host")]
    assert {"text_rope/api.py", "_common/plans.py", "_common/validation.py", "_common/backends.py",
            "_common/launch.py", _kernel_file("text_rope", "triton")} <= set(files)
    assert "_common/aot.py" not in files
    run = dict(run, host_sources=env.kernel_sources("text_rope", package, scope="host"))
    assert env.source_state("text_rope", run, package, scope="host")["state"] == "current"
    api = package / "text_rope" / "api.py"
    api.write_text(api.read_text() + "\nEXTRA = 1\n")  # the call path changed, the kernels did not
    assert env.source_state("text_rope", run, package, scope="host")["state"] == "changed"
    assert env.source_state("text_rope", run, package)["state"] == "current"
    lines = report.state_lines(env.source_state("text_rope", run, package, scope="host"))
    assert "the code of the call path has changed since" in lines[0]
    with pytest.raises(ValueError, match="scope"):
        env.kernel_files("text_rope", package, scope="api")


def test_a_gpu_run_of_auto_without_the_cutedsl_backend_is_refused_where_it_is_required(monkeypatch, capsys):
    """`python -m dsfuse.bench run` with ``backend: auto`` and no CuTe DSL backend: refused under
    DSFUSE_REQUIRE_CUTEDSL=1, a warning otherwise; a named backend, an installed one, or an op without
    a CuTe DSL backend passes."""
    import dataclasses

    from dsfuse._common import backends
    from dsfuse.bench.__main__ import check_backends

    missing = dataclasses.replace(backends.BACKENDS["cutedsl"])
    object.__setattr__(missing, "installed", False)
    monkeypatch.setitem(backends.BACKENDS, "cutedsl", missing)
    monkeypatch.setenv("DSFUSE_REQUIRE_CUTEDSL", "1")
    with pytest.raises(SystemExit, match="not installed"):
        check_backends(dict(backend="auto"), "gdn")
    check_backends(dict(backend="triton"), "gdn")
    check_backends(dict(backend="auto"), "text_rope")  # no CuTe DSL backend to miss
    monkeypatch.delenv("DSFUSE_REQUIRE_CUTEDSL")
    check_backends(dict(backend="auto"), "gdn")
    assert "WARNING" in capsys.readouterr().err
    object.__setattr__(missing, "installed", True)
    monkeypatch.setenv("DSFUSE_REQUIRE_CUTEDSL", "1")
    check_backends(dict(backend="auto"), "gdn")
