"""Vision RoPE backward experiment: geometries from the image processor, inputs, reference, providers.

Each case is one image geometry: ``T = n_h * n_w`` patch tokens from
`dsfuse.models.vision_geometry.patch_grid` with the processor values of
``experiments/vision_rope/model.yaml``. Inputs are what the model's 3D math SDPA
hands back: ``dq_htd`` and ``dv_htd`` contiguous ``[H, T, D]``, ``dk_hdt``
contiguous ``[H, D, T]``, plus the fp32 tables. The output is ``dqkv``
``[T, 3 * H * D]``. Byte floor: read the three gradients and both tables, write dqkv.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import yaml

from dsfuse.bench.harness import Case, Provider, cpu_draws, select_providers
from dsfuse.bench.paths import raw_file, repo_path
from dsfuse.models.vision_geometry import ProcessorConfig, patch_grid
from dsfuse.vision_rope import (
    attention_front,
    vision_cos_sin,
    vision_rope_backward,
    vision_rope_backward_autograd,
    vision_rope_backward_reference,
)
from dsfuse.vision_rope.triton import launch_backward

OP = "vision_rope"


def model_config(config: dict) -> dict:
    """The model geometry the config names (``model_config``, relative to the repository root)."""
    return yaml.safe_load(repo_path(config["model_config"]).read_text())


def geometries(config: dict) -> list[tuple[str, int, int]]:
    """(label, n_h, n_w) per configured image size (``[height, width]``) or explicit grid (``grid: [n_h, n_w]``)."""
    model = model_config(config)
    proc = ProcessorConfig(**model["processor"])
    out = []
    for g in config["geometries"]:
        n_h, n_w = g["grid"] if "grid" in g else patch_grid(*g["image"], proc)
        out.append((g.get("label", f"{n_h}x{n_w}"), n_h, n_w))
    return out


def cases(config: dict) -> list[Case]:
    model = model_config(config)
    heads, dim = model["heads"], model["hidden"] // model["heads"]
    out = []
    for label, n_h, n_w in geometries(config):
        tokens = n_h * n_w
        grads = 3 * heads * tokens * dim * 2  # bf16
        tables = 2 * tokens * (dim // 2) * 4
        out.append(Case(
            name=f"T{tokens}_{n_h}x{n_w}", mode="bwd",
            params=dict(n_h=n_h, n_w=n_w, tokens=tokens, heads=heads, dim=dim, label=label, theta=model["theta"]),
            bytes=grads + tables + grads,
            flops=2 * heads * tokens * dim * 3,
        ))
    return out


def make_inputs(case: Case, device: torch.device, seed: int) -> dict:
    p = case.params
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)

    cos, sin = vision_cos_sin(p["n_h"], p["n_w"], p["dim"] // 2, p["theta"], device=device)
    return dict(dq_htd=randn(p["heads"], p["tokens"], p["dim"]), dk_hdt=randn(p["heads"], p["dim"], p["tokens"]),
                dv_htd=randn(p["heads"], p["tokens"], p["dim"]), cos=cos, sin=sin)


def _args(inputs: dict) -> tuple:
    return inputs["dq_htd"], inputs["dk_hdt"], inputs["dv_htd"], inputs["cos"], inputs["sin"]


def reference(case: Case, inputs: dict) -> tuple[torch.Tensor, ...]:
    """Eager autograd of the model's front end."""
    return (vision_rope_backward_autograd(*_args(inputs)),)


def _eager_autograd(case: Case, inputs: dict):
    """The model's own backward: autograd through the front end's graph (built once, outside timing)."""
    dq, dk_hdt, dv, cos, sin = _args(inputs)
    heads, tokens, dim = dq.shape
    qkv = torch.zeros(tokens, 3 * heads * dim, dtype=dq.dtype, device=dq.device, requires_grad=True)
    outs = attention_front(qkv, cos, sin, heads)
    grads = (dq, dk_hdt.transpose(1, 2), dv)
    return lambda: torch.autograd.grad(outs, qkv, grads, retain_graph=True)


def _formula(fn):
    def build(case: Case, inputs: dict):
        args = _args(inputs)
        return lambda: (fn(*args),)

    return build


def _copy_dk_then_fused(case: Case, inputs: dict):
    """The fused kernel fed a dK first copied to [H, T, D]: the kernel without its layout fusion."""
    dq, dk_hdt, dv, cos, sin = _args(inputs)
    heads, tokens, dim = dq.shape

    def run():
        out = torch.empty(tokens, 3 * heads * dim, dtype=dq.dtype, device=dq.device)
        return (launch_backward(dq, dk_hdt.transpose(1, 2).contiguous(), dv, cos, sin, out),)

    return run


