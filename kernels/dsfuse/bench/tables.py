"""The report's tables, one small builder each; `dsfuse.bench.report` composes them.

Every builder returns a DataFrame whose columns are the table's headers and whose cells are
what the table shows (mostly strings formatted by `fmt`); `markdown` renders it
as a GitHub table. As with any tabulate table, numeric-looking cells are read as numbers:
their column is right-aligned and their digits are those of tabulate's number format.
"""

from __future__ import annotations

import pandas as pd

NA = float("nan")
CLOCK_REGIMES = [("graph", "hot"), ("graph", "evicted"), ("eager", "hot"), ("eager", "evicted"), ("wall", "hot")]
RATIO_COLUMNS = ["case", "dsfuse", "clock/cache", "median us", "fastest control (us)", "ratio [min, max]", "TB/s",
                 "of copy", "floor us", "checks pass"]
TARGET_COLUMNS = ["case", "provider", "clock/cache", "target", "median us", "of copy", "floor us", "verdict"]
CHECK_COLUMNS = ["case", "provider", "check", "status", "stages passed", "note"]
NOTE_CHARS = 160  # longest note of the checks table
REPEATS = ("round", "block")  # probe columns that repeat a setting: one median over all of them
HOST_TORCH_ADD = "torch.add (1 kernel)"  # the baseline call the host-time targets are ratios to
HOST_AUTOGRAD = "autograd forward+backward"  # target: below eager PyTorch's, for every op
HOST_CUTEDSL_TARGET_US = 15.0  # every whole eager call of a CuTe DSL backend (provider ``dsfuse cutedsl``)
HOST_PROVIDERS = ("dsfuse", "dsfuse cutedsl", "eager PyTorch", "baseline")  # the host-time table's columns


def fmt(x: float, digits: int = 1) -> str:
    return "n/a" if pd.isna(x) else f"{x:.{digits}f}"


def markdown(table: pd.DataFrame, **kwargs) -> str:
    """``table`` as a GitHub Markdown table, without its index (tabulate options in ``kwargs``).

    Numbers print as plain decimals (``floatfmt='.12g'``: the digits `fmt` wrote, never
    scientific notation, as tabulate's default ``g`` gives from a million on, e.g. smoke-run medians).
    """
    kwargs.setdefault("floatfmt", ".12g")
    return table.to_markdown(index=False, tablefmt="github", **kwargs)


def frame(rows: list[list], columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=columns)


# dsfuse against the fastest valid control


def ratio_table(ratios: pd.DataFrame) -> pd.DataFrame:
    """One row per candidate, case and clock/cache regime (rows of `report.summarize`'s ratios)."""
    ordered = ratios.sort_values(["mode", "case", "candidate", "clock", "regime"])
    return frame([ratio_row(r) for r in ordered.itertuples()], RATIO_COLUMNS)


def ratio_row(r) -> list[str]:
    return [r.case, r.candidate, f"{r.clock}/{r.regime}", fmt(r.candidate_us), f"{r.control} {fmt(r.control_us)}",
            f"{fmt(r.ratio, 2)} [{fmt(r.ratio_min, 2)}, {fmt(r.ratio_max, 2)}]", fmt(r.tbps, 2),
            f"{fmt(100 * r.of_copy, 0)}%", fmt(r.floor_us), "yes" if r.candidate_valid else "NO"]


# targets


def target_table(targets: list[dict], med: pd.DataFrame, ratios: pd.DataFrame,
                 floors: dict[tuple[str, str], float]) -> pd.DataFrame:
    """Each target of the op's config: its goals, the measured median, and whether each goal was met."""
    return frame([target_row(t, med, ratios, floors) for t in targets], TARGET_COLUMNS)


def target_where(t: dict) -> tuple[str, str]:
    """The target's clock and cache regime (default: CUDA Graph replay, L2 evicted)."""
    return t.get("clock", "graph"), t.get("regime", "evicted")


def medians_of(med: pd.DataFrame, case: str, provider: str, clock: str, regime: str) -> pd.DataFrame:
    return med[(med["case"] == case) & (med["provider"] == provider) & (med["clock"] == clock)
               & (med["regime"] == regime)]


