"""Comparison helpers of the tests (bit patterns, ulps)."""

import torch

from dsfuse.bench.harness import bits

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal bit patterns (so -0.0 differs from +0.0 and NaN payloads count)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    bad = bits(got) != bits(want)
    if bad.any():
        flat = bad.reshape(-1)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements differ bitwise; first at "
            f"{bad.nonzero()[:3].tolist()}: got {got.reshape(-1)[flat][:3].tolist()}, "
            f"want {want.reshape(-1)[flat][:3].tolist()}"
        )


def spacing(t: torch.Tensor) -> torch.Tensor:
    """Distance to the next representable number at |t| in t's dtype (float64)."""
    tiny = torch.finfo(t.dtype).tiny
    mag = t.double().abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA_BITS[t.dtype])


def assert_within_ulp(got: torch.Tensor, want: torch.Tensor, ulps: float = 1, what: str = "") -> None:
    """|got - want| <= ulps * spacing(want); NaN positions and infinities must match."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    g, w = got.double(), want.double()
    nan = torch.isnan(w)
    assert torch.equal(torch.isnan(g), nan), f"{what}: NaN positions differ"
    inf = torch.isinf(w)
    assert torch.equal(g[inf], w[inf]), f"{what}: infinities differ"
    fin = ~nan & ~inf
    err = (g[fin] - w[fin]).abs() / spacing(want)[fin]
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= ulps, f"{what}: max error {worst:.2f} ulp > {ulps}"
