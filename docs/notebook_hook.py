"""mkdocs hook: render the committed notebooks (notebooks/*.ipynb) as pages of the site.

The notebooks live outside docs/; this adds them to the site's files before the
mkdocs-jupyter plugin looks at them (so it converts them, without executing them), puts
a note on each page saying that it shows the notebook's source, stored without outputs,
and drops the MathJax loader that nbconvert's template adds (it would fetch a script
from the network; the site typesets its formulas with the KaTeX it ships).
"""

import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]

NOTE = (
    '<div class="admonition note notebook-source">'
    '<p class="admonition-title">Notebook source, not executed</p>'
    "<p>This page shows <code>{path}</code> as it is committed: stored without outputs and not "
    "run when the site is built, so no cell shows a result. Run it with "
    "<code>python scripts/run_notebooks.py {path}</code> (add <code>--smoke</code> on a machine "
    "without a GPU) or open it in Jupyter; the tables and plots it displays are on the op's page.</p>"
    "</div>"
)

MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.DOTALL)


@event_priority(50)  # before mkdocs-jupyter's on_files (default priority 0) wraps the notebooks
def on_files(files, config):
    for notebook in sorted(ROOT.glob("notebooks/*.ipynb")):
        files.append(File(notebook.relative_to(ROOT).as_posix(), str(ROOT), config["site_dir"],
                          config["use_directory_urls"]))
    return files


def on_page_content(html, page, config, files):
    path = page.file.src_uri
    if not (path.startswith("notebooks/") and path.endswith(".ipynb")):
        return html
    return NOTE.format(path=path) + MATHJAX.sub("", html)
