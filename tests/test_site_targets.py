"""Prose never states a target other than the one the tables judge.

Each op's targets are set once, in ``experiments/<op>/configs/<gpu>.yaml`` (``max_us``,
``min_of_copy``, ``min_speedup``, ``max_of_fastest``, ``max_of_case``); the host-time targets in
each op's bench module (``HOST_TARGETS``: multiples of ``torch.add``) and `dsfuse.bench.tables`
(``HOST_CUTEDSL_TARGET_US``). The generated tables judge
those, and the op pages quote them through ``docs/macros.py`` (``target``, ``target_us``,
``target_of_copy``, ``target_speedup``, ``target_fastest``) instead of typing them.

This test reads the prose of ``README.md``, ``docs/**/*.md`` and the generated ``results/**/*.md``
(code, tables and macro expressions left out) and checks every number that a sentence about a
target or goal states as a latency (``us``), a percentage or a factor (``x``): it must be a value
that a config of the page's op (or the host-time table) sets. It also checks that the targets the
newest run of each op was judged by (``results/<gpu>/<op>.json``, what the tables and the macros
show) are those of the op's config for that GPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from dsfuse.bench import experiments, report, tables

REPO = Path(__file__).resolve().parents[1]
TARGET_WORDS = re.compile(r"\b(targets?|goals?)\b", re.IGNORECASE)
NUMBER_UNITS = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s*(us\b|%|x\b)")


def config_targets(op: str) -> list[dict]:
    """Every target of every config of ``op``."""
    return [t for path in sorted((REPO / "experiments" / op / "configs").glob("*.yaml"))
            for t in (yaml.safe_load(path.read_text()) or {}).get("targets", [])]


def allowed(op: str | None) -> dict[str, set[float]]:
    """The values a prose sentence about a target may state, per unit, for ``op`` (any op when None)."""
    values: dict[str, set[float]] = {"us": {tables.HOST_CUTEDSL_TARGET_US}, "%": set(), "x": set()}
    for name in ([op] if op else list(experiments())):
        values["x"] |= {float(r) for r in report.host_targets(name).values()}
        for t in config_targets(name):
            if "max_us" in t:
                values["us"].add(float(t["max_us"]))
            if "min_of_copy" in t:
                values["%"].add(round(100 * t["min_of_copy"]))
            for factor in t.get("min_speedup", {}).values():
                values["x"].add(float(factor))
            if "max_of_case" in t:
                values["x"].add(float(t["max_of_case"]["factor"]))
            if "max_of_fastest" in t:
                values["%"].add(round(100 * (1 - t["max_of_fastest"])))
                values["x"].add(round(1 / t["max_of_fastest"], 2))
                values["x"].add(float(t["max_of_fastest"]))
    return values


def prose_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "results").rglob("*.md"))]
    return [p for p in files if p.is_file()]


def page_op(path: Path) -> str | None:
    """The op a page is about: ``docs/ops/<op>.md``, ``docs/api/<op>.md``, ``results/<gpu>/<op>*.md``."""
    ops = sorted(experiments(), key=len, reverse=True)
    rel = path.relative_to(REPO).as_posix()
    if rel.startswith(("docs/ops/", "docs/api/", "results/")):
        return next((op for op in ops if path.stem == op or path.stem.startswith(op + "_")), None)
    return None


def prose(text: str) -> str:
    """``text`` without front matter, fenced code, table rows, HTML comments and macro expressions."""
    text = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)
    text = re.sub(r"^([ \t]*)(```|~~~)[^\n]*\n.*?^\1\2[ \t]*$", "", text, flags=re.S | re.M)
    text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}|\{#!.*?!#\}|<!--.*?-->", " ", text, flags=re.S)
    return "\n".join("" if line.lstrip().startswith("|") else line for line in text.splitlines())


def sentences(text: str) -> list[str]:
    """Sentences of each paragraph and list item (a full stop, ``!`` or ``?`` before a space and a capital
    letter, a code span or bold text ends one; a colon or a semicolon does not: ``target: <= 15 us``)."""
    out = []
    for block in re.split(r"\n\s*\n|\n\s*[-*] |\n\s*\d+\. ", text):
        out += re.split(r"(?<=[.!?])\s+(?=[A-Z`*(])", " ".join(block.split()))
    return out


def stated_targets(text: str) -> list[tuple[str, float, str]]:
    """(sentence, value, unit) of every number with a unit in a sentence about a target or goal."""
    found = []
    for sentence in sentences(prose(text)):
        if TARGET_WORDS.search(sentence):
            found += [(sentence, float(number.replace(",", "")), unit)
                      for number, unit in NUMBER_UNITS.findall(sentence)]
    return found


def test_prose_states_only_the_configured_targets():
    wrong = []
    for path in prose_files():
        op = page_op(path)
        ok = allowed(op)
        for sentence, value, unit in stated_targets(path.read_text()):
            if value not in ok[unit]:
                wrong.append(f"{path.relative_to(REPO)}: {value:g}{unit} is no target of "
                             f"{op or 'any op'} (configs set {sorted(ok[unit])}): {sentence[:160]}")
    assert not wrong, "prose restates a target the configs do not set (quote it with docs/macros.py's " \
                      "target_* macros, or drop the number):\n" + "\n".join(wrong)


@pytest.mark.parametrize("text, found", [
    ("The in-place target (`<= 21 us`) is missed.", [21.0]),
    ("The 400 us target is {{ h200.met('x') }}, at 414.3 us; a 4% gap.", [400.0, 414.3, 4.0]),
    ("Host time (target for a call: `<= 15 us`; the table below).", [15.0]),
    ("A sentence about speed: 414.3 us.\n\nThe target is met.", []),
    ("The target is {{ h200.target_us('x') }}.\n\n| case | target |\n| --- | --- |\n| x | <= 12 us |", []),
    ("```text\ntarget = 12 us\n```\nNo number here.", []),
])
def test_the_scan_finds_numbers_in_target_sentences_only(text, found):
    assert [value for _, value, _ in stated_targets(text)] == found


def test_a_restated_target_that_differs_from_the_config_is_caught():
    ok = allowed("engram_gate")
    assert 400.0 in ok["us"] and 380.0 not in ok["us"]  # configs/h200.yaml: gate_N4096_fwd+bwd max_us 400
    assert 15 in ok["%"] and 1.18 in ok["x"]  # max_of_fastest 0.85: 15% lower latency, 1.18x


def test_the_tables_judge_the_configured_targets():
    """The newest run's judged targets (the tables, the macros) are the op's config for that GPU."""
    stale = []
    for op in experiments():
        for figures in sorted((REPO / "results").glob(f"*/{op}.json")):
            data = json.loads(figures.read_text())
            config = REPO / "experiments" / op / "configs" / f"{figures.parent.name}.yaml"
            if not data.get("newest") or not config.exists():
                continue
            judged = [t.get("goals") for t in data["runs"][data["newest"]].get("targets", [])]
            configured = (yaml.safe_load(config.read_text()) or {}).get("targets", [])
            if judged != configured:
                stale.append(f"{figures.relative_to(REPO)}: judged {judged}, {config.relative_to(REPO)} sets "
                             f"{configured}")
    assert not stale, ("the tables judge the targets the newest run recorded (its config.yaml), and they differ "
                       "from the config's: a changed target takes a new run on that GPU, or keep the config's "
                       "targets as the run recorded them:\n" + "\n".join(stale))