def target_row(t: dict, med: pd.DataFrame, ratios: pd.DataFrame, floors: dict[tuple[str, str], float]) -> list[str]:
    clock, regime = target_where(t)
    sel = medians_of(med, t["case"], t["provider"], clock, regime)
    us = float(sel["us"].iloc[0]) if not sel.empty else NA
    frac = float(sel["of_copy"].iloc[0]) if not sel.empty else NA
    goals = target_goals(t, us, frac, med, ratios)
    verdict = ", ".join(v for _, v in goals) if not sel.empty else "not measured"
    return [t["case"], t["provider"], f"{clock}/{regime}", " and ".join(g for g, _ in goals), fmt(us),
            f"{fmt(100 * frac, 0)}%" if not sel.empty else fmt(NA), fmt(floors.get((t["case"], t["provider"]), NA)),
            verdict]


def target_goals(t: dict, us: float, frac: float, med: pd.DataFrame, ratios: pd.DataFrame) -> list[tuple[str, str]]:
    """(goal, verdict) for each goal the target sets, in the order the table states them."""
    goals = []
    if "max_us" in t:
        goals.append(latency_goal(t["max_us"], us))
    if "min_of_copy" in t:
        goals.append(bandwidth_goal(t["min_of_copy"], frac))
    goals += [speedup_goal(t, other, factor, us, med) for other, factor in t.get("min_speedup", {}).items()]
    if "max_of_fastest" in t:
        goals.append(fastest_goal(t, us, ratios))
    if "max_of_case" in t:
        goals.append(case_goal(t, us, med))
    return goals


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def verdict_state(verdict: str) -> str:
    """A targets table verdict (one goal's or a row's, its goals joined) as ``missed`` (some goal
    missed), ``not measured`` (none missed, some not measured) or ``met``."""
    if "MISSED" in verdict:
        return "missed"
    return "not measured" if "not measured" in verdict else "met"


def latency_goal(max_us: float, us: float) -> tuple[str, str]:
    return f"<= {max_us} us", "latency " + _met(us <= max_us)


def bandwidth_goal(min_of_copy: float, frac: float) -> tuple[str, str]:
    return f">= {100 * min_of_copy:.0f}% of copy", "bandwidth " + _met(frac >= min_of_copy)


def speedup_goal(t: dict, other: str, factor: float, us: float, med: pd.DataFrame) -> tuple[str, str]:
    """At least ``factor`` times faster than provider ``other`` (same case, clock and regime)."""
    ref = medians_of(med, t["case"], other, *target_where(t))
    goal = f">= {factor}x {other}"
    if ref.empty:
        return goal, f"{other} not measured"
    speedup = float(ref["us"].iloc[0]) / us
    return goal, f"{fmt(speedup, 2)}x {other} " + _met(speedup >= factor)


def fastest_goal(t: dict, us: float, ratios: pd.DataFrame) -> tuple[str, str]:
    """Latency at most ``max_of_fastest`` times the fastest valid control's, stated and judged as the
    report's one ratio: control / dsfuse >= 1 / ``max_of_fastest``."""
    sel = ratios_of(ratios, t)
    need = 1 / t["max_of_fastest"]
    goal = f">= {need:.2f}x the fastest valid control (latency <= {t['max_of_fastest']:.2f}x)"
    if sel.empty:
        return goal, "fastest valid control not measured"
    ratio = float(sel["control_us"].iloc[0] / us)
    return goal, f"{fmt(ratio, 2)}x {sel['control'].iloc[0]} " + _met(ratio >= need)


def case_goal(t: dict, us: float, med: pd.DataFrame) -> tuple[str, str]:
    """Latency at most ``factor`` times the same provider's at another case of the run (same clock
    and regime): ``max_of_case: {case: T32768_n5_l2_fwd, factor: 1.25}``, e.g. one document's step
    against five documents' of the same token count. The other case is named by what differs in its
    name (`case_label`), so that the table stays narrow. Where the medians carry a ``run`` (the joined
    parts of a config, `dsfuse.bench.report.config_parts`) and the two cases come from two runs, the
    verdict says "across runs"."""
    other, factor = t["max_of_case"]["case"], t["max_of_case"]["factor"]
    ref = medians_of(med, other, t["provider"], *target_where(t))
    label = case_label(other, t["case"])
    if ref.empty:
        return f"<= {factor}x {label}", f"{label} not measured"
    over = us / float(ref["us"].iloc[0])
    own = medians_of(med, t["case"], t["provider"], *target_where(t))
    across = "run" in med and not own.empty and own["run"].iloc[0] != ref["run"].iloc[0]  # joined parts of a config
    return f"<= {factor}x {label}", f"{fmt(over, 2)}x {label} " + ("across runs " if across else "") + _met(over <= factor)


