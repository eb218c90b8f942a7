"""Screenshots of each op page's contract (typeset formulas) and main results table, for the docs.

    python scripts/screenshot_ops.py build/site [--out docs/screenshots]

Serves the built site and drives Debian's Chromium the way ``scripts/check_site.py`` does (same
server, browser flags and viewport), opens every ``details`` block, and clips two regions per op
page: from the "Contract" heading down, and the first results table with a ratio column.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # check_site beside this script
from check_site import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, _small_png, serve  # noqa: E402

OPS = ("text_rope", "vision_rope", "engram_gate")
HEIGHT = 1100  # px of each clip

CONTRACT_TOP = """() => { const h = [...document.querySelectorAll('h2')].find(e => /contract/i.test(e.textContent));
  return h ? h.getBoundingClientRect().top + window.scrollY : 0; }"""
RESULTS_TABLE = """() => { const t = [...document.querySelectorAll('.md-typeset table')]
  .find(t => t.rows[0] && /ratio/.test(t.rows[0].textContent) && t.rows[0].cells.length >= 8);
  if (!t) return null; const r = t.getBoundingClientRect(); return [r.top + window.scrollY, r.height]; }"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build --site-dir ...)")
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    server, base = serve(args.site.resolve())
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport=VIEWPORT)
            page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort())
            for op in OPS:
                page.goto(f"{base}/ops/{op}/", wait_until="networkidle")
                page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
                width = VIEWPORT["width"]
                top = page.evaluate(CONTRACT_TOP)
                clips = {"contract": dict(x=0, y=max(top - 10, 0), width=width, height=HEIGHT)}
                if table := page.evaluate(RESULTS_TABLE):
                    clips["results-table"] = dict(x=0, y=table[0] - 60, width=width, height=min(table[1] + 80, HEIGHT))
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
