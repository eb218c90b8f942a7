"""Every tool that loops over ops takes them from the registry, and every op gives each tool its piece.

The tools: host time (``dsfuse.bench.host_time``), output fingerprints (``scripts/output_hashes.py``),
Nsight Compute runs (``scripts/ncu_backends.py``), screenshots (``scripts/screenshot_ops.py``) and the
per-GPU results tests (``tests/test_results_per_gpu.py``). Their ops are ``dsfuse.bench.experiments()``
(the registered ops with an experiment module); an op's own piece lives in its bench module
``kernels/dsfuse/bench/<op>.py``, so a new op adds it in its own slice, and a tool that finds an op
without it fails naming the op and the function. No list of op names is typed in the tools: a scan
of their sources fails where one reappears. Every registered op has its tests' folder ``tests/<op>/``
(the ``backend`` fixture reads the op from it), and no other folder of tests names an op.
"""

import ast
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

import dsfuse.bench
from dsfuse._common.backends import load_all_ops
from dsfuse.bench import experiments, host_time, report

REPO = Path(__file__).resolve().parents[1]
PIECES = ("host_time_calls", "fingerprint_cases", "ncu_calls")  # each tool's function in every op's bench module
SCANNED = [*sorted((REPO / "scripts").glob("*.py")), *sorted((REPO / "scripts").glob("*.sh")),
           *sorted((REPO / "kernels" / "dsfuse" / "bench").glob("*.py")),
           REPO / "tests" / "test_host_time.py", REPO / "tests" / "test_results_per_gpu.py"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("op", sorted(experiments()))
@pytest.mark.parametrize("piece", PIECES)
def test_every_op_with_an_experiment_gives_every_tool_its_piece(op, piece):
    assert callable(report.op_function(op, piece))


@pytest.mark.parametrize("op", sorted(experiments()))
def test_every_op_has_its_fingerprint_entries_screenshot_page_and_per_gpu_configs(op):
    cases = report.op_function(op, "fingerprint_cases")()
    assert cases and all(map(callable, cases.values()))
    assert all(entry == op or entry.startswith(op + "/") for entry in cases)
    page = REPO / "docs" / "ops" / f"{op}.md"  # what scripts/screenshot_ops.py clips
    assert _script("screenshot_ops").page_source(op) == page
    assert re.search(r"^## Contract", page.read_text(), re.M), f"{page}: no '## Contract' heading to clip from"
    for gpu in ("h200", "b200"):  # tests/test_results_per_gpu.py compares them
        assert (REPO / "experiments" / op / "configs" / f"{gpu}.yaml").exists()


TESTS = REPO / "tests"
NOT_OPS = {"golden"}  # folders of tests/ that hold no op's tests (besides hidden and cache folders)


def test_every_op_has_its_tests_folder():
    ops = set(load_all_ops())
    folders = {p.name for p in TESTS.iterdir()
               if p.is_dir() and p.name not in NOT_OPS and not p.name.startswith((".", "_"))}
    assert not ops - folders, f"registered ops without a tests/<op>/ folder: {sorted(ops - folders)}"
    assert not folders - ops, f"folders of tests/ that are no registered op: {sorted(folders - ops)}"
    for op in sorted(ops):
        assert sorted((TESTS / op).glob(f"test_{op}*.py")), f"tests/{op}/: no test_{op}*.py module"
    stray = sorted(p.name for p in TESTS.glob("test_*.py") if any(p.name.startswith(f"test_{op}") for op in ops))
    assert not stray, f"op tests at the top of tests/ (move them to tests/<op>/): {stray}"


def test_test_module_names_are_unique():
    """The test folders are not packages (pytest's default import mode): a module name used twice would
    not import."""
    names = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path.name != "conftest.py":
            names.setdefault(path.name, []).append(path.relative_to(REPO).as_posix())
    assert not {n: p for n, p in names.items() if len(p) > 1}


def test_the_tools_loop_over_the_registry():
    ops = list(experiments())
    assert ops and set(ops) <= set(load_all_ops())
    assert host_time.ops() == ops
    assert {entry.split("/")[0] for entry in _script("output_hashes").collect_cases()} == set(ops)


@pytest.fixture
def fake_op(monkeypatch):
    """An op with an experiment module that gives no tool its piece."""
    real = dict(experiments())
    monkeypatch.setitem(sys.modules, "dsfuse.bench.fake_op", types.ModuleType("dsfuse.bench.fake_op"))
    fake = {**real, "fake_op": "dsfuse.bench.fake_op"}
    monkeypatch.setattr(dsfuse.bench, "experiments", lambda: fake)
    monkeypatch.setattr(host_time, "experiments", lambda: fake)
    return "fake_op"


def test_a_tool_fails_naming_the_op_without_its_piece(fake_op):
    with pytest.raises(LookupError, match="'fake_op'.*host_time_calls"):
        host_time.op_calls(fake_op, torch.device("cpu"))
    with pytest.raises(LookupError, match="'fake_op'.*fingerprint_cases"):
        _script("output_hashes").collect_cases()
    with pytest.raises(LookupError, match="'fake_op'.*ncu_calls"):
        _script("ncu_backends").calls("cpu", [fake_op])
    with pytest.raises(FileNotFoundError, match="'fake_op'.*docs/ops/fake_op.md"):
        _script("screenshot_ops").page_source(fake_op)
    assert host_time.ops()[-1] == fake_op  # listed, not skipped
    with pytest.raises(LookupError, match="'no_such_op'.*no experiment module"):
        report.op_function("no_such_op", "host_time_calls")
    assert report.op_function(fake_op, "report_extra", required=False) is None  # optional pieces stay optional


def test_gdn_pieces_are_at_the_seeds_shape():
    """The fingerprints and ncu calls of GDN run at configs/h200.yaml's tokens and documents."""
    from dsfuse.bench import gdn

    config = yaml.safe_load((REPO / "experiments" / "gdn" / "configs" / "h200.yaml").read_text())
    assert (gdn.SEED_TOKENS, gdn.SEED_DOCUMENTS) == (config["tokens"], config["documents"])
    assert gdn.document_bounds(gdn.SEED_TOKENS, gdn.SEED_DOCUMENTS) == [0, 8847, 11796, 22937, 28836, 32768]
    defaults = inspect.signature(gdn.fingerprint_cases()["gdn"]).parameters
    assert (defaults["tokens"].default, defaults["documents"].default) == (32768, 5)


# no hand-typed op lists


def op_lists(source: str, ops: set[str]) -> list[int]:
    """Lines of ``source`` (Python) with a literal tuple, list or set of two or more op names, or a dict
    literal with two or more op names as keys."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        if sum(isinstance(e, ast.Constant) and e.value in ops for e in items) >= 2:
            found.append(node.lineno)
    return found


def shell_op_lists(source: str, ops: set[str]) -> list[int]:
    """Lines of a shell script (comments aside) naming two or more ops."""
    words = re.compile(r"\b(" + "|".join(map(re.escape, sorted(ops))) + r")\b")
    return [i for i, line in enumerate(source.splitlines(), 1)
            if len(set(words.findall(line.split("#", 1)[0]))) >= 2]


def test_the_scan_finds_op_lists():
    a, b, *_ = sorted(load_all_ops())
    ops = {a, b}
    assert op_lists(f"X = ({a!r}, {b!r})\n", ops) == [1]
    assert op_lists(f"def f():\n    return [{a!r}, 'x', {b!r}]\n", ops) == [2]
    assert op_lists(f"D = {{{a!r}: 1, {b!r}: 2}}\n", ops) == [1]
    assert op_lists(f"X = ({a!r}, 'other')\nY = f'{{op}}'\n", ops) == []
    assert shell_op_lists(f"for op in {a} {b}; do\n# {a} {b}\necho {a}\n", ops) == [1]


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_tool_types_a_list_of_op_names(path):
    ops = set(load_all_ops())
    source = path.read_text()
    lines = shell_op_lists(source, ops) if path.suffix == ".sh" else op_lists(source, ops)
    assert not lines, (f"{path.relative_to(REPO)}: op names listed by hand on line(s) {lines}; take them from the "
                       "registry (dsfuse.bench.experiments()) and put each op's part in its bench module")
