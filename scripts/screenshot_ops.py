"""Screenshots of each op page's contract (typeset formulas), headline results table and first plot.

    python scripts/screenshot_ops.py build/site [--out docs/screenshots]

Serves the built site and drives Debian's Chromium the way ``scripts/check_site.py`` does (same
server, browser flags and viewport), opens every ``details`` block, and clips three regions per op
page: from the "Contract" heading down (``<op>-contract.png``), the first results table with a ratio
column, the headline regime's (``<op>-results-table.png``), and the first plot of the op's
experiment with its heading (``<op>-plot.png``). The ops
are every op with an experiment (``dsfuse.bench.experiments()``, from the registry), each with its
page ``docs/ops/<op>.md``; an op whose page is missing from the site, or has no "Contract"
heading, is an error, not skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # check_site beside this script
from check_site import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, _small_png, serve  # noqa: E402

HEIGHT = 1100  # px of each clip
PAGES = Path(__file__).resolve().parents[1] / "docs" / "ops"  # one page per op: docs/ops/<op>.md

CONTRACT_TOP = """() => { const h = [...document.querySelectorAll('h2')].find(e => /contract/i.test(e.textContent));
  return h ? h.getBoundingClientRect().top + window.scrollY : null; }"""
RESULTS_TABLE = """() => { const t = [...document.querySelectorAll('.md-typeset table')]
  .find(t => t.rows[0] && /ratio/.test(t.rows[0].textContent) && t.rows[0].cells.length >= 8);
  if (!t) return null; const r = t.getBoundingClientRect(); return [r.top + window.scrollY, r.height]; }"""
PLOT = """() => { const i = [...document.querySelectorAll('.md-typeset img')].find(i => /\\/plots\\//.test(i.src));
  if (!i) return null; const r = i.getBoundingClientRect(); return [r.top + window.scrollY, r.height]; }"""


def page_source(op: str) -> Path:
    """The op's page (``docs/ops/<op>.md``); ``FileNotFoundError`` naming the op where it has none."""
    page = PAGES / f"{op}.md"
    if not page.exists():
        raise FileNotFoundError(f"op {op!r}: no page {page.relative_to(PAGES.parents[1])} to screenshot "
                                "(each op with an experiment has one)")
    return page


def main(argv=None) -> int:
    from dsfuse.bench import experiments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build --site-dir ...)")
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument("--ops", nargs="+", choices=list(experiments()), metavar="OP",
                        help="only these ops (default: every op with an experiment)")
    args = parser.parse_args(argv)
    todo = args.ops or list(experiments())
    for op in todo:
        page_source(op)
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    server, base = serve(args.site.resolve())
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport=VIEWPORT)
            page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort())
            for op in todo:
                response = page.goto(f"{base}/ops/{op}/", wait_until="networkidle")
                if response is None or not response.ok:
                    raise SystemExit(f"op {op!r}: {base}/ops/{op}/ is not in the built site {args.site} "
                                     f"(status {response.status if response else 'none'}); rebuild it")
                page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
                width = VIEWPORT["width"]
                top = page.evaluate(CONTRACT_TOP)
                if top is None:
                    raise SystemExit(f"op {op!r}: its page has no 'Contract' heading (h2) to clip from")
                clips = {"contract": dict(x=0, y=max(top - 10, 0), width=width, height=HEIGHT)}
                if table := page.evaluate(RESULTS_TABLE):
                    clips["results-table"] = dict(x=0, y=table[0] - 60, width=width, height=min(table[1] + 80, HEIGHT))
                if plot := page.evaluate(PLOT):
                    clips["plot"] = dict(x=0, y=plot[0] - 20, width=width, height=min(plot[1] + 40, HEIGHT))
                for name, clip in clips.items():
                    dest = args.out / f"{op}-{name}.png"
                    _small_png(page.screenshot(clip=clip, full_page=True), dest)
                    print(f"wrote {dest}")
            browser.close()
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
