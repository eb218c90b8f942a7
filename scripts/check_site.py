"""Load every page of the built docs site in headless Chromium and report what is broken.

    python scripts/check_site.py build/site                      # every page; exit 1 on any failure
    python scripts/check_site.py build/site --pages ops/text_rope/ index.html
    python scripts/check_site.py build/site --screenshots build/shots   # plus one full-page PNG per page

The site is served from a local port (``http.server`` in a thread) and each page is loaded
at a 1400x900 viewport. A page fails on:

* ``console``: an error in the browser console or an uncaught exception;
* ``request``: a local resource (stylesheet, script, image, font, fetch) that failed or
  answered with an HTTP error. Requests to other hosts are blocked (the site must work
  offline) and only counted;
* ``formula``: an ``.arithmatex`` element (``pymdownx.arithmatex``, generic mode) with no
  ``.katex`` element inside, a KaTeX error (``.katex-error``), or raw TeX delimiters
  (``\\(``, ``\\[``, ``$$``) left in the text outside code;
* ``image``: an ``img`` that did not load (``complete`` and ``naturalWidth == 0``);
* ``table``: a table inside ``.md-typeset`` wider than the content column, or whose scroll
  wrapper scrolls (code listings' line-number tables are left out);
* ``code``: a code listing (``pre > code``) that scrolls sideways;
* ``token``: inline code without spaces (a run id, a commit, a path) broken across lines;
* ``link``: an ``a[href]`` on this site whose target file is not in SITE_DIR, or whose
  ``#anchor`` is no element id of the target page. Links to other hosts are not followed.

Every failure is printed as ``page: kind: detail``. Chromium is Debian's ``/usr/bin/chromium``
(``$CHROMIUM`` overrides it), driven through the ``playwright`` package; its own browser
downloads are never used.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html.parser
import http.server
import io
import os
import posixpath
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 900}
TYPESET_TIMEOUT_MS = 3000  # how long to wait for KaTeX before calling a formula untypeset
PAGE_TIMEOUT_MS = 30000

# Runs in the page once it has loaded; returns a list of [kind, detail].
PAGE_CHECKS_JS = r"""
async () => {
  const out = [];
  const short = (s, n = 80) => { s = (s || "").replace(/\s+/g, " ").trim(); return s.length > n ? s.slice(0, n) + "…" : s; };

  // Formulas: every arithmatex element holds a .katex (or MathJax) rendering, and none is a KaTeX error.
  document.querySelectorAll(".arithmatex").forEach((el) => {
    if (!el.querySelector(".katex, mjx-container, .katex-error"))  // an error is reported below
      out.push(["formula", "untypeset: " + short(el.textContent)]);
  });
  document.querySelectorAll(".katex-error").forEach((el) => {
    out.push(["formula", "KaTeX error: " + short(el.getAttribute("title") || el.textContent, 160)]);
  });
  // Raw TeX delimiters left in prose (arithmatex missing, or a formula it did not recognise).
  const skip = "pre, code, script, style, kbd, samp, textarea, .arithmatex, .katex, mjx-container";
  for (const root of document.querySelectorAll(".md-typeset")) {
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      const t = n.nodeValue;
      if (!/\\\(|\\\[|\$\$/.test(t)) continue;
      if (n.parentElement && n.parentElement.closest(skip)) continue;
      out.push(["formula", "raw TeX in text: " + short(t)]);
    }
  }

  // Images: load lazy ones too, then every img must have decoded to a non-empty bitmap.
  const imgs = Array.from(document.images);
  imgs.forEach((img) => { if (img.loading === "lazy") img.loading = "eager"; });
  await Promise.race([
    Promise.all(imgs.map((img) => img.decode().catch(() => null))),
    new Promise((r) => setTimeout(r, 5000)),
  ]);
  imgs.forEach((img) => {
    if (!img.complete || img.naturalWidth === 0)
      out.push(["image", "not loaded: " + (img.getAttribute("src") || "(no src)")]);
  });

  // Tables: not wider than the content column, and no scroll wrapper that scrolls.
  const col = document.querySelector("article.md-content__inner") || document.querySelector(".md-content");
  if (col) {
    const cs = getComputedStyle(col);
    const colWidth = col.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
    const tables = Array.from(document.querySelectorAll(".md-typeset table"))
      .filter((t) => !t.closest(".highlighttable, .highlight, pre"));
    tables.forEach((t, i) => {
      const head = t.querySelector("th, td");
      const name = "table " + (i + 1) + (head ? " ('" + short(head.textContent, 30) + "')" : "");
      const width = Math.max(t.scrollWidth, t.getBoundingClientRect().width);
      const wrap = t.closest(".md-typeset__scrollwrap");
      // One failure per table: the widest symptom first (a too-wide table also makes its wrapper scroll).
      if (width > colWidth + 1)
        out.push(["table", name + ": " + Math.round(width) + " px wide, column " + Math.round(colWidth) + " px"]);
      else if (t.scrollWidth > t.clientWidth + 1)
        out.push(["table", name + ": scrolls inside itself (" + t.scrollWidth + " > " + t.clientWidth + " px)"]);
      else if (wrap && wrap.scrollWidth > wrap.clientWidth + 1)
        out.push(["table", name + ": scroll wrapper scrolls (" + wrap.scrollWidth + " > " + wrap.clientWidth + " px)"]);
    });
  } else if (document.querySelector(".md-typeset table")) {
    out.push(["table", "no content column (article.md-content__inner / .md-content) to measure against"]);
  }

  // Code blocks: no listing that scrolls sideways (long lines wrap: see stylesheets/extra.css).
  document.querySelectorAll(".md-typeset pre > code").forEach((code, i) => {
    const pre = code.parentElement;
    if (pre.scrollWidth > pre.clientWidth + 1)
      out.push(["code", "code block " + (i + 1) + " ('" + short(code.textContent, 30) + "') scrolls sideways (" +
                pre.scrollWidth + " > " + pre.clientWidth + " px)"]);
  });
  // Tokens: an identifier in inline code (a run id, a commit, a path) is never broken across lines.
  document.querySelectorAll(".md-typeset code").forEach((code) => {
    if (code.closest("pre")) return;
    const text = code.textContent.trim();
    if (!text || /\s/.test(text)) return;  // several words may wrap between them
    const lines = new Set(Array.from(code.getClientRects()).map((r) => Math.round(r.top)));
    if (lines.size > 1) out.push(["token", "broken across lines: " + short(text, 60)]);
  });

  // Links: hand every href back, resolved; Python checks them against the files.
  const links = Array.from(document.querySelectorAll("a[href]")).map((a) => [a.getAttribute("href"), a.href]);
  return {failures: out, links: links};
}
"""

# Wait until every formula is typeset (or there are none); a timeout is reported by the checks.
TYPESET_DONE_JS = """
() => Array.from(document.querySelectorAll('.arithmatex')).every(
  (el) => el.querySelector('.katex, mjx-container, .katex-error'))
"""


@dataclass
class Failure:
    page: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.page}: {self.kind}: {self.detail}"


@dataclass
class PageResult:
    failures: list[Failure] = field(default_factory=list)
    external: set[str] = field(default_factory=set)


class _Ids(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if v and (k == "id" or (k == "name" and tag == "a")):
                self.ids.add(v)


@functools.cache
def _ids_of(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(parser.ids)


def _target_file(site: Path, url_path: str) -> Path | None:
    """The file a URL path names in the site (``dir/`` -> ``dir/index.html``), or None."""
    rel = posixpath.normpath(unquote(url_path)).lstrip("/")
    target = site / rel if rel not in ("", ".") else site
    if target.is_dir():
        target = target / "index.html"
    return target if target.is_file() else None


def check_link(site: Path, base: str, raw: str, resolved: str) -> str | None:
    """Why a link does not resolve in the site, or None when it does (or is not local)."""
    parts = urlsplit(resolved)
    if parts.scheme not in ("http", "https"):
        return None  # mailto:, javascript:, data: ...
    if f"{parts.scheme}://{parts.netloc}" != base:
        return None  # another host: not followed
    target = _target_file(site, parts.path)
    if target is None:
        return f"{raw} -> no file {unquote(parts.path)}"
    fragment = unquote(parts.fragment)
    if fragment and target.suffix in (".html", ".htm") and fragment not in _ids_of(target):
        return f"{raw} -> no id '{fragment}' in {target.relative_to(site).as_posix()}"
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the report readable
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def list_pages(site: Path, wanted: list[str] | None) -> list[str]:
    """Site-relative paths of the HTML pages to load."""
    if not wanted:
        return sorted(
            p.relative_to(site).as_posix()
            for p in site.rglob("*.html")
            if p.relative_to(site).parts[0] != "assets"
        )
    pages = []
    for w in wanted:
        target = _target_file(site, w)
        if target is None:
            raise SystemExit(f"--pages: no page {w!r} in {site}")
        pages.append(target.relative_to(site).as_posix())
    return pages


def _small_png(png: bytes, dest: Path) -> None:
    """Write a screenshot as a palette PNG (a fraction of the size of the RGB one)."""
    try:
        from PIL import Image
    except ImportError:
        dest.write_bytes(png)
        return
    img = Image.open(io.BytesIO(png)).convert("RGB")
    img.quantize(colors=128, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(dest, optimize=True)


def screenshot_name(page: str) -> str:
    stem = page[: -len("index.html")] if page.endswith("index.html") else page.removesuffix(".html")
    stem = stem.strip("/").replace("/", "__")
    return (stem or "index") + ".png"


def check_page(browser_context, site: Path, base: str, page_path: str, shots: Path | None) -> PageResult:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    result = PageResult()

    def fail(kind: str, detail: str) -> None:
        result.failures.append(Failure(page_path, kind, detail))

    failed_urls: set[str] = set()
    page = browser_context.new_page()

    def local(url: str) -> bool:
        return url.startswith(base + "/") or url == base

    def on_console(msg):
        if msg.type != "error":
            return
        where = (msg.location or {}).get("url", "")
        if msg.text.startswith("Failed to load resource") and (where in failed_urls or not local(where)):
            return  # reported as a request failure, or an external request that was blocked
        fail("console", msg.text + (f" ({where})" if where and where != base + "/" + page_path else ""))

    def on_request_failed(req):
        if local(req.url):
            failed_urls.add(req.url)
            fail("request", f"{req.url[len(base):]} failed: {req.failure}")

    def on_response(resp):
        if local(resp.url) and resp.status >= 400:
            failed_urls.add(resp.url)
            fail("request", f"{resp.url[len(base):]} answered HTTP {resp.status}")

    page.on("console", on_console)
    page.on("pageerror", lambda err: fail("console", f"uncaught {err.name}: {err.message}"))
    page.on("requestfailed", on_request_failed)
    page.on("response", on_response)
    try:
        resp = page.goto(f"{base}/{page_path}", wait_until="load", timeout=PAGE_TIMEOUT_MS)
        if resp is None or resp.status >= 400:
            fail("request", f"page answered HTTP {resp.status if resp else '?'}")
        with contextlib.suppress(PlaywrightTimeout):  # the checks below name the formulas left untypeset
            page.wait_for_function(TYPESET_DONE_JS, timeout=TYPESET_TIMEOUT_MS)
        found = page.evaluate(PAGE_CHECKS_JS)
        for kind, detail in found["failures"]:
            fail(kind, detail)
        seen = set()
        for raw, resolved in found["links"]:
            if (raw, resolved) in seen:
                continue
            seen.add((raw, resolved))
            why = check_link(site, base, raw, resolved)
            if why:
                fail("link", why)
        if shots is not None:
            _small_png(page.screenshot(full_page=True, animations="disabled"), shots / screenshot_name(page_path))
        page.wait_for_timeout(50)  # late console errors (search worker, deferred scripts)
    except PlaywrightError as err:  # a page that hangs or crashes is a failure, not the end of the run
        fail("load", f"{type(err).__name__}: {str(err).splitlines()[0]}")
    finally:
        page.close()
    return result


def run(site: Path, pages: list[str] | None = None, screenshots: Path | None = None) -> tuple[list[Failure], int, set[str]]:
    """Check the pages; returns (failures, pages checked, external URLs blocked)."""
    from playwright.sync_api import sync_playwright

    site = site.resolve()
    if not (site / "index.html").is_file() and not pages:
        raise SystemExit(f"{site}: no index.html (build the site first)")
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"{CHROMIUM} not found: apt-get install chromium (or set $CHROMIUM)")
    todo = list_pages(site, pages)
    if screenshots is not None:
        screenshots.mkdir(parents=True, exist_ok=True)
    server, base = serve(site)
    failures: list[Failure] = []
    external: set[str] = set()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1, service_workers="block")

            def route(r):
                if r.request.url.startswith(base + "/") or r.request.url.startswith(("data:", "blob:")):
                    r.continue_()
                else:
                    external.add(r.request.url)
                    r.abort("blockedbyclient")

            context.route("**/*", route)
            for page_path in todo:
                failures += check_page(context, site, base, page_path, screenshots).failures
            context.close()
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    return failures, len(todo), external


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs --site-dir)")
    parser.add_argument("--pages", nargs="+", metavar="PAGE", help="only these pages (site-relative paths)")
    parser.add_argument("--screenshots", type=Path, metavar="OUT_DIR", help="write a full-page PNG per page")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    failures, n, external = run(args.site, args.pages, args.screenshots)
    for f in failures:
        print(f)
    took = time.perf_counter() - start
    note = f"; blocked {len(external)} request(s) to other hosts" if external else ""
    for url in sorted(external):
        print(f"  blocked: {url}", file=sys.stderr)
    print(f"check_site: {n} page(s), {len(failures)} failure(s) in {took:.1f} s{note}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
