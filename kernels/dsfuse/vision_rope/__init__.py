"""DeepSeek-V4.1 vision RoPE: split-half rotary; fused backward from native layouts to packed dQKV."""

from dsfuse.vision_rope.api import (
    vision_rope_attention_front,
    vision_rope_backward,
    vision_rope_forward,
)
from dsfuse.vision_rope.reference import (
    apply_rotary,
    attention,
    attention_front,
    vision_cos_sin,
    vision_rope_backward_autograd,
    vision_rope_backward_reference,
)

__all__ = [
    "apply_rotary",
    "attention",
    "attention_front",
    "vision_cos_sin",
    "vision_rope_attention_front",
    "vision_rope_backward",
    "vision_rope_backward_autograd",
    "vision_rope_backward_reference",
    "vision_rope_forward",
]
