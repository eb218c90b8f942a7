"""DeepSeek-V4.1 text RoPE: interleaved adjacent pairs on the tail channels, optional inverse."""

from dsfuse.text_rope.api import apply_rope
from dsfuse.text_rope.reference import (
    apply_rotary_emb_,
    rope_angles,
    rope_freqs,
    rope_reference,
    rope_reference_fp64,
    rope_reference_inplace,
    yarn_inv_freq,
)

__all__ = [
    "apply_rope",
    "apply_rotary_emb_",
    "rope_angles",
    "rope_freqs",
    "rope_reference",
    "rope_reference_fp64",
    "rope_reference_inplace",
    "yarn_inv_freq",
]
