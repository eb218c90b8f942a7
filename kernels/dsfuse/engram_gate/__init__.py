"""DeepSeek-V4.1 Engram gate (four hyper-connection streams): saved-state forward, packed-dKV backward."""

from dsfuse.engram_gate.api import (
    EngramGatePlan,
    engram_gate,
    engram_gate_backward,
    engram_gate_forward,
)
from dsfuse.engram_gate.reference import (
    SAVED_FIELDS,
    engram_gate_backward_from_saved,
    engram_gate_backward_reference,
    engram_gate_reference,
)

__all__ = [
    "SAVED_FIELDS",
    "EngramGatePlan",
    "engram_gate",
    "engram_gate_backward",
    "engram_gate_backward_from_saved",
    "engram_gate_backward_reference",
    "engram_gate_forward",
    "engram_gate_reference",
]