def _liger(case: Case, inputs: dict):
    """Liger-Kernel's RoPE backward on dQ, dK (it copies both to [B, T, H, D]), then torch.cat packing."""
    from liger_kernel.ops.rope import rope_backward

    dq, dk_hdt, dv, cos, sin = _args(inputs)
    heads, tokens, dim = dq.shape
    cos2, sin2 = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]

    def run():
        rdq, rdk = rope_backward(dq[None], dk_hdt.transpose(1, 2)[None], cos2, sin2)
        parts = [g[0].transpose(0, 1).reshape(tokens, heads * dim) for g in (rdq, rdk, dv[None])]
        return (torch.cat(parts, -1),)

    return run


def _liger_applies(case: Case) -> str | None:
    try:
        import liger_kernel.ops.rope  # noqa: F401
    except Exception as exc:
        return f"Liger-Kernel unavailable: {type(exc).__name__}: {exc}"[:300]
    return None


def _cutedsl_applies(case: Case) -> str | None:
    """The CuTe DSL backward runs on CUDA and needs the ``cutedsl`` extra (imported on first use)."""
    if not torch.cuda.is_available():
        return "the CuTe DSL backend runs on CUDA only"
    try:
        import dsfuse.vision_rope.cutedsl  # noqa: F401
    except Exception as exc:
        return f"CuTe DSL unavailable: {type(exc).__name__}: {exc}"[:300]
    return None


def providers(config: dict) -> list[Provider]:
    # automatic dynamic shapes: one recompilation covers every token count
    compiled = functools.partial(torch.compile, fullgraph=True)
    table = {
        "eager-autograd": lambda: Provider("eager-autograd", _eager_autograd),
        "manual-eager": lambda: Provider("manual-eager", _formula(vision_rope_backward_reference)),
        "compile-default": lambda: Provider("compile-default", _formula(compiled(vision_rope_backward_reference))),
        "compile-max-autotune": lambda: Provider(
            "compile-max-autotune",
            _formula(compiled(vision_rope_backward_reference, mode="max-autotune-no-cudagraphs")),
        ),
        "copy-dk-fused": lambda: Provider("copy-dk-fused", _copy_dk_then_fused),
        "liger": lambda: Provider("liger", _liger, applies=_liger_applies),
        "dsfuse": lambda: Provider(
            "dsfuse", _formula(functools.partial(vision_rope_backward, backend="triton")), role="candidate"
        ),
        "dsfuse-cutedsl": lambda: Provider(
            "dsfuse-cutedsl", _formula(functools.partial(vision_rope_backward, backend="cutedsl")), role="candidate",
            applies=_cutedsl_applies,
        ),
    }
    return select_providers(table, config)


def after_run(config: dict, run_dir: Path, device: torch.device) -> None:
    """The whole-tower validation and timing, on a GPU, when the config asks for it."""
    if device.type == "cuda" and "tower" in config:
        from dsfuse.bench.vision_tower import run_tower

        run_tower(config, run_dir)


