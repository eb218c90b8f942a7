"""The DeepSeek-V4.1 vision tower and aligner in plain PyTorch, for whole-model validation.

Structure (from the released vision config): patch embedding Linear(588 -> 1024);
32 pre-norm blocks (RMSNorm eps 1e-6 with fp32 weights; attention with
``wqkv`` Linear(1024 -> 3072, bias), split-half RoPE on q and k, 3D math SDPA,
``wo`` Linear(1024 -> 1024, bias); SwiGLU MLP ``w1`` [5632, 1024] = gate | up,
``w2`` [1024, 2816]); a final RMSNorm; the aligner views the tokens as
``[n_h, n_w, C]``, zero-pads to multiples of 3, unfolds 3 x 3 patches with stride 3
(channel-major) and applies Linear(9216 -> 5120), exact GELU, Linear(5120 -> 5120).
263 parameters. Each block runs under non-reentrant activation checkpointing.

``rope="dsfuse"`` swaps the attention front end (rotary of q and k, the q/k/v
split) for `dsfuse.vision_rope.vision_rope_attention_front`; everything else
is the same code, so two runs differ only in that op.

Weights are read from safetensors files by name (`PARAM_NAMES` lists the
names this module expects; `load_weights` takes a rename map for files
that spell them differently). `synthetic_weights` makes weights of the
real shapes for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dsfuse.vision_rope import attention_front, vision_cos_sin, vision_rope_attention_front


@dataclass(frozen=True)
class TowerConfig:
    layers: int = 32
    hidden: int = 1024
    heads: int = 16
    mlp: int = 2816
    patch: int = 14
    channels: int = 3
    theta: float = 10000.0
    eps: float = 1e-6
    downsample: int = 3
    llm_hidden: int = 5120

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def param_shapes(cfg: TowerConfig = TowerConfig()) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every parameter, in model order."""
    bf16, fp32 = torch.bfloat16, torch.float32
    pe = cfg.patch * cfg.patch * cfg.channels
    shapes = {"vision.patch_embed.weight": ((cfg.hidden, pe), bf16), "vision.patch_embed.bias": ((cfg.hidden,), bf16)}
    for i in range(cfg.layers):
        b = f"vision.blocks.{i}."
        shapes |= {
            b + "attn_norm.weight": ((cfg.hidden,), fp32),
            b + "attn.wqkv.weight": ((3 * cfg.hidden, cfg.hidden), bf16),
            b + "attn.wqkv.bias": ((3 * cfg.hidden,), bf16),
            b + "attn.wo.weight": ((cfg.hidden, cfg.hidden), bf16),
            b + "attn.wo.bias": ((cfg.hidden,), bf16),
            b + "mlp_norm.weight": ((cfg.hidden,), fp32),
            b + "mlp.w1.weight": ((2 * cfg.mlp, cfg.hidden), bf16),
            b + "mlp.w2.weight": ((cfg.hidden, cfg.mlp), bf16),
        }
    unfolded = cfg.hidden * cfg.downsample**2
    shapes |= {
        "vision.norm.weight": ((cfg.hidden,), fp32),
        "aligner.proj.0.weight": ((cfg.llm_hidden, unfolded), bf16),
        "aligner.proj.0.bias": ((cfg.llm_hidden,), bf16),
        "aligner.proj.2.weight": ((cfg.llm_hidden, cfg.llm_hidden), bf16),
        "aligner.proj.2.bias": ((cfg.llm_hidden,), bf16),
    }
    return shapes


PARAM_NAMES = tuple(param_shapes())


