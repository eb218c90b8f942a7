"""The Triton state passes as compiled, on the CPU: a fingerprint of each AOT spec's PTX and its
registers and spills.

    PYTHONPATH=<tree>/kernels python experiments/gdn/state_pass_ptx.py OUT.csv

For every spec of ``dsfuse.gdn.triton.state`` and the state pass of ``dsfuse.gdn.triton.state_bwd``
(their ``AOT_SPECS``, the model's shapes), compiled for sm_90 and sm_100 (`dsfuse._common.aot.compile_for`):
``ptx_sha1``, the SHA-1 of the PTX without its debug sections and ``.loc`` / ``.file`` lines (so
two trees whose kernels differ only in source line numbers give the same value), and ``registers``
and ``spill_stores`` from ``ptxas -v`` (Triton's own ptxas; ``ptxas-blackwell`` for sm_100a). Run it
with two trees on ``PYTHONPATH`` to compare what their kernels compile to.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import os
import re
import subprocess
import sys
import tempfile

import triton

from dsfuse._common.aot import compile_for

MODULES = ("dsfuse.gdn.triton.state", "dsfuse.gdn.triton.state_bwd")
TARGETS = {"sm_90": ("sm_90a", "ptxas"), "sm_100": ("sm_100a", "ptxas-blackwell")}


def code_of(ptx: str) -> str:
    """The PTX up to its debug sections, without line-number directives."""
    code = ptx.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    return "\n".join(line for line in code.splitlines() if not re.match(r"\s*\.(loc|file)\b", line))


def ptxas_usage(ptx: str, arch: str, tool: str) -> tuple[int, int]:
    """``(registers, spill store bytes)`` of ``ptx`` by ``ptxas -v -arch=arch``."""
    binary = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([binary, "-v", f"-arch={arch}", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return int(registers.group(1)), int(spills.group(1)) if spills else 0


def rows() -> list[dict]:
    found = []
    for name in MODULES:
        for spec in importlib.import_module(name).AOT_SPECS:
            if "dv_local" in spec.name:
                continue
            for target, (arch, tool) in TARGETS.items():
                ptx = compile_for(spec, target).asm["ptx"]
                registers, spills = ptxas_usage(ptx, arch, tool)
                found.append({"spec": spec.name, "target": target, "registers": registers, "spill_stores": spills,
                              "ptx_sha1": hashlib.sha1(code_of(ptx).encode()).hexdigest()})
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    found = rows()
    with open(argv[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(found[0]))
        writer.writeheader()
        writer.writerows(found)
    print(f"wrote {len(found)} rows to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