def report_extra(run_dir: Path, cases: list[str] | None = None) -> list[str]:
    """Tables of the whole-tower run (`dsfuse.bench.vision_tower`), when the run has one (a run's own,
    whatever ``cases`` it gives)."""
    import pandas as pd
    from tabulate import tabulate

    run_dir = Path(run_dir)
    if not raw_file(run_dir, "tower_validation.csv").exists():
        return []
    val = pd.read_csv(raw_file(run_dir, "tower_validation.csv"))
    prof = pd.read_csv(raw_file(run_dir, "tower_profile.csv"))
    samples = pd.read_csv(raw_file(run_dir, "tower_samples.csv"))
    lines = ["### Whole tower: fused backward swapped in, every tensor compared", "",
             "32-layer tower + aligner, synthetic weights of the real shapes read from safetensors, forward + "
             "checkpointed backward with the model's rotary front end and with dsfuse's; output, 32 hidden "
             "states, input gradient and 263 parameter gradients compared bit for bit.", ""]
    table = []
    for (geometry, bank), grp in val.groupby(["geometry", "bank"], sort=False):
        calls = prof[(prof["geometry"] == geometry) & (prof["bank"] == bank) & (prof["rope"] == "dsfuse")]
        table.append([geometry, bank, len(grp), int(grp["bitwise_equal"].sum()), f"{grp['max_abs_diff'].max():.3g}",
                      int(calls["fused_bwd_calls"].iloc[0]) if not calls.empty else "n/a"])
    lines += [tabulate(table, headers=["geometry", "bank", "tensors", "bitwise equal", "max abs diff",
                                       "fused bwd kernels"], tablefmt="github"), ""]
    lines += ["### Whole tower: forward + checkpointed backward time", "",
              "Medians over paired blocks (eager and dsfuse alternate); ratio = eager median / dsfuse median "
              "[min, max of the same ratio per block]. CUDA events (GPU) and host wall time around one forward + "
              "backward.", ""]
    table = []
    for geometry, grp in samples.groupby("geometry", sort=False):
        med = grp.groupby("provider")[["gpu_ms", "wall_ms"]].median()
        blocks = grp.groupby(["block", "provider"])["gpu_ms"].median().unstack("provider")
        ratio = blocks["eager"] / blocks["dsfuse"]
        overall = med.loc["eager", "gpu_ms"] / med.loc["dsfuse", "gpu_ms"]  # the report's ratio: of medians
        table.append([geometry, int(grp["tokens"].iloc[0]), f"{med.loc['eager', 'gpu_ms']:.2f}",
                      f"{med.loc['dsfuse', 'gpu_ms']:.2f}", f"{overall:.4f} [{ratio.min():.4f}, {ratio.max():.4f}]",
                      f"{med.loc['eager', 'wall_ms'] / med.loc['dsfuse', 'wall_ms']:.4f}"])
    lines += [tabulate(table, headers=["geometry", "tokens", "eager ms", "dsfuse ms", "GPU ratio [min, max]",
                                       "wall ratio"], tablefmt="github"), ""]
    return lines


# -- the op's piece of the tools that loop over every op (host time, fingerprints, ncu) --------


# Host-time targets: the dsfuse call's median host time at most this many torch.add calls' in the same run
# (python -m dsfuse.bench.host_time on the H200 machine); an autograd forward+backward below eager PyTorch's.
HOST_TARGETS = {"backward op (forward call)": 3}


def host_time_calls(dev: torch.device) -> list[tuple]:
    """``(call, provider, fn)`` rows of ``python -m dsfuse.bench.host_time`` on tiny tensors (an 8 x 8
    grid, 16 heads of 64): the backward op and eager PyTorch, the attention front's autograd
    forward+backward, the launch; on a GPU with the ``cutedsl`` extra, the CuTe DSL backward and its parts."""
    from dsfuse.bench.host_time import backward_of, cutedsl_rows
    from dsfuse.vision_rope import (attention_front, vision_cos_sin, vision_rope_attention_front,
                                    vision_rope_backward, vision_rope_backward_reference)
    from dsfuse.vision_rope import api

    heads, tokens, dim = 16, 64, 64
    cos, sin = vision_cos_sin(8, 8, dim // 2, device=dev)
    dq, dv = (torch.randn(heads, tokens, dim, device=dev).bfloat16() for _ in range(2))
    dk_hdt = torch.randn(heads, dim, tokens, device=dev).bfloat16()
    qkv = torch.randn(tokens, 3 * heads * dim, device=dev).bfloat16().requires_grad_()
    grads = [dq, dk_hdt.transpose(1, 2), dv]
    return [
        ("backward op (forward call)", "dsfuse",
         lambda: vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="triton")),
        ("backward op (forward call)", "eager PyTorch",
         lambda: vision_rope_backward_reference(dq, dk_hdt, dv, cos, sin)),
        ("autograd forward+backward", "dsfuse",
         backward_of(lambda x: vision_rope_attention_front(x, cos, sin, heads, backend="triton"), [qkv], grads)),
        ("autograd forward+backward", "eager PyTorch",
         backward_of(lambda x: attention_front(x, cos, sin, heads), [qkv], grads)),
        ("backward part: signature lookup (a seen signature)", "dsfuse",
         lambda: api.BACKWARD_PLANS.get(api.BACKWARD_PLANS.key("triton", dq, dk_hdt, dv, cos, sin, None))),
        ("backward part: checks and choice (a new signature)", "dsfuse",
         lambda: api._check_backward(dq, dk_hdt, dv, cos, sin, None, "triton")),
        ("backward part: launch (allocate + 1 Triton launch)", "dsfuse",
         lambda: api.backward_ops["triton"](dq, dk_hdt.transpose(1, 2), dv, cos, sin)),
    ] + cutedsl_rows(dev, lambda: _host_time_cutedsl_rows(dq, dk_hdt, dv, cos, sin))


