"""The README's and the home page's status come from the data (dsfuse.bench.status), so they cannot
disagree with the op pages, whose tables come from the same results/<gpu>/<op>.json."""

import json
import shutil
from pathlib import Path

import pytest

from dsfuse.bench import experiments, status

ROOT = Path(__file__).resolve().parents[1]
OPS = sorted(experiments())


def test_readme_and_home_page_status_are_generated_from_the_results():
    readme = (ROOT / "README.md").read_text()
    assert status.readme_block(ROOT, OPS) in readme, "README status is stale: run python -m dsfuse.bench report"
    site = (ROOT / "results" / "status.md").read_text()
    assert site.endswith(status.render(ROOT, OPS, status.site_link, breaks=True)), "results/status.md is stale"
    assert "_<wbr>" in site and "<wbr>" not in readme  # the site's case names may break, the README's stay plain
    assert '--8<-- "results/status.md"' in (ROOT / "docs" / "index.md").read_text()


def test_every_op_has_a_row_and_a_changed_result_shows(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "results", root / "results")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    (root / "README.md").write_text(f"x\n{status.START}\nold\n{status.END}\ny\n")
    rows = status.rows(root, OPS, status.site_link)
    names = [r[0].split("]")[0].lstrip("[") for r in rows]
    assert {n for n in names if "," not in n} == {status.title(ROOT, op) for op in OPS}  # each op's own row
    apart = {n for n in names if "," in n}  # and one per config kept apart, under the op's name
    assert apart == {f"{status.title(ROOT, 'gdn')}, {sub.replace('_', ' ')}" for sub in status.kept_apart(root, "gdn", OPS)}
    assert {"long", "forward_controls"} <= set(status.kept_apart(root, "gdn", OPS))
    path = root / "results" / "h200" / "text_rope.json"
    data = json.loads(path.read_text())
    run = data["runs"][data["newest"]]
    run["kernel_source"] = "changed since"
    run["targets"] = [dict(case="c", provider="dsfuse", verdict="latency MISSED")]
    path.write_text(json.dumps(data))
    written = status.write(root, OPS)
    assert root / "README.md" in written
    text = (root / "README.md").read_text()
    assert text.startswith("x\n") and text.endswith("y\n") and "old" not in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| [Text RoPE]") and "H200" in ln)
    assert "changed since" in line and "0 of 1 met; missed: c (dsfuse)" in line
    run["targets"] = [dict(case="a", provider="dsfuse", verdict="1.20x flashqla met"),
                      dict(case="b", provider="dsfuse", verdict="1.20x flashqla met, its n5 case not measured"),
                      dict(case="c", provider="dsfuse", verdict="not measured"),
                      dict(case="d", provider="dsfuse", verdict="0.90x flashqla MISSED, its n5 case not measured")]
    path.write_text(json.dumps(data))
    status.write(root, OPS)
    line = next(ln for ln in (root / "README.md").read_text().splitlines()
                if ln.startswith("| [Text RoPE]") and "H200" in ln)
    assert "1 of 4 met; missed: d (dsfuse); not measured in these runs: b (dsfuse), c (dsfuse)" in line


def test_an_op_with_pages_of_its_own_is_named_by_its_section(tmp_path):
    (tmp_path / "mkdocs.yml").write_text(
        "nav:\n  - Home: index.md\n  - Ops:\n      - Text RoPE: ops/text_rope.md\n"
        "      - Gated DeltaNet:\n          - Overview: ops/gdn.md\n          - A record: ops/gdn_long.md\n")
    assert status.title(tmp_path, "text_rope") == "Text RoPE"
    assert status.title(tmp_path, "gdn") == "Gated DeltaNet"
    with pytest.raises(LookupError, match="gdn_long: no page ops/gdn_long.md"):
        status.title(tmp_path, "gdn_long")  # a page of the section, not its op's page
    assert status.title(ROOT, "gdn") == "Gated DeltaNet"


def test_a_section_may_list_its_op_page_without_a_name(tmp_path):
    (tmp_path / "mkdocs.yml").write_text(
        "nav:\n  - Ops:\n      - Gated DeltaNet:\n          - ops/gdn.md\n          - A record: ops/gdn_long.md\n")
    assert status.title(tmp_path, "gdn") == "Gated DeltaNet"


def test_a_config_kept_apart_has_its_own_rows_and_parts_are_judged_joined(tmp_path):
    """A config kept apart (``results/<gpu>/<op>_<sub>.json``) gets a row under the op's name and
    its own; where its tables join the parts of a config, the row counts the parts and judges the
    joined targets, not the newest part's alone. Its run links into the op's page where the page
    includes its tables (GDN's long documents), else to the results file."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "results", root / "results")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    data = json.loads((root / "results" / "h200" / "text_rope.json").read_text())
    newest = data["newest"]
    data["runs"][newest]["targets"] = [dict(case="c", provider="dsfuse", verdict="c5 not measured")]
    data["joined"] = dict(cases={"c": newest, "c5": "20261101-000000-h200"},
                          targets=[dict(case="c", provider="dsfuse", verdict="1.10x c5 across runs met")])
    (root / "results" / "h200" / "text_rope_extra.json").write_text(json.dumps(data))
    rows = status.rows(root, OPS, status.site_link)
    row = next(r for r in rows if r[0].startswith("[Text RoPE, extra]"))
    assert "and 1 earlier part of its config" in row[3] and row[6] == "1 of 1 met"
    assert "/blob/main/results/h200/text_rope_extra.md#run-" in row[3]  # not on the op's page
    long = next(r for r in rows if r[0].startswith("[Gated DeltaNet, long]"))
    assert "(ops/gdn.md#run-" in long[3]  # the GDN page includes the long documents' tables
    assert [r[0] for r in rows if r[0].startswith("[Text RoPE")][0].startswith("[Text RoPE]")  # the op's own first
