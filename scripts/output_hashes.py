"""Fingerprints (SHA-256 of the bytes) of every op's outputs and gradients at the model's shapes.

    python scripts/output_hashes.py --write tests/golden/h200_output_fingerprints.json   # record all
    python scripts/output_hashes.py --check tests/golden/h200_output_fingerprints.json   # compare, exit 1 on a change
    python scripts/output_hashes.py --check GOLDEN --record-missing [--ops gdn]          # also record new entries

The ops are every op with an experiment (``dsfuse.bench.experiments()``, from the registry); each
gives its cases in its bench module, ``fingerprint_cases()`` in ``kernels/dsfuse/bench/<op>.py``:
``{entry: outputs(device)}``, each entry a dict of named tensors (an op without that function is an
error, not skipped). Inputs are drawn on the CPU from fixed seeds (so they are the same bits on any
machine) and moved to the GPU; only the public API is called, through each of its paths
(functional, ``out=``, in place, autograd, plan). A refactor that keeps every fingerprint keeps
every bit.

``--check`` exits 1 on any difference, and also where an entry (or an output of one) has no
recorded fingerprint yet, naming it; ``--record-missing`` adds those to the file instead (on the
GPU the file was recorded on; recorded fingerprints are never rewritten by it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def fingerprint(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:32]


def describe(t: torch.Tensor) -> str:
    """What the file records of one output: fingerprint, dtype and shape."""
    return f"{fingerprint(t)} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def collect_cases(names: list[str] | None = None) -> dict[str, Callable]:
    """``{entry: outputs(device)}`` of the ops ``names`` (default: all), from each op's
    ``fingerprint_cases()``; ``LookupError`` naming an op without it, ``ValueError`` for an entry not
    named after its op or named twice."""
    from dsfuse.bench import experiments
    from dsfuse.bench.report import op_function

    found: dict[str, Callable] = {}
    for op in names if names is not None else list(experiments()):
        cases = op_function(op, "fingerprint_cases")()
        if not cases:
            raise ValueError(f"op {op!r}: fingerprint_cases() returned no case")
        for entry, fn in cases.items():
            if entry != op and not entry.startswith(op + "/"):
                raise ValueError(f"op {op!r}: fingerprint entry {entry!r} is not named {op!r} or {op + '/...'!r}")
            if entry in found:
                raise ValueError(f"fingerprint entry {entry!r} is given twice")
            found[entry] = fn
    return found


def all_fingerprints(device="cuda", names: list[str] | None = None,
                     cases: dict[str, Callable] | None = None) -> dict[str, dict[str, str]]:
    """``{entry: {output: "fingerprint dtype shape"}}`` of every case (of the ops ``names``)."""
    result = {}
    for entry, fn in (cases if cases is not None else collect_cases(names)).items():
        outputs = fn(torch.device(device))
        result[entry] = {name: describe(t) for name, t in outputs.items()}
        del outputs  # free the device memory before the next case
    return result


def compare(recorded: dict, now: dict) -> list[str]:
    """Differences as lines ``op/output: recorded -> now``; empty when every fingerprint matches."""
    lines = []
    for op, outs in recorded.items():
        for name, value in outs.items():
            got = now.get(op, {}).get(name)
            if got != value:
                lines.append(f"{op}/{name}: {value} -> {got}")
    return lines


def missing(recorded: dict, now: dict) -> dict[str, dict[str, str]]:
    """What ``now`` has and ``recorded`` has not: ``{entry: {output: value}}``."""
    new: dict[str, dict[str, str]] = {}
    for entry, outs in now.items():
        for name, value in outs.items():
            if name not in recorded.get(entry, {}):
                new.setdefault(entry, {})[name] = value
    return new


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else torch.device(device).type


def main(argv=None) -> int:
    from dsfuse.bench import experiments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="record the fingerprints here (JSON)")
    group.add_argument("--check", type=Path, help="compare with the fingerprints recorded here")
    parser.add_argument("--record-missing", action="store_true",
                        help="with --check: add the entries and outputs the file has no fingerprint of yet "
                             "(recorded ones are compared, never rewritten)")
    parser.add_argument("--ops", nargs="+", choices=list(experiments()), metavar="OP",
                        help="only these ops (default: every op with an experiment); --check then compares "
                             "only their entries")
    parser.add_argument("--device", default="cuda", help="where the ops run (default cuda)")
    args = parser.parse_args(argv)
    if args.record_missing and not args.check:
        parser.error("--record-missing goes with --check")
    if args.write and args.ops:
        parser.error("--write records every op; record some with --check FILE --record-missing --ops ...")
    now = all_fingerprints(args.device, args.ops)
    gpu = device_name(args.device)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "outputs": now}, indent=1) + "\n")
        print(f"wrote {args.write}")
        return 0
    recorded = json.loads(args.check.read_text())
    if recorded["gpu"] != gpu:  # other GPUs may round differently where the contract is a tolerance
        print(f"fingerprints recorded on {recorded['gpu']}, this is {gpu}: not compared")
        return 0
    outputs = recorded["outputs"]
    if args.ops:
        outputs = {entry: outs for entry, outs in outputs.items() if entry in now}
    diff = compare(outputs, now)
    new = missing(outputs, now)
    print("\n".join(diff) or f"all {sum(map(len, outputs.values()))} recorded fingerprints equal ({gpu})")
    for entry, outs in new.items():
        what = "no recorded entry" if entry not in outputs else "outputs without a recorded fingerprint"
        print(f"{entry}: {what} in {args.check} ({', '.join(outs)})" +
              (": recorded now" if args.record_missing else "; rerun with --record-missing to record them"))
    if new and args.record_missing:
        for entry, outs in new.items():
            recorded["outputs"].setdefault(entry, {}).update(outs)
        recorded.setdefault("recorded_later", {}).update({entry: f"torch {torch.__version__}" for entry in new})
        args.check.write_text(json.dumps(recorded, indent=1) + "\n")
    return 1 if diff or (new and not args.record_missing) else 0


if __name__ == "__main__":
    sys.exit(main())
