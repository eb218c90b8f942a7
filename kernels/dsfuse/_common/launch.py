"""Stream handling shared by every op."""

from __future__ import annotations

import contextlib

import torch


def on_stream(stream: torch.cuda.Stream | None, device: torch.device):
    """Context that makes ``stream`` current (allocations and launches go to it).

    ``None`` keeps the current stream. A stream on another device is an error.
    """
    if stream is None:
        return contextlib.nullcontext()
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream: expected a torch.cuda.Stream or None, got {type(stream).__name__}")
    if device.type != "cuda" or stream.device != device:
        raise ValueError(f"stream: expected a stream on {device}, got one on {stream.device}")
    return torch.cuda.stream(stream)
