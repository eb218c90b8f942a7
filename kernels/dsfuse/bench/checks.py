"""The verdict of a run's correctness checks, per op and provider, and the exit code it implies.

Every run (GPU or smoke) records each provider's checks in ``validation.csv`` (see
`dsfuse.bench.harness`). A provider's summary is:

* ``passed``: every check it ran passed;
* ``FAILED``: a dsfuse provider (role ``candidate``) raised or differed from the reference in at
  least one check: the run exits non-zero (``python -m dsfuse.bench run``, ``scripts/reproduce.sh``,
  and each notebook's last cell raise on it);
* ``flagged``: a control or anchor failed a check: it stays in the raw data and the tables,
  marked, and is never a ratio baseline; the run still passes;
* ``n/a``: it applied to none of the cases.

A vision RoPE run on a GPU also swaps the kernel into the whole tower (``tower_validation.csv``):
every tensor of it must be bitwise equal, or the row ``dsfuse (whole tower)`` fails.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from tabulate import tabulate

from dsfuse.bench.paths import raw_file

CANDIDATE = "candidate"


class ChecksFailed(RuntimeError):
    """A dsfuse provider failed a check of the run (the message names each one)."""


def summarize(op: str, run_dir: str | Path) -> list[dict]:
    """One row per provider of the run at ``run_dir``: op, provider, role, checks (passed of run),
    status (see the module docstring) and the first failure (case, stage, error)."""
    run_dir = Path(run_dir)
    rows = []
    path = raw_file(run_dir, "validation.csv")
    val = pd.read_csv(path, keep_default_na=False, dtype=str) if path.stat().st_size else pd.DataFrame(columns=["provider"])
    for provider, grp in val.groupby("provider", sort=False):
        role = grp["role"].iloc[0]
        ran = grp[grp["status"] != "n/a"]
        bad = ran[ran["status"] != "pass"]
        if ran.empty:
            status = "n/a"
        elif bad.empty:
            status = "passed"
        else:
            status = "FAILED" if role == CANDIDATE else "flagged"
        first = ""
        if not bad.empty:
            row = bad.iloc[0]
            first = f"{row['case']} ({row['stage']}): {row['error'].splitlines()[0] if row['error'] else 'differs'}"
        rows.append(dict(op=op, provider=provider, role=role, checks=f"{len(ran) - len(bad)}/{len(ran)}",
                         status=status, first_failure=first[:160]))
    tower = raw_file(run_dir, "tower_validation.csv")
    if tower.is_file():
        tv = pd.read_csv(tower)
        equal = tv["bitwise_equal"].astype(str).str.lower() == "true"
        first = "" if equal.all() else f"{tv.loc[~equal].iloc[0]['geometry']}: not bitwise equal"
        rows.append(dict(op=op, provider="dsfuse (whole tower)", role=CANDIDATE, checks=f"{int(equal.sum())}/{len(tv)}",
                         status="passed" if equal.all() else "FAILED", first_failure=first))
    return rows


def failures(rows: list[dict]) -> list[str]:
    """``op/provider`` of every dsfuse provider that failed."""
    return [f"{r['op']}/{r['provider']}" for r in rows if r["status"] == "FAILED"]


def render(rows: list[dict]) -> str:
    """The summary table, then one line: the verdict."""
    table = tabulate([[r["op"], r["provider"], r["role"], r["checks"], r["status"], r["first_failure"]] for r in rows],
                     headers=["op", "provider", "role", "checks passed", "status", "first failure"],
                     tablefmt="simple")
    bad = failures(rows)
    flagged = [f"{r['op']}/{r['provider']}" for r in rows if r["status"] == "flagged"]
    if bad:
        verdict = f"FAILED: {len(bad)} dsfuse provider(s) failed their checks: {', '.join(bad)}"
    elif any(r["role"] == CANDIDATE and r["status"] == "passed" for r in rows):
        verdict = "every dsfuse provider passed its checks"
    else:
        verdict = "no dsfuse provider was checked"
    if flagged:
        verdict += f"; flagged controls (not used as baselines): {', '.join(flagged)}"
    return f"{table}\n{verdict}"


def require_passed(op: str, run_dir: str | Path) -> list[dict]:
    """Print the run's summary; raise `ChecksFailed` naming every dsfuse provider that failed."""
    rows = summarize(op, run_dir)
    print(render(rows))
    bad = failures(rows)
    if bad:
        raise ChecksFailed(f"dsfuse providers failed their checks in {run_dir}: {', '.join(bad)}")
    return rows
