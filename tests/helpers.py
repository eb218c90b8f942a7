"""Comparison helpers of the tests (bit patterns, ulps), model-like inputs, and a backend-neutral
count of compiled kernels."""

import importlib
import math

import torch

from dsfuse.bench.harness import bits
from dsfuse.bench.harness import rel_rms as harness_rel_rms

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


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """`dsfuse.bench.harness.rel_rms` on the host (tensors on different devices compare)."""
    return harness_rel_rms(got.cpu(), want.cpu())


def assert_rel_rms(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> float:
    """``got`` finite (an unwritten, NaN-poisoned element fails) and within ``tol`` relative RMS of
    ``want``; returns the error."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values (an element left unwritten?)"
    err = rel_rms(got, want)
    assert err <= tol, f"{what}: relative RMS error {err:.2e} > {tol:.1e}"
    return err


def model_like_gates(shape, gen: torch.Generator, kind: str = "model"):
    """Gated DeltaNet ``(g, beta)`` of ``shape`` ``[B, T, HV]`` as the model makes them
    (``dsfuse.gdn.gdn_gates``): ``"model"`` with its initialisation (A ~ U(0, 16), softplus(dt_bias)
    ~ dt in [1e-3, 1e-1]); ``"strong"`` with softplus ~ 4 + |noise| (g down to about -100 per token)."""
    from dsfuse.gdn import gdn_gates

    hv = shape[-1]
    a = torch.randn(*shape, generator=gen)
    b = torch.randn(*shape, generator=gen)
    a_log = torch.empty(hv).uniform_(1, 16, generator=gen).log()
    if kind == "model":
        dt = torch.exp(torch.rand(hv, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt_bias = dt + torch.log(-torch.expm1(-dt))
    elif kind == "strong":
        dt_bias = torch.full((hv,), 4.0)
        a = a * 2
    else:
        raise ValueError(kind)
    return gdn_gates(a, b, a_log, dt_bias)


def compiled_kernels(op: str, backend: str) -> int:
    """How many kernels ``backend`` has compiled for ``op`` in this process, on the current CUDA device
    (Triton: the entries of its kernels' JIT caches; CuTe DSL: the builds of the kernel modules'
    ``CACHE``). A test that asserts "a new length compiles nothing" reads it before and after."""
    import torch

    from dsfuse._common.backends import load_all_ops

    modules = [importlib.import_module(m) for m in load_all_ops()[op].kernels[backend]]
    if backend == "triton":
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.jit import JITFunction

        device = torch.cuda.current_device()
        count = 0
        for fn in {id(f): f for m in modules for f in vars(m).values()}.values():
            while isinstance(fn, (Autotuner, Heuristics)):
                fn = fn.fn
            if isinstance(fn, JITFunction) and device in fn.device_caches:  # no lookup: the cache is a defaultdict
                count += len(fn.device_caches[device][0])
        return count
    if backend == "cutedsl":
        return sum(m.CACHE.compiles for m in modules if hasattr(m, "CACHE"))
    raise LookupError(f"compiled_kernels: no compile count for the {backend} backend; add one here")


def cute_spec_ptx(spec, arch: str, tmp_path) -> str:
    """The PTX of a CuTe DSL AOT spec compiled for ``arch`` (CPU): it targets ``arch`` and has no
    atomics or reductions (a fixed order of every sum) and reads nothing back from local memory (the
    fragments stay in registers; the tensor-core form leaves dead stores of operand copies there,
    which are never read)."""
    import re

    ptx = spec.build(arch, dump_dir=str(tmp_path)).__ptx__
    assert re.search(rf"\.target {arch}\b", ptx), spec.name
    assert not re.search(r"\b(atom|red)\.", ptx), f"{spec.name}: atomics or reductions"
    assert not re.search(r"\bld\.local\b", ptx), f"{spec.name}: reads from local memory (a spill)"
    return ptx


def assert_product_matches_float64(module, form: str, dtype: torch.dtype) -> None:
    """A CuTe DSL product check (``module.check`` of ``module.FORMS[form]``: `dsfuse.gdn.cutedsl.mma`,
    `dsfuse.gdn.cutedsl.wgmma`) with its operands stored as the fused forward stores them (transposed
    where the form says), on a GPU: relative RMS <= 1e-5 against the float64 product of the same
    values (fp32 accumulation), and bitwise equal run to run."""
    m, n, k, a_t, b_t = module.FORMS[form]
    gen = torch.Generator(device="cuda").manual_seed(len(form))
    a_mk = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b_nk = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    a = a_mk.T.contiguous() if a_t else a_mk
    b = b_nk.T.contiguous() if b_t else b_nk
    c = module.check(a, b, form)
    torch.cuda.synchronize()
    want = a_mk.double() @ b_nk.double().T
    assert_rel_rms(c.double(), want, 1e-5, f"{form} {dtype}")
    assert torch.equal(c, module.check(a, b, form))
