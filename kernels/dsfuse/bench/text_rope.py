"""Text RoPE experiment: cases from the DeepSeek-V4.1 config, inputs, reference, providers.

Tensors (from the model config, ``experiments/text_rope/model.yaml``):

* ``q``: queries ``[B, S, heads, head_dim]``, RoPE on the last ``rope_dim`` channels;
* ``kv``: the shared KV latent ``[B, S, kv_dim]``, RoPE on its last ``rope_dim`` channels;
* ``o``: attention output ``[B, S, heads, head_dim]``, inverse RoPE.

Angles are ``position * inv_freq`` with the model's theta and frequency-only
YaRN. Byte floors: out-of-place forward reads ``values`` and writes the output
(plus the fp32 angles); the backward reads the gradient and writes the input
gradient; the in-place forward reads and writes only the rotary channels.
"""

from __future__ import annotations

import functools

import torch
import yaml

from dsfuse.bench.harness import Case, Provider, cpu_draws, select_providers
from dsfuse.bench.paths import repo_path
from dsfuse.text_rope import apply_rope, rope_angles, rope_reference, rope_reference_inplace, yarn_inv_freq

OP = "text_rope"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_config(config: dict) -> dict:
    """The model geometry the config names (``model_config``, relative to the repository root)."""
    return yaml.safe_load(repo_path(config["model_config"]).read_text())


def tensor_shape(model: dict, tensor: str, batch: int, seq: int) -> tuple[int, ...]:
    if tensor in ("q", "o"):
        return (batch, seq, model["num_attention_heads"], model["head_dim"])
    if tensor == "kv":
        return (batch, seq, model["kv_latent_dim"])
    raise ValueError(f"tensor: expected one of q, kv, o, got {tensor!r}")


def cases(config: dict) -> list[Case]:
    model = model_config(config)
    dtype = DTYPES[config.get("dtype", "bfloat16")]
    pairs = model["rope_head_dim"] // 2
    rope = {k: model[k] for k in ("rope_head_dim", "rope_theta", "rope_theta_sliding", "rope_scaling",
                                  "max_position_embeddings")}
    out = []
    for geom in config["geometries"]:
        batch, seq = geom["batch"], geom["seq"]
        for tensor in config["tensors"]:
            shape = tensor_shape(model, tensor, batch, seq)
            numel = 1
            for n in shape:
                numel *= n
            esize = torch.empty((), dtype=dtype).element_size()
            angles_bytes = batch * seq * pairs * 4
            rot_numel = numel // shape[-1] * 2 * pairs
            inplace_bytes = 2 * rot_numel * esize + angles_bytes  # read + write the rotary channels only
            for mode in config["modes"]:
                passes = 1 if mode == "fwd" else 2
                params = dict(tensor=tensor, shape=list(shape), pairs=pairs, dtype=config.get("dtype", "bfloat16"),
                              inverse=tensor == "o", layer=geom.get("layer", "yarn"), rope=rope)
                out.append(Case(
                    name=f"{tensor}_{'x'.join(map(str, shape))}_{mode}",
                    mode=mode,
                    params=params | {"bytes_by_provider": {p: inplace_bytes for p in ("eager-inplace", "dsfuse-inplace")}},
                    bytes=passes * 2 * numel * esize + angles_bytes,
                    flops=passes * 6 * rot_numel // 2,
                ))
    return out


def make_inputs(case: Case, device: torch.device, seed: int) -> dict:
    """Random values (and output gradient); angles from the model's frequencies at random offsets."""
    model = case.params["rope"]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = DTYPES[case.params["dtype"]]
    shape = case.params["shape"]
    values = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    if case.params["layer"] == "yarn":
        inv_freq = yarn_inv_freq(model["rope_head_dim"], model["rope_theta"], **model["rope_scaling"])
    else:
        inv_freq = yarn_inv_freq(model["rope_head_dim"], model["rope_theta_sliding"])
    batch, seq = shape[0], shape[1]
    start = torch.randint(0, model["max_position_embeddings"] - seq, (batch, 1), generator=gen)
    angles = rope_angles(start + torch.arange(seq)[None, :], inv_freq)
    inputs = dict(values=values.to(device), angles=angles.to(device), inverse=case.params["inverse"])
    if case.mode == "fwd+bwd":
        inputs["grad"] = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)
    return inputs