def synthetic_weights(cfg: TowerConfig = TowerConfig(), seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights of the real shapes: matrices ~ N(0, 1/fan_in), biases small, norms near 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, (shape, dtype) in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        elif len(shape) == 2:
            t = torch.randn(shape, generator=gen, device=device) / shape[1] ** 0.5
        else:
            t = 0.02 * torch.randn(shape, generator=gen, device=device)
        out[name] = t.to(dtype)
    return out


def save_weights(weights: dict[str, torch.Tensor], path: str | Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(path))


def load_weights(paths, cfg: TowerConfig = TowerConfig(), rename: dict[str, str] | None = None,
                 device="cpu") -> dict[str, torch.Tensor]:
    """Read the tower's parameters from one or more safetensors files.

    ``rename`` maps a file's tensor names to `PARAM_NAMES`. Every expected
    parameter must be present with its shape; dtypes are converted to the model's.
    """
    from safetensors.torch import load_file

    rename = rename or {}
    found = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        for name, t in load_file(str(path), device=str(device)).items():
            found[rename.get(name, name)] = t
    out = {}
    for name, (shape, dtype) in param_shapes(cfg).items():
        if name not in found:
            raise KeyError(f"weights: missing {name!r} (give a rename map for other naming)")
        if tuple(found[name].shape) != shape:
            raise ValueError(f"weights: {name} has shape {list(found[name].shape)}, expected {list(shape)}")
        out[name] = found[name].to(dtype)
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class VisionTower(torch.nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], cfg: TowerConfig = TowerConfig()):
        super().__init__()
        self.cfg = cfg
        self.names = list(param_shapes(cfg))
        self.params = torch.nn.ParameterList([torch.nn.Parameter(weights[n]) for n in self.names])

    def p(self, name: str) -> torch.Tensor:
        return self.params[self.names.index(name)]

    def _block(self, x, i, cos, sin, rope):
        cfg, b = self.cfg, f"vision.blocks.{i}."
        tokens = x.shape[0]
        h = _rms_norm(x, self.p(b + "attn_norm.weight"), cfg.eps)
        qkv = F.linear(h, self.p(b + "attn.wqkv.weight"), self.p(b + "attn.wqkv.bias"))
        if rope == "dsfuse":
            q, k, v = vision_rope_attention_front(qkv, cos, sin, cfg.heads, backend="triton")
        else:
            q, k, v = attention_front(qkv, cos, sin, cfg.heads)
        o = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(tokens, cfg.hidden)
        x = x + F.linear(o, self.p(b + "attn.wo.weight"), self.p(b + "attn.wo.bias"))
        h = _rms_norm(x, self.p(b + "mlp_norm.weight"), cfg.eps)
        gate, up = F.linear(h, self.p(b + "mlp.w1.weight")).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, self.p(b + "mlp.w2.weight"))

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int, rope: str = "eager",
                use_checkpoint: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``patches`` ``[n_h * n_w, 588]`` -> aligner output ``[ceil(n_h/3) * ceil(n_w/3), 5120]``
        and the 32 block outputs (hidden states)."""
        cfg = self.cfg
        if rope not in ("eager", "dsfuse"):
            raise ValueError(f"rope: expected 'eager' or 'dsfuse', got {rope!r}")
        cos, sin = vision_cos_sin(n_h, n_w, cfg.head_dim // 2, cfg.theta, device=patches.device)
        x = F.linear(patches, self.p("vision.patch_embed.weight"), self.p("vision.patch_embed.bias"))
        hidden = []
        for i in range(cfg.layers):
            if use_checkpoint:
                x = checkpoint(self._block, x, i, cos, sin, rope, use_reentrant=False)
            else:
                x = self._block(x, i, cos, sin, rope)
            hidden.append(x)
        x = _rms_norm(x, self.p("vision.norm.weight"), cfg.eps)
        d = cfg.downsample
        grid = x.view(n_h, n_w, cfg.hidden).permute(2, 0, 1)
        grid = F.pad(grid, (0, (-n_w) % d, 0, (-n_h) % d))
        unfolded = F.unfold(grid[None], kernel_size=d, stride=d)[0].transpose(0, 1)  # [L, C * d * d] channel-major
        y = F.linear(unfolded, self.p("aligner.proj.0.weight"), self.p("aligner.proj.0.bias"))
        y = F.gelu(y)
        return F.linear(y, self.p("aligner.proj.2.weight"), self.p("aligner.proj.2.bias")), hidden
