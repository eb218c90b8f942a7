"""Vision token counts from the DeepSeek-V4.1 image processor configuration.

An image is upscaled (aspect kept) to at least ``min_pixels``; each side is
rounded up to a multiple of the patch size (``n_vit = ceil(side / patch)``
patches). The LLM sees ``ceil(n_h / d) * (ceil(n_w / d) + 1) + 2`` tokens
(``d`` the aligner's downsample, one separator per row plus two); when that
exceeds ``max_llm_tokens`` the image is scaled down to the largest
aspect-preserving size that fits, with each side floored to a multiple of the
patch size. The vision tower runs on ``T = n_h * n_w`` patch tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessorConfig:
    patch: int = 14
    min_pixels: int = 544 * 544
    max_llm_tokens: int = 1024
    downsample: int = 3


def llm_tokens(n_h: int, n_w: int, cfg: ProcessorConfig = ProcessorConfig()) -> int:
    d = cfg.downsample
    return math.ceil(n_h / d) * (math.ceil(n_w / d) + 1) + 2


def patch_grid(height: int, width: int, cfg: ProcessorConfig = ProcessorConfig()) -> tuple[int, int]:
    """``(n_h, n_w)`` patches the tower sees for an image of ``height x width`` pixels."""
    if height < 1 or width < 1:
        raise ValueError(f"image: expected positive sides, got {height} x {width}")
    h, w = float(height), float(width)
    if h * w < cfg.min_pixels:
        scale = math.sqrt(cfg.min_pixels / (h * w))
        h, w = h * scale, w * scale
    n_h, n_w = math.ceil(round(h, 6) / cfg.patch), math.ceil(round(w, 6) / cfg.patch)
    if llm_tokens(n_h, n_w, cfg) <= cfg.max_llm_tokens:
        return n_h, n_w
    lo, hi = 0.0, 1.0  # largest scale whose floored grid fits
    for _ in range(60):
        mid = (lo + hi) / 2
        g = (max(1, math.floor(h * mid / cfg.patch)), max(1, math.floor(w * mid / cfg.patch)))
        lo, hi = (mid, hi) if llm_tokens(*g, cfg) <= cfg.max_llm_tokens else (lo, mid)
    return max(1, math.floor(h * lo / cfg.patch)), max(1, math.floor(w * lo / cfg.patch))


def largest_grid(cfg: ProcessorConfig = ProcessorConfig(), max_side: int = 4096) -> tuple[int, int]:
    """The patch grid with the most tokens the LLM budget admits (any aspect)."""
    best = (0, 0)
    for n_h in range(1, max_side + 1):
        # widest n_w with llm_tokens(n_h, n_w) <= budget
        rows = math.ceil(n_h / cfg.downsample)
        cols = (cfg.max_llm_tokens - 2) // rows - 1
        if cols < 1:
            break
        n_w = cols * cfg.downsample
        if n_h * n_w > best[0] * best[1]:
            best = (n_h, n_w)
    return best
