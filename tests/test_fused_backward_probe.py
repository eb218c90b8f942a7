"""experiments/gdn/fused_backward_probe.py: the tensors alive at a memory-history snapshot's peak."""

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("fused_backward_probe",
                                              ROOT / "experiments" / "gdn" / "fused_backward_probe.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)

MIB = 2**20


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_peak_allocations_lists_what_is_alive_at_the_peak_with_its_own_frames():
    ours = [frame("/x/torch/autograd/function.py", 5, "apply"), frame("/r/kernels/dsfuse/gdn/api.py", 12, "_forward"),
            frame("/r/experiments/gdn/fused_backward_probe.py", 40, "step")]
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 * MIB, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 8 * MIB, "frames": [frame("/x/torch/functional.py", 1, "cat")]},
        {"action": "free_requested", "addr": 2, "size": 8 * MIB},  # not yet freed: still counts
        {"action": "alloc", "addr": 3, "size": 1 * MIB, "frames": ours[1:]},  # the peak: 13 MiB
        {"action": "free_completed", "addr": 2, "size": 8 * MIB},
        {"action": "free_completed", "addr": 99, "size": 64 * MIB},  # made before the recording: ignored
        {"action": "alloc", "addr": 4, "size": 2 * MIB, "frames": ours},  # 7 MiB: below the peak
    ]
    rows = probe.peak_allocations({"device_traces": [[], trace]}, torch.device("cuda", 1))
    assert [r["mib"] for r in rows] == [8, 4, 1]
    assert rows[0]["where"] == "?"
    assert rows[1]["where"] == "api.py:12 _forward < fused_backward_probe.py:40 step"
    assert rows[2]["where"] == "api.py:12 _forward < fused_backward_probe.py:40 step"