def case_label(other: str, case: str) -> str:
    """``other`` as told apart from ``case``: where the two names have the same number of ``_`` parts
    and differ in some, "its" and those parts (``T32768_n5_l2_fwd`` from ``T32768_n1_l2_fwd``:
    ``its n5 case``); otherwise ``other`` whole."""
    theirs, ours = other.split("_"), case.split("_")
    differ = [a for a, b in zip(theirs, ours) if a != b]
    if len(theirs) != len(ours) or not differ or len(differ) == len(theirs):
        return other
    return f"its {'_'.join(differ)} case"


def ratios_of(ratios: pd.DataFrame, t: dict) -> pd.DataFrame:
    if ratios.empty:
        return ratios
    clock, regime = target_where(t)
    return ratios[(ratios["case"] == t["case"]) & (ratios["candidate"] == t["provider"])
                  & (ratios["clock"] == clock) & (ratios["regime"] == regime)]


# every provider, every check


def latency_table(med: pd.DataFrame) -> pd.DataFrame:
    """Median us of every case and provider; one column per clock/cache regime of the run."""
    present = [cr for cr in CLOCK_REGIMES if ((med["clock"] == cr[0]) & (med["regime"] == cr[1])).any()]
    wide = med.pivot_table(index=["case", "provider"], columns=["clock", "regime"], values="us")
    rows = [[case, provider] + [fmt(wide.loc[(case, provider)].get(cr, NA)) for cr in present]
            for case, provider in wide.index]
    return frame(rows, ["case", "provider"] + [f"{c}/{r}" for c, r in present])


def check_table(validation: pd.DataFrame) -> pd.DataFrame:
    """One row per case and provider whose checks applied (not all 'n/a'), in the order they ran."""
    groups = validation.groupby(["case", "provider"], sort=False)
    rows = [check_row(case, provider, checks) for (case, provider), checks in groups
            if not (checks["status"] == "n/a").all()]
    return frame(rows, CHECK_COLUMNS)


def check_row(case: str, provider: str, checks: pd.DataFrame) -> list[str]:
    failed = checks[checks["status"] == "fail"]
    skipped = checks[~checks["status"].isin(["pass", "fail", "n/a"])]
    status = "fail" if not failed.empty else ("pass" if (checks["status"] == "pass").any() else "not run")
    passed = ", ".join(sorted(set(checks.loc[checks["status"] == "pass", "stage"])))
    return [case, provider, checks["check"].iloc[0], status, passed, check_note(failed, skipped)[:NOTE_CHARS]]


def check_note(failed: pd.DataFrame, skipped: pd.DataFrame) -> str:
    """First line of each error, and the mismatch count of each failure without one."""
    notes = {str(e).splitlines()[0] for e in pd.concat([failed, skipped])["error"] if e}
    notes |= {f"{r.mismatches} elements differ (max abs diff {float(r.max_abs_diff):.3g})"
              for r in failed.itertuples() if not r.error and str(r.mismatches)}
    return "; ".join(sorted(notes))


# tuning sweeps and probes (raw/tuning/*.csv)


def blocks_table(df: pd.DataFrame) -> pd.DataFrame:
    """Launch-constant sweep, L2 evicted: median us per mode and elements per program (rows), warps (columns)."""
    evicted = df[df["regime"] == "evicted"]
    wide = evicted.groupby(["mode", "elements", "warps"])["us"].median().unstack("warps")
    rows = [[mode, elements] + [fmt(v) for v in row] for (mode, elements), row in wide.iterrows()]
    return frame(rows, ["mode", "elements"] + [str(w) for w in wide.columns])


def meets_ratio(us: float, add_us: float, limit: float) -> bool:
    """A host-time ratio target: ``us`` at most ``limit`` times the same run's ``torch.add`` (``add_us``)."""
    return us / add_us <= limit


