"""scripts/check_site.py passes a good page and fails each kind of broken page.

The fixture site mimics Material's layout (a fixed-width ``.md-content`` column holding an
``article.md-content__inner.md-typeset``, tables in ``.md-typeset__scrollwrap``) and
pymdownx.arithmatex's generic output (a typeset formula holds a ``.katex`` element).
Needs Debian's Chromium: skipped without it on a developer machine, never in CI
(``.ci/run`` installs it).
"""

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_site.py"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not os.environ.get("CI"),
    reason=f"{CHROMIUM} not installed (apt-get install chromium; CI installs it and never skips)",
)

PNG_1x1 = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title><link rel="icon" href="data:,">
<style>
  body {{ margin: 0; font: 16px sans-serif; }}
  .md-content {{ width: 700px; }}
  .md-content__inner {{ margin: 0; padding: 0; }}
  .md-typeset__scrollwrap {{ overflow-x: auto; }}
  table {{ border-collapse: collapse; }}
</style></head>
<body><div class="md-content"><article class="md-content__inner md-typeset">
<h1 id="top">{title}</h1>
{body}
</article></div></body></html>
"""

GOOD_TABLE = '<div class="md-typeset__scrollwrap"><div class="md-typeset__table"><table><tr><th>op</th><th>ms</th></tr><tr><td>rope</td><td>1.0</td></tr></table></div></div>'
TYPESET = '<span class="arithmatex"><span class="katex">x<sup>2</sup></span></span>'

GOOD_BODY = f"""
<p>Inline {TYPESET} and display:</p>
<div class="arithmatex"><span class="katex katex-display">y</span></div>
{GOOD_TABLE}
<p><img src="img/dot.png" alt="dot" width="10" height="10"></p>
<p><a href="other/">other</a> <a href="other/index.html#sec">a section</a> <a href="#top">top</a>
<a href="#">nowhere in particular</a> <a href="https://example.org/missing">external</a>
<a href="mailto:a@example.org">mail</a> <a href="img/dot.png">the image</a></p>
<pre><code>shell: echo "\\(not math\\)" $$</code></pre>
<p style="width: 300px">Words in inline code may wrap between them: <code>a b c d e f g h i j k l m n o p q r s t u v
w x y z</code>, an identifier stays whole: <code style="white-space: nowrap">20261201-154649-h200</code>.</p>
"""

BAD_BODIES = {
    # page name -> (the failure kind it must produce, the page body)
    "bad_formula": ("formula", '<p>Untypeset: <span class="arithmatex">\\(x^2\\)</span></p>'),
    "katex_error": (
        "formula",
        (
            '<p><span class="arithmatex"><span class="katex-error" title="ParseError: KaTeX parse error: '
            'Undefined control sequence: \\foo">\\foo</span></span></p>'
        ),
    ),
    "raw_tex": ("formula", "<p>Arithmatex missing: \\(a + b\\)</p>"),
    "missing_image": ("image", '<p><img src="img/missing.png" alt="gone"></p>'),
    "wide_table": (
        "table",
        (
            '<div class="md-typeset__scrollwrap"><div class="md-typeset__table"><table style="width: 1200px">'
            "<tr><th>case</th><th>ms</th></tr><tr><td>wide</td><td>1</td></tr></table></div></div>"
        ),
    ),
    "scrolling_code": ("code", '<pre style="overflow-x: auto; white-space: pre"><code>' + "x = 1  # " + "long " * 300
                       + "</code></pre>"),
    "broken_token": ("token", '<p style="width: 200px">see <code style="overflow-wrap: anywhere">'
                     "experiments/text_rope/raw/20261201-154649-h200/samples.csv</code></p>"),
    "broken_link": ("link", '<p><a href="nowhere/">a page that is not there</a></p>'),
    "broken_anchor": ("link", '<p><a href="../other/#no-such-heading">a heading that is not there</a></p>'),
    "console_error": ("console", '<script>console.error("boom");</script>'),
    "uncaught": ("console", "<script>undefinedFunction();</script>"),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    (root / "img").mkdir()
    (root / "img" / "dot.png").write_bytes(PNG_1x1)
    (root / "index.html").write_text(PAGE.format(title="good", body=GOOD_BODY))
    (root / "other").mkdir()
    (root / "other" / "index.html").write_text(PAGE.format(title="other", body='<h2 id="sec">Section</h2>'))
    for name, (_, body) in BAD_BODIES.items():
        (root / name).mkdir()
        (root / name / "index.html").write_text(PAGE.format(title=name, body=body))
    return root


def check(site, *args):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(site), *args], capture_output=True, text=True, timeout=300, check=False
    )
    failures = {}
    for line in proc.stdout.splitlines():
        page, sep, rest = line.partition(": ")
        if sep and page.endswith(".html"):
            kind, _, detail = rest.partition(": ")
            failures.setdefault(page, []).append((kind, detail))
    return proc, failures


def test_good_pages_pass_and_screenshots(site, tmp_path):
    shots = tmp_path / "shots"
    proc, failures = check(site, "--pages", "index.html", "other/", "--screenshots", str(shots))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert failures == {}
    assert "2 page(s), 0 failure(s)" in proc.stdout
    assert sorted(p.name for p in shots.iterdir()) == ["index.png", "other.png"]
    assert (shots / "index.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_broken_page_fails(site):
    proc, failures = check(site)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "index.html" not in failures and "other/index.html" not in failures, proc.stdout
    for name, (kind, _) in BAD_BODIES.items():
        page = f"{name}/index.html"
        kinds = {k for k, _ in failures.get(page, [])}
        assert kind in kinds, f"{page}: expected a {kind} failure, got {failures.get(page)}\n{proc.stdout}"
        # a missing image is also a failed request; nothing else may leak into another kind
        assert kinds <= {kind, "request"}, f"{page}: {failures[page]}"
    details = dict(failures["broken_anchor/index.html"])
    assert "no-such-heading" in details["link"]
    assert "Undefined control sequence" in dict(failures["katex_error/index.html"])["formula"]
    assert "boom" in dict(failures["console_error/index.html"])["console"]
    assert "1200 px wide" in dict(failures["wide_table/index.html"])["table"]