def reference(case: Case, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The eager model: output, and for fwd+bwd the input gradient through eager autograd."""
    return _eager(rope_reference)(case, inputs)()


def _eager(fn):
    """A provider ``build`` running ``fn(values, angles, inverse)`` (and its backward)."""

    def build(case: Case, inputs: dict):
        values, angles, inverse = inputs["values"], inputs["angles"], inputs["inverse"]
        if case.mode == "fwd":
            return lambda: (fn(values, angles, inverse),)
        leaf = values.detach().requires_grad_()
        grad = inputs["grad"]

        def run():
            out = fn(leaf, angles, inverse)
            (dvalues,) = torch.autograd.grad(out, leaf, grad)
            return out.detach(), dvalues

        return run

    return build


def _inplace(fn):
    """A provider ``build`` for an in-place form: rotates a private copy, ``reset()`` restores it."""

    def build(case: Case, inputs: dict):
        values, angles, inverse = inputs["values"], inputs["angles"], inputs["inverse"]
        work = values.clone()

        def run():
            return (fn(work, angles, inverse),)

        run.reset = lambda: work.copy_(values)
        return run

    return build


def _fwd_only(case: Case) -> str | None:
    return None if case.mode == "fwd" else "in-place forms are timed forward only"


def _fla_tail(case: Case, inputs: dict):
    """flash-linear-attention's rotary kernel on a contiguous copy of the rotary tail.

    Its contract differs (it rotates the FIRST channels, takes cos/sin in the
    values' dtype, and returns only the tail), so it is an anchor: checked with
    a bf16 tolerance against the reference tail, never a ratio baseline.
    """
    from fla.modules.rotary import rotary_embedding

    values, angles, inverse = inputs["values"], inputs["angles"], inputs["inverse"]
    if values.ndim != 4 or values.shape[0] != 1:
        raise ValueError("the FLA anchor is run on 4D inputs with batch 1 (cos/sin [S, P])")
    rd = 2 * angles.shape[-1]
    cos, sin = angles[0].cos().to(values.dtype), angles[0].sin().to(values.dtype)
    if inverse:
        sin = -sin

    if case.mode == "fwd":
        return lambda: (rotary_embedding(values[..., -rd:].contiguous(), cos, sin, interleaved=True),)
    leaf = values.detach().requires_grad_()
    grad = inputs["grad"]

    def run():
        out = rotary_embedding(leaf[..., -rd:].contiguous(), cos, sin, interleaved=True)
        (dvalues,) = torch.autograd.grad(out, leaf, grad[..., -rd:])
        return out.detach(), dvalues[..., -rd:]

    return run


def _tail(case: Case, expected: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    rd = 2 * case.params["pairs"]
    return tuple(t[..., -rd:] for t in expected)


def providers(config: dict) -> list[Provider]:
    compiled = functools.partial(torch.compile, dynamic=False, fullgraph=True)
    table = {
        "eager": lambda: Provider("eager", _eager(rope_reference)),
        "eager-inplace": lambda: Provider("eager-inplace", _inplace(rope_reference_inplace), applies=_fwd_only,
                                          form="in-place"),
        "compile-default": lambda: Provider("compile-default", _eager(compiled(rope_reference))),
        "compile-max-autotune": lambda: Provider(
            "compile-max-autotune", _eager(compiled(rope_reference, mode="max-autotune-no-cudagraphs"))
        ),
        "fla-tail": lambda: Provider("fla-tail", _fla_tail, role="anchor", check="allclose", rtol=0.02, atol=0.02,
                                     applies=_fla_applies, expect=_tail),
        "dsfuse": lambda: Provider("dsfuse", _eager(functools.partial(_dsfuse, inplace=False)), role="candidate"),
        "dsfuse-inplace": lambda: Provider(
            "dsfuse-inplace", _inplace(functools.partial(_dsfuse, inplace=True)), role="candidate", applies=_fwd_only,
            form="in-place",
        ),
    }
    return select_providers(table, config)


def _fla_applies(case: Case) -> str | None:
    if len(case.params["shape"]) != 4 or case.params["shape"][0] != 1:
        return "the FLA anchor takes [1, S, H, D] inputs"
    try:
        import fla.modules.rotary  # noqa: F401
    except Exception as exc:  # not installed, or no GPU backend
        return f"flash-linear-attention unavailable: {type(exc).__name__}: {exc}"[:300]
    return None


def _dsfuse(values, angles, inverse, *, inplace):
    return apply_rope(values, angles, inverse, inplace=inplace, backend="triton")


# -- the op's piece of the tools that loop over every op (host time, fingerprints, ncu) --------


# Host-time targets: the dsfuse call's median host time at most this many torch.add calls' in the same run
# (python -m dsfuse.bench.host_time on the H200 machine); an autograd forward+backward below eager PyTorch's.
HOST_TARGETS = {"forward": 6}


def host_time_calls(dev: torch.device) -> list[tuple]:
    """``(call, provider, fn)`` rows of ``python -m dsfuse.bench.host_time`` on tiny tensors (64 tokens, 8
    heads of 512): the public call and eager PyTorch, forward and autograd forward+backward, and the
    forward's parts."""
    from dsfuse.bench.host_time import backward_of
    from dsfuse.text_rope import api, apply_rope, rope_reference

    values = torch.randn(1, 64, 8, 512, device=dev).bfloat16()
    angles = torch.rand(1, 64, 32, device=dev)
    leaf = values.clone().requires_grad_()
    grad = torch.randn_like(values)
    freqs = api._freqs(angles)
    out = torch.empty_like(values)
    return [
        ("forward", "dsfuse", lambda: apply_rope(values, angles)),
        ("forward", "eager PyTorch", lambda: rope_reference(values, angles)),
        ("autograd forward+backward", "dsfuse", backward_of(apply_rope, [leaf, angles], [grad])),
        ("autograd forward+backward", "eager PyTorch", backward_of(rope_reference, [leaf, angles], [grad])),
        ("forward part: signature lookup (a seen signature)", "dsfuse",
         lambda: api.PLANS.get(api.PLANS.key("auto", False, False, values, angles, None))),
        ("forward part: validation (a new signature)", "dsfuse", lambda: api._validate(values, angles, False, None)),
        ("forward part: backend choice (a new signature)", "dsfuse",
         lambda: api._choose(values, angles, False, "auto")),
        ("forward part: freqs (torch.polar, 1 kernel)", "dsfuse", lambda: api._freqs(angles)),
        ("forward part: rotation (allocate + 1 Triton launch)", "dsfuse",
         lambda: api.rotate_ops["triton"](values, freqs, False, False)),
        ("forward part: rotation into out (1 Triton launch)", "dsfuse",
         lambda: api.BACKENDS.load("triton")["rope"](values, freqs, out, conj=False)),
    ]


def fingerprint_cases() -> dict:
    """``{entry: outputs(device)}`` of ``scripts/output_hashes.py``: every path of the public API
    (functional, inverse, ``out=``, in place, autograd, in place on a non-leaf) at the model's shape,
    q ``[1, 4096, 64, 512]`` and kv ``[1, 4096, 512]`` bf16, YaRN angles of positions up to 10^6;
    inputs drawn on the CPU from seed 1."""

    def outputs(device: torch.device) -> dict[str, torch.Tensor]:
        from dsfuse.text_rope import apply_rope, rope_angles, yarn_inv_freq

        gen, randn = cpu_draws(1, device)

        inv_freq = yarn_inv_freq(64, 160000.0, factor=16.0, original_max_position=65536)
        pos = torch.randint(0, 1_000_000, (1, 4096), generator=gen)
        angles = rope_angles(pos, inv_freq).to(device)
        q = randn((1, 4096, 64, 512), torch.bfloat16)
        kv = randn((1, 4096, 512), torch.bfloat16)
        dq = randn(q.shape, torch.bfloat16)
        out = {"q_fwd": apply_rope(q, angles), "q_inverse": apply_rope(q, angles, inverse=True),
               "kv_fwd": apply_rope(kv, angles)}
        buf = torch.empty_like(q)
        out["q_out"] = apply_rope(q, angles, out=buf).clone()
        out["q_inplace"] = apply_rope(q.clone(), angles, inplace=True)
        leaf = q.clone().requires_grad_()
        apply_rope(leaf, angles).backward(dq)
        out["q_grad"] = leaf.grad
        leaf = q.clone().requires_grad_()
        apply_rope(leaf * 1, angles, inplace=True).backward(dq)  # in place on a non-leaf
        out["q_inplace_grad"] = leaf.grad
        return out

    return {OP: outputs}


def ncu_calls(dev: torch.device, backends: list[str]) -> dict:
    """``{call: fn}`` of ``scripts/ncu_backends.py``: the forward of q at the model's shape
    (``[1, 4096, 64, 512]`` bf16, into a given output) on each backend."""
    from dsfuse.text_rope import apply_rope

    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 4096, 64, 512, device=dev, generator=gen).bfloat16()
    angles = torch.rand(1, 4096, 32, device=dev, generator=gen) * 6.3
    out = torch.empty_like(q)
    return {f"fwd T4096: {backend}": (lambda b=backend: apply_rope(q, angles, out=out, backend=b))
            for backend in backends}