def meets_cutedsl(us: float) -> bool:
    """The CuTe DSL call target: at most ``HOST_CUTEDSL_TARGET_US`` per whole call."""
    return us <= HOST_CUTEDSL_TARGET_US


def host_time_table(samples: pd.DataFrame, ratio_targets: dict[str, float] | None = None) -> pd.DataFrame:
    """A host-time run (``host_time.csv`` of ``python -m dsfuse.bench.host_time run``): the median host
    us per call and provider; dsfuse's median as a multiple of ``torch.add``'s in the same run; the
    targets and whether dsfuse meets them: ``ratio_targets`` (call -> at most that many ``torch.add``,
    the op's ``HOST_TARGETS``) and an autograd forward+backward below eager PyTorch's. With a CuTe DSL
    provider, whether each of its whole calls (not the rows of a call's parts) meets 15 us."""
    ratio_targets = ratio_targets or {}
    med = samples.groupby(["call", "provider"], sort=False)["host_us"].median().unstack("provider")
    out = pd.DataFrame({"call": med.index})
    for provider in HOST_PROVIDERS:
        if provider in med:
            out[f"{provider} us"] = [f"{v:.1f}" if pd.notna(v) else "" for v in med[provider]]
    ours = med["dsfuse"] if "dsfuse" in med else pd.Series(float("nan"), index=med.index)
    add = med.loc[HOST_TORCH_ADD, "baseline"] if HOST_TORCH_ADD in med.index and "baseline" in med else float("nan")
    out["x torch.add"] = [f"{v / add:.1f}" if pd.notna(v) and pd.notna(add) else "" for v in ours]
    eager = med["eager PyTorch"] if "eager PyTorch" in med else pd.Series(float("nan"), index=med.index)
    target, met = [], []
    for call in med.index:
        if call in ratio_targets:
            target.append(f"<= {ratio_targets[call]:g}x torch.add")
            ok = meets_ratio(ours[call], add, ratio_targets[call]) if pd.notna(ours[call]) and pd.notna(add) else None
        elif call == HOST_AUTOGRAD:
            target.append("< eager PyTorch")
            ok = ours[call] < eager[call] if pd.notna(ours[call]) and pd.notna(eager[call]) else None
        else:
            target.append("")
            ok = None
        met.append("" if ok is None else ("yes" if ok else "NO"))
    out["target"], out["met"] = target, met
    if "dsfuse cutedsl" in med:
        out[f"cutedsl <= {HOST_CUTEDSL_TARGET_US:.0f} us"] = [
            "" if pd.isna(v) or " part: " in c else ("yes" if meets_cutedsl(v) else "NO")
            for c, v in zip(med.index, med["dsfuse cutedsl"])]
    return out


def host_table(df: pd.DataFrame) -> pd.DataFrame:
    """Host time per call: median over repetitions, per part."""
    med = df.groupby("part", sort=False)["host_us"].median()
    return frame([[part, fmt(us)] for part, us in med.items()], ["part", "host us"])


def probe_keys(df: pd.DataFrame) -> list[str]:
    """The columns that name a setting (all but the sample, its repeats and the time)."""
    return [c for c in df.columns if c not in ("sample", *REPEATS, "us")]


def probe_table(df: pd.DataFrame) -> pd.DataFrame:
    """Any other probe: the median of ``us`` per setting, unformatted (rendered with ``floatfmt='.1f'``).

    Every setting keeps its row, also where a key is empty (``dropna=False``): a sweep with a failed
    setting has an ``error`` column, empty in the rows that ran. Empty cells (the good rows' error,
    the failed setting's time) are None, which tabulate renders as an empty cell, not ``nan``; a
    whole-number key column stays whole numbers (read as floats once a row leaves it empty).
    """
    keys = probe_keys(df)
    table = df.groupby(keys, sort=False, dropna=False)["us"].median().reset_index()
    for key in keys:
        col = table[key]
        if col.dtype.kind == "f" and col.isna().any() and (col.dropna() % 1 == 0).all():
            table[key] = col.astype("Int64")
    return blank_missing(table)


def blank_missing(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its NaN cells as None (columns without any are left as they are)."""
    table = table.copy()
    for column in table.columns[table.isna().any()]:
        table[column] = table[column].astype(object).where(table[column].notna(), None)
    return table
