"""mkdocs hook: publish the experiment plots (experiments/<op>/plots/<gpu>/*.png) with the site.

The plots are generated next to their raw data, one folder per GPU; the generated result tables
(results/<gpu>/<op>.md, included by the op pages) link them as
``../experiments/<op>/plots/<gpu>/<name>.png`` instead of keeping copies under docs/.
"""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for plot in sorted(ROOT.glob("experiments/*/plots/**/*.png")):
        files.append(File(plot.relative_to(ROOT).as_posix(), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
