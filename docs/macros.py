"""mkdocs-macros module: measured figures for the pages' prose, read from the report's data.

``python -m dsfuse.bench report`` writes ``results/<gpu>/<op>.json`` (every run's medians,
bandwidth fractions, floors, ratios, target verdicts, tuning medians and host times). A page that
sets ``render_macros: true`` in its front matter quotes them instead of typing numbers:

    {% set h200 = results("engram_gate", "h200") %}          the newest H200 run of the op
    {{ h200.us("gate_N4096_fwd") }}                           139.4 us  (dsfuse, graph/evicted)
    {{ h200.ratio("consumer_N4096_fwd+bwd", spread=True) }}   1.14x [1.07, 1.25]
    {{ h200.target_us("gate_N4096_fwd+bwd") }}                400 us  (the target the config sets)
    {{ h200.run }}                                            a link to the run's anchor
    {% set old = results("engram_gate", "h200", "20261129-094157-h200") %}   a cited older run

Every figure is formatted as the tables format it (us to 0.1, ratios to 0.01, fractions of copy in
whole percent). Targets come from the same data: the goals the run's config set (its copy of
``experiments/<op>/configs/<gpu>.yaml``), which the targets table judges; prose quotes them with
``target``, ``target_us``, ``target_of_copy``, ``target_speedup`` and ``target_fastest`` and never
types a target's number (``tests/test_site_targets.py``). The ratio is the project's one ratio:
control latency / dsfuse latency, medians over all samples of the run (docs/method.md). A figure
that the data does not hold raises, and the strict build fails (``on_error_fail``): prose never
quotes a number the data lacks.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

GRAPH_EVICTED = "graph/evicted"


def _us(x: float) -> str:
    return f"{x:.1f} us"


def _x(x: float) -> str:
    return f"{x:.2f}x"


def _span(values: list[str]) -> str:
    """``a to b`` of already formatted values (one value when they agree)."""
    lo, hi = values[0], values[-1]
    return lo if lo == hi else f"{lo} to {hi}"


class Figures:
    """The figures of one run of one op on one GPU (the newest unless ``run`` names another)."""

    def __init__(self, root: Path, op: str, gpu: str, run: str | None = None):
        path = root / "results" / gpu / f"{op}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no results of {op} on {gpu} (python -m dsfuse.bench report {op})")
        self.data = json.loads(path.read_text())
        self.op, self.gpu = op, gpu
        self.run_id = run or self.data.get("newest")
        if self.run_id not in self.data["runs"]:
            raise KeyError(f"{op} on {gpu}: no run {self.run_id!r} (runs: {sorted(self.data['runs'])})")
        self.fig = self.data["runs"][self.run_id]

    # the run

    @property
    def run(self) -> str:
        """The run id, linked to its anchor on the op's page."""
        return f"[`{self.run_id}`](#run-{self.run_id})"

    @property
    def commit(self) -> str:
        return f"`{(self.fig.get('commit') or '?')[:10]}`"

    def copy(self, clock: str | None = None) -> str:
        """The run's device-to-device copy bandwidth (the fastest clock's unless ``clock``)."""
        rates = self.fig["copy_tbps"]
        return f"{(rates[clock] if clock else max(rates.values())):.2f} TB/s"

    # one case

    def _get(self, table: str, case: str, provider: str, at: str | None = None):
        try:
            entry = self.fig[table][case][provider]
            return entry[at] if at is not None else entry
        except KeyError:
            raise KeyError(f"{self.op} run {self.run_id}: no {table} for case {case!r}, provider {provider!r}"
                           + (f", {at}" if at else "")) from None

    def us(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> str:
        """Median latency, e.g. ``139.4 us``."""
        return _us(self._get("us", case, provider, at))

    def value_us(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> float:
        return self._get("us", case, provider, at)

    def of_copy(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> str:
        """Achieved bandwidth as a fraction of the run's copy bandwidth, e.g. ``92%``."""
        return f"{100 * self._get('of_copy', case, provider, at):.0f}%"

    def floor(self, case: str, provider: str = "dsfuse") -> str:
        """The bytes floor at the run's copy bandwidth, e.g. ``345.7 us``."""
        return _us(self._get("floor_us", case, provider))

    def time_at(self, case: str, fraction: float | None = None, provider: str = "dsfuse") -> str:
        """The latency at which ``provider`` would reach ``fraction`` of the copy bandwidth (its bytes
        floor / ``fraction``), e.g. the time a ``>= 80% of copy`` goal allows; without ``fraction``,
        the bandwidth goal of the case's target (``min_of_copy``)."""
        if fraction is None:
            fraction = self._goal(case, "min_of_copy", provider)
        return _us(self._get("floor_us", case, provider) / fraction)

    def share(self, case: str, stem: str, provider: str = "dsfuse", **setting) -> str:
        """The case's bytes floor over a sweep setting's median: that setting's fraction of the copy
        bandwidth, e.g. ``84%`` for an elementwise kernel moving the case's bytes."""
        return f"{100 * self._get('floor_us', case, provider) / self._tuned(stem, 'us', setting):.0f}%"

    def _ratio(self, case: str, at: str, candidate: str) -> dict:
        return self._get("ratio", case, candidate, at)

    def ratio(self, case: str, at: str = GRAPH_EVICTED, candidate: str = "dsfuse", spread: bool = False) -> str:
        """Fastest valid control / dsfuse (ratio of medians), e.g. ``1.14x`` or ``1.14x [1.07, 1.25]``."""
        r = self._ratio(case, at, candidate)
        return _x(r["ratio"]) + (f" [{r['min']:.2f}, {r['max']:.2f}]" if spread else "")

    def control(self, case: str, at: str = GRAPH_EVICTED, candidate: str = "dsfuse") -> str:
        """The fastest valid control of a case, e.g. ```compile-max-autotune```."""
        return f"`{self._ratio(case, at, candidate)['control']}`"

    def ratios(self, cases: list[str], at: str | list[str] = GRAPH_EVICTED, candidate: str = "dsfuse") -> str:
        """The lowest to the highest ratio over ``cases`` (and clocks/caches ``at``): ``1.47x to 1.55x``."""
        ats = [at] if isinstance(at, str) else at
        return _span([_x(v) for v in sorted(self._ratio(c, a, candidate)["ratio"] for c in cases for a in ats)])

    def met(self, case: str, at: str = GRAPH_EVICTED, provider: str = "dsfuse") -> str:
        """The targets table's verdict for a case: ``met``, ``**missed**`` where any goal was missed, or
        ``not measured`` where none was missed and some could not be judged."""
        from dsfuse.bench.tables import verdict_state

        states = {verdict_state(t["verdict"]) for t in self._targets(case, provider, at)}
        return "**missed**" if "missed" in states else "not measured" if "not measured" in states else "met"

    def met_in(self, cases: list[str], goal: str, other: str | None = None, provider: str = "dsfuse",
               at: str = GRAPH_EVICTED) -> str:
        """One goal's verdict over ``cases``: ``met at all 6``, or ``met at 4 of 6 (missed: T1521_39x39, ...)``
        (and ``not measured: ...`` for those it could not judge)."""
        from dsfuse.bench.tables import verdict_state

        state = {c: verdict_state(self._goal_row(c, goal, provider, at, other)["verdict"]) for c in cases}
        missed = [c for c in cases if state[c] == "missed"]
        unmeasured = [c for c in cases if state[c] == "not measured"]
        if not missed and not unmeasured:
            return f"met at all {len(cases)}"
        notes = [f"**missed**: {', '.join(missed)}"] if missed else []
        notes += [f"not measured: {', '.join(unmeasured)}"] if unmeasured else []
        return f"met at {len(cases) - len(missed) - len(unmeasured)} of {len(cases)} ({'; '.join(notes)})"

    # targets: as the op's config sets them (experiments/<op>/configs/<gpu>.yaml, copied into the run)
    # and the targets table judges them; prose quotes them from here and never retypes a target's number

    def _targets(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> list[dict]:
        rows = [t for t in self.fig.get("targets", [])
                if t["case"] == case and t["provider"] == provider and t["clock/cache"] == at]
        if not rows:
            raise KeyError(f"{self.op} run {self.run_id}: no target for {case}, {provider}, {at} (targets: "
                           f"{[(t['case'], t['provider'], t['clock/cache']) for t in self.fig.get('targets', [])]})")
        return rows

    def _goal_row(self, case: str, goal: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED,
                  other: str | None = None) -> dict:
        """The one target of the case that sets ``goal`` (for ``min_speedup``: over provider ``other``)."""
        rows = [t for t in self._targets(case, provider, at) if goal in t.get("goals", {})
                and (other is None or other in t["goals"][goal])]
        if len(rows) != 1:
            raise KeyError(f"{self.op} run {self.run_id}: {len(rows)} targets of {case}, {provider}, {at} set {goal}"
                           + (f" over {other}" if other else "") + f"; python -m dsfuse.bench report {self.op}")
        return rows[0]

    def _goal(self, case: str, goal: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED, other: str | None = None):
        return self._goal_row(case, goal, provider, at, other)["goals"][goal]

    def verdict(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> str:
        """The targets table's verdict per goal, e.g. ``latency **missed**, bandwidth met``."""
        return "; ".join(t["verdict"] for t in self._targets(case, provider, at)).replace("MISSED", "**missed**")

    def target(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> str:
        """Every goal set for the case as the targets table states it, e.g. ```<= 75 us and >= 85% of copy```."""
        return "; ".join(f"`{t['target']}`" for t in self._targets(case, provider, at))

    def target_us(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> str:
        """A target's latency goal (``max_us``), e.g. ``1,600 us``."""
        return f"{self._goal(case, 'max_us', provider, at):,g} us"

    def target_of_copy(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> str:
        """A target's bandwidth goal (``min_of_copy``), e.g. ``85%`` (of the run's copy bandwidth)."""
        return f"{100 * self._goal(case, 'min_of_copy', provider, at):.0f}%"

    def target_speedup(self, case: str, other: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> str:
        """A target's speedup goal over provider ``other`` (``min_speedup``), e.g. ``5x``."""
        return f"{self._goal(case, 'min_speedup', provider, at, other)[other]:g}x"

    def target_fastest(self, case: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED,
                       as_latency: bool = False) -> str:
        """A target against the fastest valid control (``max_of_fastest``), as the report's ratio
        (``1.18x``: control / dsfuse at least that), or with ``as_latency`` as the latency saved
        (``15%`` lower)."""
        fraction = self._goal(case, "max_of_fastest", provider, at)
        return f"{100 * (1 - fraction):.0f}%" if as_latency else _x(1 / fraction)

    def _ceiling(self) -> float:
        return max(self.fig["copy_tbps"].values())

    def floor_plus(self, case: str, extra_bytes: float, provider: str = "dsfuse") -> str:
        """The bytes floor with ``extra_bytes`` more moved at the run's copy bandwidth (a design's own floor)."""
        return _us(self._get("floor_us", case, provider) + extra_bytes / (self._ceiling() * 1e6))

    def copy_needed(self, case: str, limit_us: float | None = None, extra_bytes: float = 0,
                    provider: str = "dsfuse") -> str:
        """The fraction of the copy bandwidth a design moving the floor's bytes plus ``extra_bytes`` needs
        to finish within ``limit_us`` (default: the case's latency target), e.g. ``96%``."""
        if limit_us is None:
            limit_us = self._goal(case, "max_us", provider)
        floor = self._get("floor_us", case, provider) + extra_bytes / (self._ceiling() * 1e6)
        return f"{100 * floor / limit_us:.0f}%"

    def at_gate_floor(self, consumer: str, gate: str, at: str = GRAPH_EVICTED) -> str:
        """Consumer ratio if its gate ran at the bytes floor: the fastest control's consumer time over
        that time with the control's gate alone (device time, graph clock) replaced by dsfuse's gate
        floor (an additive estimate, as in the op's consumer table)."""
        r = self._ratio(consumer, at, "dsfuse")
        gate_us = self._get("us", gate, r["control"], "graph/" + at.split("/")[1])
        return _x(r["control_us"] / (r["control_us"] - gate_us + self._get("floor_us", gate, "dsfuse")))

    def speedup(self, case: str, other: str, provider: str = "dsfuse", at: str = GRAPH_EVICTED) -> str:
        """``other``'s median over ``provider``'s (the same ratio against a named provider), e.g. ``3.65x``."""
        return _x(self._get("us", case, other, at) / self._get("us", case, provider, at))

    def over(self, case: str, limit_us: float | None = None, provider: str = "dsfuse", at: str = GRAPH_EVICTED,
             target_of: str = "dsfuse") -> str:
        """How far the median is above ``limit_us`` (default: the latency target of ``case`` and
        provider ``target_of``), in percent of it, e.g. ``4%``."""
        if limit_us is None:
            limit_us = self._goal(case, "max_us", target_of, at)
        return f"{100 * (self._get('us', case, provider, at) / limit_us - 1):.0f}%"

    # whole-model and host figures

    def tower(self, geometries: list[str], field: str = "ratio") -> str:
        """Whole-tower ratios (eager / dsfuse) over ``geometries``: ``1.02x to 1.03x``; ``field`` may be
        ``ratio``, ``min`` or ``max`` (the per-block range) or ``wall_ratio``."""
        tower = self.fig.get("extra", {}).get("tower")
        if not tower:
            raise KeyError(f"{self.op} run {self.run_id}: no whole-tower timing")
        return _span([_x(v) for v in sorted(tower[g][field] for g in geometries)])

    def tower_blocks(self, geometries: list[str]) -> str:
        """The lowest to the highest per-block tower ratio over ``geometries``: ``1.03x to 1.33x``."""
        tower = self.fig["extra"]["tower"]
        return _span([_x(min(tower[g]["min"] for g in geometries)), _x(max(tower[g]["max"] for g in geometries))])

    def tower_gain(self, geometries: list[str]) -> str:
        """The tower's ratios as a time saved, in percent of the eager time: ``1.5% to 3.4%``."""
        tower = self.fig["extra"]["tower"]
        return _span([f"{100 * (1 - 1 / v):.1f}%" for v in sorted(tower[g]["ratio"] for g in geometries)])

    def host(self, call: str, provider: str = "dsfuse", run: str | None = None) -> str:
        """Median host time per call of ``run``, by default the newest host-time run that measured
        ``provider`` (see `host_run`), e.g. ``34.2 us``."""
        return _us(self.data["host_time"][run or self.host_run(provider)][call][provider])

    def host_x(self, calls: str | list[str], provider: str = "dsfuse", run: str | None = None) -> str:
        """The host time of ``calls`` (summed where a list: the parts of a call) as a multiple of the
        same run's ``torch.add``: ``8.9x``."""
        rows = self.data["host_time"][run or self.host_run(provider)]
        total = sum(rows[c][provider] for c in ([calls] if isinstance(calls, str) else calls))
        return f"{total / rows['torch.add (1 kernel)']['baseline']:.1f}x"

    def host_target(self, call: str, run: str | None = None) -> str:
        """The op's host-time target of ``call`` (``HOST_TARGETS`` of its bench module) and its verdict
        in ``run`` (default: the newest): ``<= 6x torch.add, missed``."""
        from dsfuse.bench.report import host_targets
        from dsfuse.bench.tables import meets_ratio

        limit = host_targets(self.op)[call]
        rows = self.data["host_time"][run or self.host_run()]
        met = meets_ratio(rows[call]["dsfuse"], rows["torch.add (1 kernel)"]["baseline"], limit)
        return f"<= {limit:g}x torch.add, {'met' if met else 'missed'}"

    def host_met(self, call: str, provider: str = "dsfuse cutedsl", run: str | None = None) -> str:
        """``met`` or ``missed``: the CuTe DSL call target (at most ``HOST_CUTEDSL_TARGET_US`` per call)."""
        from dsfuse.bench.tables import meets_cutedsl

        return "met" if meets_cutedsl(self.data["host_time"][run or self.host_run(provider)][call][provider]) else "missed"

    def host_run(self, provider: str = "dsfuse") -> str:
        """The id of the newest host-time run with rows of ``provider`` (a run on a machine without
        the CuTe DSL extra has no ``dsfuse cutedsl`` rows)."""
        runs = self.data.get("host_time", {})
        measured = [run for run, calls in runs.items() if any(provider in row for row in calls.values())]
        if not measured:
            raise KeyError(f"{self.op} on {self.gpu}: no host-time run measured {provider!r}")
        return max(measured)

    def tuned(self, stem: str, value: str = "us", **setting) -> str:
        """The median ``value`` of the setting of sweep ``stem`` matching ``setting``, e.g. ``30.4 us``."""
        return _us(self._tuned(stem, value, setting))

    def _tuned(self, stem: str, value: str, setting: dict) -> float:
        values = [r[value] for r in self._rows(stem, value, setting)]
        if len(values) != 1:
            raise KeyError(f"{self.op} on {self.gpu}: sweep {stem!r} has {len(values)} settings matching {setting}, "
                           "not one")
        return values[0]

    def _rows(self, stems: str | list[str], value: str, setting: dict) -> list[dict]:
        """The settings of the sweep(s) ``stems`` matching ``setting`` that hold ``value``. A setting's
        value may be a list (any of them) and may hold ``*`` wildcards (``mode="bwd-onepass-*"``)."""
        tuning = self.data.get("tuning", {})
        rows = []
        for stem in [stems] if isinstance(stems, str) else stems:
            if stem not in tuning:
                raise KeyError(f"{self.op} on {self.gpu}: no sweep {stem!r}")
            rows += [dict(r, _stem=stem) for r in tuning[stem] if r.get(value) is not None and all(
                any(fnmatchcase(str(r.get(k)), str(p)) for p in (v if isinstance(v, (list, tuple)) else [v]))
                for k, v in setting.items())]
        return rows

    def _some(self, stems, value: str, setting: dict) -> list[float]:
        values = sorted(r[value] for r in self._rows(stems, value, setting))
        if not values:
            raise KeyError(f"{self.op} on {self.gpu}: sweep {stems!r} has no setting matching {setting}")
        return values

    def tuned_best(self, stem: str | list[str], value: str = "us", **setting) -> str:
        """The lowest median ``value`` over the settings of sweep(s) ``stem`` matching ``setting``, e.g. the
        best setting of a design: ``501.8 us``."""
        return _us(self._some(stem, value, setting)[0])

    def tuned_span(self, stem: str | list[str], value: str = "us", **setting) -> str:
        """The lowest to the highest median over the matching settings: ``424.2 us to 427.8 us``."""
        return _span([_us(v) for v in self._some(stem, value, setting)])

    def _pairs(self, stems, base: dict, by, value: str, setting: dict) -> list[tuple[float, float]]:
        """Each matching setting with the one setting of its sweep that matches ``base`` and has the
        same ``by`` knobs (the setting it is compared with)."""
        pairs = []
        for r in self._rows(stems, value, setting):
            match = [b[value] for b in self._rows(r["_stem"], value, base) if all(b.get(k) == r.get(k) for k in by)]
            if len(match) != 1:
                raise KeyError(f"{self.op} on {self.gpu}: sweep {r['_stem']!r} has {len(match)} settings matching "
                               f"{base} with the {list(by)} of {r}, not one")
            pairs.append((r[value], match[0]))
        if not pairs:
            raise KeyError(f"{self.op} on {self.gpu}: sweep {stems!r} has no setting matching {setting}")
        return pairs

    def tuned_over(self, stem: str | list[str], base: dict, by: list[str] | tuple = (), value: str = "us",
                   **setting) -> str:
        """How far the matching settings are above the setting matching ``base`` (with the same ``by``
        knobs, in the same sweep), in percent of it: the lowest to the highest, e.g. ``2% to 9%``."""
        return _span([f"{v:.0f}%" for v in sorted(100 * (x / b - 1) for x, b in self._pairs(stem, base, by, value,
                                                                                            setting))])

    def tuned_apart(self, stem: str | list[str], base: dict, by: list[str] | tuple = (), value: str = "us",
                    **setting) -> str:
        """The largest difference between a matching setting and its ``base`` setting (as in
        ``tuned_over``), either way: two orders ``within 0.9 us``."""
        return _us(max(abs(x - b) for x, b in self._pairs(stem, base, by, value, setting)))


def define_env(env):
    root = Path(env.conf["config_file_path"]).resolve().parent

    @env.macro
    def results(op: str, gpu: str, run: str | None = None) -> Figures:
        """The figures of ``op`` on ``gpu`` (a folder under results/): the newest run, or ``run``."""
        return Figures(root, op, gpu, run)

    def _raw_median(run: str, match: dict) -> float:
        """The median ``us`` of the rows of ``<run>/samples.csv`` (or its compacted ``.gz``,
        `dsfuse.bench.paths.raw_file`) whose columns equal ``match`` (compared as text); none raises."""
        import csv
        import gzip
        import statistics

        from dsfuse.bench.paths import raw_file

        path = raw_file(root / run, "samples.csv")
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt", newline="") as fh:
            values = [float(row["us"]) for row in csv.DictReader(fh)
                      if all(row.get(key) == str(want) for key, want in match.items())]
        if not values:
            raise ValueError(f"no row of {run}/samples.csv matches {match}")
        return statistics.median(values)

    @env.macro
    def raw_field(run: str, file: str, column: str, **match) -> float:
        """The one value of ``column`` in the row of ``<run>/<file>`` (a raw CSV, or its compacted
        ``.gz``) whose columns equal ``match`` (as text); none or several raise."""
        import csv
        import gzip

        from dsfuse.bench.paths import raw_file

        path = raw_file(root / run, file)
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt", newline="") as fh:
            values = [float(row[column]) for row in csv.DictReader(fh)
                      if all(row.get(key) == str(want) for key, want in match.items())]
        if len(values) != 1:
            raise ValueError(f"{len(values)} rows of {run}/{file} match {match}, not one")
        return values[0]

    @env.macro
    def raw_median_us(run: str, **match) -> str:
        """The median ``us`` of a raw folder's samples (relative to the repository root) whose columns
        equal ``match``: a probe's or a run's figure, formatted as the tables format it."""
        return _us(_raw_median(run, match))

    @env.macro
    def ncu_value(path: str, label: str, nth: int = 0) -> str:
        """A figure of an Nsight Compute report printed with ``--print-details all`` (a file relative
        to the repository root): the value and unit of its ``nth`` line (from 0) that starts with
        ``label``, as the report prints them (``"1.48 ms"``); none raises."""
        import re

        import gzip

        file = root / path  # kept gzip-compressed (``.txt.gz``) to keep the tree small
        rows = []
        for line in (gzip.open(file, "rt") if file.suffix == ".gz" else open(file)).read().splitlines():
            m = re.match(rf"\s+{re.escape(label)}\s{{2,}}(\S+)?\s+([\d.,]+)\s*$", line)
            if m:
                rows.append(f"{m.group(2)} {m.group(1)}" if m.group(1) and m.group(1) not in ("inst", "%")
                            else m.group(2) + (" %" if m.group(1) == "%" else ""))
        if len(rows) <= nth:
            raise ValueError(f"{path}: no line {nth} starting with {label!r}")
        return rows[nth]

    def _raw_ratio(top: dict, bottom: dict) -> float:
        top, bottom = dict(top), dict(bottom)
        return _raw_median(top.pop("run"), top) / _raw_median(bottom.pop("run"), bottom)

    @env.macro
    def raw_median_ratio(top: dict, bottom: dict) -> str:
        """The ratio of two such medians, each given as ``dict(run=<raw folder>, <column>=<value>, ..)``."""
        return _x(_raw_ratio(top, bottom))

    @env.macro
    def raw_ratio_judged(top: dict, bottom: dict, at_least: float | None = None, at_most: float | None = None) -> str:
        """`raw_median_ratio` with its verdict against a goal, judged on the unrounded ratio:
        ``1.12x (met)`` or ``0.92x (**missed**)`` (``at_least``: the ratio's floor; ``at_most``: its ceiling)."""
        if (at_least is None) == (at_most is None):
            raise ValueError("raw_ratio_judged: give one of at_least and at_most")
        ratio = _raw_ratio(top, bottom)
        ok = ratio >= at_least if at_least is not None else ratio <= at_most
        return f"{_x(ratio)} ({'met' if ok else '**missed**'})"

    @env.macro
    def raw_time_to_lose(top: dict, bottom: dict, speedup: float = 1.10) -> str:
        """How much of ``top``'s median time (given as for `raw_median_ratio`) it would still have to
        lose to be ``speedup`` times as fast as ``bottom``'s: a whole percentage, "under 1 %", or "none"."""
        top, bottom = dict(top), dict(bottom)
        short = 1 - _raw_median(bottom.pop("run"), bottom) / speedup / _raw_median(top.pop("run"), top)
        return "none" if short <= 0 else "under 1 %" if short < 0.005 else f"{100 * short:.0f} %"
