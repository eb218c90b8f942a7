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

from dsfuse.bench.harness import Case, Provider, select_providers
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