def _host_time_cutedsl_rows(dq, dk_hdt, dv, cos, sin) -> list[tuple]:
    """The public call on the CuTe DSL backward, and its parts: where its host time goes."""
    from dsfuse.vision_rope import api, vision_rope_backward
    from dsfuse.vision_rope.cutedsl import kernels as vc

    heads, _, dim = dq.shape
    out = api._new_dqkv(dq)
    kernel = vc._kernel(dq.dtype, heads, dim, True, dq.device)  # compiles here, not in the loop
    dk_htd = dk_hdt.transpose(1, 2)
    return [
        ("backward op (forward call)", "dsfuse cutedsl",
         lambda: vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="cutedsl")),
        ("backward part: into out (validation + launcher, no allocation)", "dsfuse cutedsl",
         lambda: vision_rope_backward(dq, dk_hdt, dv, cos, sin, out=out, backend="cutedsl")),
        ("backward part: allocate out (torch.empty)", "dsfuse cutedsl", lambda: api._new_dqkv(dq)),
        ("backward part: launcher (layout checks + compiled function)", "dsfuse cutedsl",
         lambda: vc.launch_backward(dq, dk_htd, dv, cos, sin, out)),
        ("backward part: compiled function alone (TVM-FFI call, 6 tensors)", "dsfuse cutedsl",
         lambda: kernel(dq, dk_hdt, dv, cos, sin, out)),
    ]


def fingerprint_cases() -> dict:
    """``{entry: outputs(device)}`` of ``scripts/output_hashes.py``: the backward op (functional and
    ``out=``) and the attention front's outputs and gradient at the model's largest grid (93 x 93 =
    8649 tokens, 16 heads of 64, bf16, dK in its ``[H, D, T]`` storage); inputs drawn on the CPU from seed 2."""

    def outputs(device: torch.device) -> dict[str, torch.Tensor]:
        from dsfuse.vision_rope import vision_cos_sin, vision_rope_attention_front, vision_rope_backward

        _, randn = cpu_draws(2, device)

        heads, dim, tokens = 16, 64, 8649
        cos, sin = vision_cos_sin(93, 93, dim // 2, 10000.0, device=device)
        dq = randn((heads, tokens, dim), torch.bfloat16)
        dk_hdt = randn((heads, dim, tokens), torch.bfloat16)
        dv = randn((heads, tokens, dim), torch.bfloat16)
        out = {"dqkv": vision_rope_backward(dq, dk_hdt, dv, cos, sin)}
        buf = torch.empty_like(out["dqkv"])
        out["dqkv_out"] = vision_rope_backward(dq, dk_hdt, dv, cos, sin, out=buf).clone()
        qkv = randn((tokens, 3 * heads * dim), torch.bfloat16).requires_grad_()
        q, k, v = vision_rope_attention_front(qkv, cos, sin, heads)
        out.update(front_q=q, front_k=k)
        (q * dq + k * dk_hdt.transpose(1, 2) + v * dv).float().sum().backward()
        out["front_qkv_grad"] = qkv.grad
        return out

    return {OP: outputs}


def ncu_calls(dev: torch.device, backends: list[str]) -> dict:
    """``{call: fn}`` of ``scripts/ncu_backends.py``: the backward at T = 8649 (the model's 93 x 93 grid;
    16 heads x 64, bf16, dK in its ``[H, D, T]`` storage) on each backend, and a copy of the same bytes."""
    from dsfuse.vision_rope import vision_rope_backward

    gen = torch.Generator(device=dev).manual_seed(0)
    heads, tokens, dim = 16, 8649, 64
    dq, dv = (torch.randn(heads, tokens, dim, device=dev, generator=gen).bfloat16() for _ in range(2))
    dk_hdt = torch.randn(heads, dim, tokens, device=dev, generator=gen).bfloat16()
    angles = torch.rand(tokens, dim // 2, device=dev, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    dqkv = torch.empty(tokens, 3 * heads * dim, device=dev, dtype=torch.bfloat16)
    src = torch.empty(dqkv.numel() + cos.numel() * 2 * 2, dtype=torch.bfloat16, device=dev)  # same bytes read
    dst = torch.empty_like(src)
    found = {"bwd T8649: copy of the bytes it reads": lambda: torch.add(src, 0, out=dst)}  # a kernel
    for backend in backends:
        found[f"bwd T8649: {backend}"] = (
            lambda b=backend: vision_rope_backward(dq, dk_hdt, dv, cos, sin, out=dqkv, backend=b))
    return found
