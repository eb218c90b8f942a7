"""Gated DeltaNet experiment: chunk_gdn's forward, backward, checkpointed step and layer step.

Geometry (``experiments/gdn/model.yaml``, the op brief's "Qwen3.5/3.6 linear-attention layer"):
``H`` = 16 qk heads, ``HV`` = 48 value heads, head dim ``D`` = K = V = 128, hidden width 2048 for
the layer step; ``T`` = 32,768 tokens in ``N`` = 5 documents of unequal lengths, none a multiple
of the chunk (64), bf16, with an initial state and the final state, the in-kernel L2 norm of q
and k on and off (config ``l2norm``). Every provider reads q, k, v from ONE packed projection
row ``[T, (2H + HV) D]`` (q heads, then k heads, then v heads), as the model's layer hands them.

Modes (config ``modes``; case names ``T<T>_<l2|nol2>_<mode>``):

* ``fwd``: ``(o, final_state)``;
* ``bwd``: the backward alone: the forward runs once when the provider is built, the timed call
  is ``torch.autograd.grad((o, final_state), leaves, (do, dht), retain_graph=True)``;
* ``fwd+bwd``: forward and that backward in one call;
* ``ckpt``: the checkpointed step: ``torch.utils.checkpoint`` (non-reentrant) around the
  forward, then the backward: two forwards, one backward;
* ``layer``: the layer step: hidden ``[T, 2048]`` bf16 -> bias-free ``Linear`` to the packed row
  -> the q, k, v views -> the op -> ``autograd.grad`` with the fixed ``do``, ``dht``, including
  the projection's weight and input gradients: the concatenation cost of split views in context.

The leaves are the packed row (or, in the layer step, the hidden state and the projection
weight), ``g``, ``beta`` and the initial state.

Providers (config ``providers``):

* ``fla`` (control): flash-linear-attention's ``chunk_gated_delta_rule`` on plain split views of
  the row (see `fla_gdn` for its Hopper guard); ``cu_seqlens`` int64 on the device;
* ``fla-contiguous`` (control): the same on separate contiguous q, k, v, its best case (`_build`'s
  ``contiguous`` form: no split, copy or concatenation in the timed call; no layer step);
* ``flashqla`` (control): FlashQLA's ``chunk_gated_delta_rule`` (`flashqla_gdn`) on the same
  contiguous q, k, v;
* ``dsfuse-packed`` (candidate): `dsfuse.gdn.chunk_gdn` on
  `dsfuse.gdn.packed.packed_qkv_views` of the row: the backward hands over one packed
  gradient row, no concatenation;
* ``dsfuse-split`` (candidate): ``chunk_gdn`` on plain split views (``row.split`` then
  ``unflatten``/``unsqueeze``): torch's split backward concatenates dq, dk, dv into a new row.

Without gradients (``fwd``) the packed and split views are both plain views: the same call.

Outputs, in this order (each mode's a prefix of one list, so one tuple of bounds serves them all,
see `TOLERANCES`): ``o``, ``final_state``, then the gradients ``d_row`` as its three parts
(``[T, H D]``, ``[T, H D]``, ``[T, HV D]``: views of the packed row's gradient, which is what the
step produces; the reference's ``dq``, ``dk``, ``dv`` are put in that layout by
``Provider.expect``), ``dg``, ``dbeta``, ``dh0``. The layer step: ``o``, ``final_state``, the
projection weight's gradient as its q, k, v row blocks (checked at dq's, dk's, dv's bounds),
``dg``, ``dbeta``, ``dh0``, and the hidden state's gradient ``d_hidden``.

Correctness: against the FP64 reference (`dsfuse.gdn.chunk_gdn_reference` and
`dsfuse.gdn.reference_backward.chunk_gdn_backward_reference` with ``compute_dtype=float64``
on the same bf16 inputs; in the layer step on the same bf16 projection row, its weight and input
gradients in FP64 from the FP64 row gradient) by relative RMS error, per output:
``o`` and the final state 0.005; dq, dk, dv, dh0 (and the layer's weight and input gradients)
0.008; dg, dbeta 0.02 (the op brief's contract, flash-linear-attention's test tolerances). A
provider whose check fails is still timed but flagged, and the report never takes it as the
baseline (`dsfuse.bench.report.valid_providers`: only providers whose every check before
and after timing passed are candidates for "fastest valid control"); in particular FLA's
backward counts as a control only where its gradients pass the same FP64 checks in the same run.

Inputs (`make_inputs`): the row ~ N(0, 1) (q and k channels scaled by ``D**-0.5`` when
the L2 norm is off: keys of norm about 1, as the model's normalised keys; raw ones make the
delta rule diverge in the reference too); gates as the model makes them
(`dsfuse.gdn.gdn_gates` with ``A = exp(A_log)`` ~ U(1, 16) and ``softplus(dt_bias)``
log-uniform in [1e-3, 1e-1], the model's initialisation); initial state and ``dht`` ~ 0.1 N(0, 1);
``do`` ~ N(0, 1). Layer step: hidden ~ N(0, 1), weight rows ~ N(0, 1/hidden) (q and k rows also
scaled by ``D**-0.5`` without the L2 norm).

Byte floors (``Case.bytes``), with ``e`` the element size (2 for bf16), ``S = N HV D D`` the
state's elements (fp32, 4 bytes) and ``W = (2H + HV) D`` the row width::

    inputs   = T (2H D + HV D) e  [q, k, v]  +  4 T HV  [g]  +  e T HV  [beta]  +  4 S  [h0]
    fwd      = inputs + T HV D e  [o]  +  4 S  [final state]
    bwd      = inputs + T HV D e  [do]  +  4 S  [dht]
               + T (2H D + HV D) e  [dq, dk, dv]  +  4 T HV  [dg]  +  e T HV  [dbeta]  +  4 S  [dh0]
    fwd+bwd  = fwd + bwd
    ckpt     = 2 fwd + bwd            (the forward runs twice, each with its reads and writes)
    layer    = proj_fwd + fwd + bwd + proj_bwd, with
               proj_fwd = T Hd e [hidden] + W Hd e [weight] + T W e [the row]
               proj_bwd = T W e [d_row] + T Hd e + W Hd e [hidden, weight] + T Hd e [d_hidden] + W Hd e [dW]

(each op of the layer step at its own floor: the row and its gradient stored once, no fusion
across the projection).

FLOPs (``Case.flops``): the matmul FLOPs of the chunked algorithm, per chunk of ``C`` = 64 tokens
and value head (q k^T and k k^T are computed per value head, as the stages do; a partial chunk at
a document's end costs a whole one, as the kernels compute whole tiles), stage by stage
(`dsfuse.gdn.schedule`)::

    forward   wy       L = k k^T: 2C^2 K;  A = (I + L)^-1 (triangular): C^3/3;
                       w = A (beta e^G k): 2C^2 K;  u = A (beta v): 2C^2 V
              state    v_new = u - w h: 2CKV;  h_next += (k e^(G_C - G))^T v_new: 2CKV
              output   (q e^G) h: 2CKV;  q k^T: 2C^2 K;  (q k^T * Gamma) v_new: 2C^2 V
              total    6C^2 K + 4C^2 V + 6CKV + C^3/3
    backward  recompute w, u: 2C^2 K + 2C^2 V (A is saved);  recompute h: 4CKV
              dv_local   q k^T: 2C^2 K;  (.)^T do: 2C^2 V
              state bwd  (k e^(G_C - G)) dH: 2CKV;  (q e^G)^T do: 2CKV;  w^T dv_new: 2CKV
              dqkwg      do v_new^T: 2C^2 V;  do h^T: 2CKV;  dA k: 2C^2 K;  dA^T q: 2C^2 K;
                         v_new dH^T: 2CKV;  dv_new h^T: 2CKV
              wy bwd     A^T dw: 2C^2 K;  A^T du: 2C^2 V;  dw X^T + du Y^T: 2C^2 K + 2C^2 V;
                         A^T dA A^T: 4C^3;  k k^T: 2C^2 K;  (dL * ..) k and its transpose: 4C^2 K
              total      18C^2 K + 10C^2 V + 16CKV + 4C^3

At C = 64, K = V = 128: 11.62 MFLOP forward and 32.51 MFLOP backward per (chunk, value head); the
brief's shape has 516 chunks x 48 value heads: 288 GFLOP forward, 805 GFLOP backward. ``ckpt``
counts two forwards and a backward; ``layer`` adds the projection, ``2 T Hd W`` forward and twice
that backward. The report (`report_extra`) gives the achieved TFLOP/s and, where the config
names the GPU's ``peak_tflops``, the time those FLOPs take at that peak (the FLOPs floor).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from dsfuse.bench.harness import Case, Provider, select_providers
from dsfuse.bench.paths import repo_path

OP = "gdn"
CHUNK = 64
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODES = ("fwd", "bwd", "fwd+bwd", "ckpt", "layer")
GRAD_MODES = ("bwd", "fwd+bwd", "ckpt")  # the op's own gradients (the layer step: its own outputs)
DOC_WEIGHTS = (0.27, 0.09, 0.34, 0.18, 0.12)  # document lengths as fractions of T (as experiments/gdn/forward_check.py)
TOLERANCES = {  # relative RMS against FP64, per output (the op brief's contract)
    "o": 0.005, "final_state": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02,
    "dh0": 0.008, "d_hidden": 0.008,
}
# The bounds' order. The layer step's outputs 2-4 are the projection weight's gradient blocks dW_q,
# dW_k, dW_v, checked at dq's, dk's, dv's bounds; its last is d_hidden.
OUTPUTS = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0", "d_hidden")


# -- geometry, cases, floors ------------------------------------------------------------------


def model_config(config: dict) -> dict:
    """The model geometry the config names (``model_config``), with its ``model_overrides``."""
    model = yaml.safe_load(repo_path(config["model_config"]).read_text())
    return model | config.get("model_overrides", {})


def document_bounds(tokens: int, documents: int | list[int]) -> list[int]:
    """Documents of unequal lengths filling ``tokens``, none a multiple of the chunk (64) when there are
    several (one document may be any length): ``cu_seqlens`` as python ints. ``documents``: their
    lengths (summing to ``tokens``), or their number: then lengths ``DOC_WEIGHTS`` (cycled) of
    ``tokens``, all but the last made odd, the last taking the rest (two tokens move to the first if
    the rest is a multiple of 64)."""
    if isinstance(documents, (list, tuple)):
        lengths = [int(n) for n in documents]
        if sum(lengths) != tokens:
            raise ValueError(f"documents: lengths {lengths} sum to {sum(lengths)}, not tokens = {tokens}")
    else:
        if documents < 1:
            raise ValueError(f"documents: expected at least 1, got {documents}")
        weights = [DOC_WEIGHTS[i % len(DOC_WEIGHTS)] for i in range(documents)]
        lengths = [int(w / sum(weights) * tokens) | 1 for w in weights[:-1]]
        lengths.append(tokens - sum(lengths))
        if documents > 1 and lengths[-1] % CHUNK == 0:
            lengths[0], lengths[-1] = lengths[0] + 2, lengths[-1] - 2
    # several documents: none a multiple of the chunk (each ends in a partial chunk); one may be any length
    if any(n <= 0 for n in lengths) or (len(lengths) > 1 and any(n % CHUNK == 0 for n in lengths)):
        raise ValueError(f"tokens = {tokens} in documents of {lengths} tokens: each must be > 0 and not a multiple "
                         f"of {CHUNK}; use more tokens or fewer documents")
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds


def num_chunks(bounds: list[int]) -> int:
    return sum(math.ceil((b - a) / CHUNK) for a, b in itertools.pairwise(bounds))


def chunk_flops(dim_k: int, dim_v: int, c: int = CHUNK) -> tuple[int, int]:
    """Matmul FLOPs of the forward and of the backward per (chunk, value head) (module docstring)."""
    fwd = 6 * c * c * dim_k + 4 * c * c * dim_v + 6 * c * dim_k * dim_v + c**3 // 3
    bwd = 18 * c * c * dim_k + 10 * c * c * dim_v + 16 * c * dim_k * dim_v + 4 * c**3
    return fwd, bwd


def floors(p: dict) -> dict[str, tuple[int, int]]:
    """``{mode: (bytes, flops)}`` of a case's parameters (module docstring)."""
    t, n, h, hv, d, hd = p["tokens"], p["documents"], p["heads"], p["value_heads"], p["head_dim"], p["hidden"]
    e = torch.empty((), dtype=DTYPES[p["dtype"]]).element_size()
    width = (2 * h + hv) * d
    qkv, state, gate = t * width * e, 4 * n * hv * d * d, 4 * t * hv + e * t * hv  # g fp32, beta in dtype
    o = t * hv * d * e
    inputs = qkv + gate + state
    fwd = inputs + o + state
    bwd = inputs + o + state + qkv + gate + state
    proj_fwd = t * hd * e + width * hd * e + t * width * e
    proj_bwd = t * width * e + t * hd * e + width * hd * e + t * hd * e + width * hd * e
    per_fwd, per_bwd = chunk_flops(d, d)
    heads_chunks = num_chunks(p["bounds"]) * hv
    f_fwd, f_bwd = per_fwd * heads_chunks, per_bwd * heads_chunks
    gemm = 2 * t * hd * width
    return {"fwd": (fwd, f_fwd), "bwd": (bwd, f_bwd), "fwd+bwd": (fwd + bwd, f_fwd + f_bwd),
            "ckpt": (2 * fwd + bwd, 2 * f_fwd + f_bwd),
            "layer": (proj_fwd + fwd + bwd + proj_bwd, f_fwd + f_bwd + 3 * gemm)}


def geometries(config: dict) -> list[tuple[int, list[int], str]]:
    """``(tokens, bounds, name tag)`` of each token count (``tokens``: a number or a list) and, with
    ``document_counts`` (a list, in place of ``documents``), each number of documents; the tag names
    the count (``_n1``) only then, so the other configs keep their case names."""
    tokens_list = config["tokens"] if isinstance(config["tokens"], list) else [config["tokens"]]
    counts = config.get("document_counts")
    if counts is not None and "documents" in config:
        raise ValueError("documents and document_counts: give one (document_counts lists numbers of documents)")
    if counts is not None and (not isinstance(counts, list) or not all(isinstance(n, int) for n in counts)):
        raise ValueError(f"document_counts: expected a list of numbers of documents, got {counts!r}")
    out = []
    for tokens in map(int, tokens_list):
        for documents in counts if counts is not None else [config.get("documents", 5)]:
            tag = "" if counts is None else f"_n{documents}"
            out.append((tokens, document_bounds(tokens, documents), tag))
    return out


def cases(config: dict) -> list[Case]:
    model = model_config(config)
    dtype = config.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    heads, model_hv = model["num_k_heads"], model["num_v_heads"]
    value_heads = config.get("value_heads", [model_hv])
    for hv in value_heads:
        if not isinstance(hv, int) or hv <= 0 or hv % heads:
            raise ValueError(f"value_heads: expected positive multiples of the {heads} qk heads, got {hv!r}")
    out = []
    for tokens, bounds, doc_tag in geometries(config):
        for hv in value_heads:
            tag = doc_tag + ("" if hv == model_hv else f"_hv{hv}")  # the model's geometry keeps the plain name
            for l2 in config.get("l2norm", [True]):
                for mode in config["modes"]:
                    if mode not in MODES:
                        raise ValueError(f"modes: expected some of {MODES}, got {mode!r}")
                    params = dict(tokens=tokens, documents=len(bounds) - 1, bounds=bounds, heads=heads,
                                  value_heads=hv, head_dim=model["head_dim"], hidden=model["hidden_size"],
                                  dtype=dtype, l2norm=bool(l2), backend=config.get("backend", "triton"))
                    nbytes, flops = floors(params)[mode]
                    name = f"T{tokens}{tag}_{'l2' if l2 else 'nol2'}_{mode}"
                    out.append(Case(name, mode, params, bytes=nbytes, flops=flops))
    return out


# -- inputs and reference ---------------------------------------------------------------------


def make_inputs(case: Case, device: torch.device, seed: int) -> dict:
    """The row (or the layer's hidden state and weight), gates, states and output gradients (module docstring)."""
    p = case.params
    t, h, hv, d, hd = p["tokens"], p["heads"], p["value_heads"], p["head_dim"], p["hidden"]
    n = len(p["bounds"]) - 1
    dtype = DTYPES[p["dtype"]]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device)

    qk_scale = 1.0 if p["l2norm"] else d**-0.5
    width = (2 * h + hv) * d
    inputs: dict = {}
    if case.mode == "layer":
        weight = randn(width, hd) * hd**-0.5
        weight[: 2 * h * d] *= qk_scale
        inputs.update(hidden=randn(t, hd).to(dtype), weight=weight.to(dtype))
    else:
        row = randn(t, width)
        row[:, : 2 * h * d] *= qk_scale
        inputs["row"] = row.to(dtype)
    g, beta, _, _ = model_gates(t, hv, gen, device)
    inputs.update(g=g.float(), beta=beta.to(dtype), initial_state=randn(n, hv, d, d) * 0.1,
                  do=randn(1, t, hv, d).to(dtype), dht=randn(n, hv, d, d) * 0.1,
                  cu_seqlens=torch.tensor(p["bounds"], dtype=torch.int32))  # on the host: read without a sync
    return inputs


def model_gates(tokens: int, value_heads: int, gen: torch.Generator, device: torch.device):
    """The gates as the experiment draws them (`make_inputs`), from the model's initialisation:
    ``A_log = log U(1, 16)``, ``softplus(dt_bias) = dt`` with ``dt`` log-uniform in [1e-3, 1e-1], the
    projections ``a``, ``b`` standard normal. ``(g, beta, A_log, dt)``, g and beta ``[1, tokens, HV]``."""
    from dsfuse.gdn import gdn_gates

    def uniform(lo, hi, n):
        return torch.rand(n, generator=gen, device=device) * (hi - lo) + lo

    a_log = uniform(1.0, 16.0, value_heads).log()
    dt = uniform(math.log(1e-3), math.log(1e-1), value_heads).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
    a, b = (torch.randn((1, tokens, value_heads), generator=gen, device=device) for _ in range(2))
    return (*gdn_gates(a, b, a_log, dt_bias), a_log, dt)


def split_views(row: torch.Tensor, heads: int, value_heads: int) -> tuple[torch.Tensor, ...]:
    """Plain split views ``[1, T, H, D]``, ``[1, T, H, D]``, ``[1, T, HV, D]`` of a packed row ``[T, W]``."""
    d = row.shape[-1] // (2 * heads + value_heads)
    return tuple(t.unflatten(-1, (-1, d)).unsqueeze(0) for t in row.split([heads * d, heads * d, value_heads * d], -1))


def fused_backward_inputs(case: Case, device: torch.device) -> dict:
    """What the CuTe DSL backward's two kernels read at ``case``, for the GPU tools that time them alone
    (the per-chunk kernel's ablation, the kernel-copies timer): the case's rows (``q``, ``k``, ``v``,
    ``do``, ``g``, ``beta``: head views of the packed row, batch dropped), ``dht``, ``l2``, ``scale``,
    the chunk table (``ci``, ``co``, ``order``), the forward's saved buffers (``a_round``, ``factors``,
    ``states``: the preparing inverse, then ``head_rs`` in its saving mode) and the reverse chain's
    ``dstates``. Needs a CUDA GPU and the CuTe DSL runtime."""
    from dsfuse.gdn import schedule
    from dsfuse.gdn.cutedsl.fused_fwd import launch_fused_forward
    from dsfuse.gdn.cutedsl.state_bwd import launch_state_backward
    from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, launch_ut_inverse

    p = case.params
    x = make_inputs(case, device, seed=0)
    q, k, v = (t[0] for t in split_views(x["row"], p["heads"], p["value_heads"]))
    table = schedule.chunk_table(p["bounds"], device)
    tokens, hv, dim, chunks = q.shape[0], p["value_heads"], p["head_dim"], table.indices.shape[0]
    s = dict(q=q, k=k, v=v, do=x["do"][0], g=x["g"][0], beta=x["beta"][0], dht=x["dht"], l2=p["l2norm"],
             scale=dim ** -0.5, ci=table.indices, co=table.offsets, order=table.order,
             a_round=torch.empty(tokens, hv, CHUNK, device=device, dtype=q.dtype),
             factors=torch.empty(chunks * len(FACTORS), hv, CHUNK, device=device),
             states=torch.empty(chunks, dim, hv, dim, device=device, dtype=q.dtype),
             dstates=torch.empty(chunks, dim, hv, dim, device=device, dtype=q.dtype))
    g_cum = torch.empty_like(s["g"])
    launch_ut_inverse(k, s["beta"], s["ci"], None, use_qk_l2norm=s["l2"], g=s["g"], g_cum=g_cum, q=q,
                      a_round=s["a_round"], factors=s["factors"])
    launch_fused_forward(q, k, v, s["g"], s["beta"], None, s["ci"], s["co"], s["order"], x["initial_state"],
                         torch.empty_like(s["dht"]), torch.empty(tokens, hv, dim, device=device, dtype=q.dtype), s["scale"],
                         use_qk_l2norm=s["l2"],
                         form="head_rs", g_cum=g_cum, a_round=s["a_round"], factors=s["factors"],
                         states=s["states"])
    launch_state_backward(q, k, s["do"], s["a_round"], s["factors"], s["ci"], s["co"], s["order"], s["dht"],
                          torch.empty_like(s["dht"]), s["dstates"], s["scale"], use_qk_l2norm=s["l2"])
    return s


def packed_views(row: torch.Tensor, heads: int, value_heads: int) -> tuple[torch.Tensor, ...]:
    """`dsfuse.gdn.packed.packed_qkv_views`: one autograd node, one packed row gradient."""
    from dsfuse.gdn.packed import packed_qkv_views

    return packed_qkv_views(row, heads, value_heads)


def row_parts(d_row: torch.Tensor, heads: int, value_heads: int) -> tuple[torch.Tensor, ...]:
    """The q, k, v parts (views) ``[T, H D]``, ``[T, H D]``, ``[T, HV D]`` of a row (gradient) ``[T, W]``."""
    d = d_row.shape[-1] // (2 * heads + value_heads)
    return d_row.split([heads * d, heads * d, value_heads * d], -1)


def weight_parts(d_weight: torch.Tensor, heads: int, value_heads: int) -> tuple[torch.Tensor, ...]:
    """The q, k, v row blocks (views) of the projection weight's gradient ``[W, Hd]``."""
    d = d_weight.shape[0] // (2 * heads + value_heads)
    return d_weight.split([heads * d, heads * d, value_heads * d], 0)


REFERENCE_PIECE = 1 << 21
"""The most tokens x value heads the FP64 reference takes at once (`reference_head_groups`): 32,768
tokens at 64 value heads. One document of 131,072 tokens at 48 took more than an H200's memory for
its backward in one piece (`experiments/gdn/raw/long/20261204-201013-h200`)."""


def reference_head_groups(tokens: int, heads: int, value_heads: int) -> list[tuple[int, int]]:
    """The qk heads ``[h0, h1)`` of each piece of the FP64 reference: whole qk heads with their value
    heads (their gradients sum over them), as many as keep tokens x value heads within
    `REFERENCE_PIECE`, at least one. Every head's recurrence is its own, so the pieces' outputs,
    put side by side, are the whole reference's."""
    group = value_heads // heads
    per = max(1, REFERENCE_PIECE // max(1, tokens * group))
    return [(h0, min(heads, h0 + per)) for h0 in range(0, heads, per)]


def reference(case: Case, inputs: dict) -> tuple[torch.Tensor, ...]:
    """The FP64 chunked reference on the same bf16 inputs (the layer step: on the same bf16 row), in
    pieces of whole qk heads (`reference_head_groups`) where the tokens are many."""
    from dsfuse.gdn import chunk_gdn_reference
    from dsfuse.gdn.reference_backward import chunk_gdn_backward_reference

    p = case.params
    h, hv = p["heads"], p["value_heads"]
    group = hv // h
    with torch.no_grad():
        row = F.linear(inputs["hidden"], inputs["weight"]) if case.mode == "layer" else inputs["row"]
        q, k, v = split_views(row, h, hv)
        outputs, head_dims = None, (2, 1, 2, 2, 2, 2, 2, 1)  # o, dq, dk, dv, dg, dbeta: heads on dim 2; ht, dh0: 1
        for h0, h1 in reference_head_groups(q.shape[1], h, hv):
            qk, vh = slice(h0, h1), slice(h0 * group, h1 * group)  # qk heads, their value heads
            args = dict(q=q[:, :, qk], k=k[:, :, qk], v=v[:, :, vh], g=inputs["g"][..., vh],
                        beta=inputs["beta"][..., vh], initial_state=inputs["initial_state"][:, vh],
                        cu_seqlens=inputs["cu_seqlens"], use_qk_l2norm_in_kernel=p["l2norm"],
                        compute_dtype=torch.float64)
            got = chunk_gdn_reference(**args, output_final_state=True)
            if case.mode != "fwd":
                got += chunk_gdn_backward_reference(**args, do=inputs["do"][:, :, vh], dht=inputs["dht"][:, vh])
            if outputs is None:  # whole-size outputs, each piece copied into its heads as it is made
                outputs = [t.new_empty(t.shape[:dim] + (t.shape[dim] // (h1 - h0) * h,) + t.shape[dim + 1:])
                           for t, dim in zip(got, head_dims)]
            for t, out, dim in zip(got, outputs, head_dims):
                per = t.shape[dim] // (h1 - h0)  # 1 a qk head (dq, dk) or its value heads
                out.narrow(dim, h0 * per, t.shape[dim]).copy_(t)
            del got
        o, ht, *grads = outputs
        if case.mode == "fwd":
            return o, ht
        dq, dk, dv, dg, dbeta, dh0 = grads
        if case.mode != "layer":
            return o, ht, dq, dk, dv, dg, dbeta, dh0
        d_row = torch.cat([dq.flatten(2), dk.flatten(2), dv.flatten(2)], -1)[0]  # [T, W] fp64
        d_weight = d_row.T @ inputs["hidden"].double()
        d_hidden = d_row @ inputs["weight"].double()
        return (o, ht, *weight_parts(d_weight, h, hv), dg, dbeta, dh0, d_hidden)


def as_row_parts(case: Case, expected: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``Provider.expect``: the reference's dq, dk, dv ``[1, T, H|HV, D]`` as the row gradient's parts ``[T, H|HV D]``."""
    if case.mode not in GRAD_MODES:
        return expected
    o, ht, dq, dk, dv, *rest = expected
    return (o, ht, *(t.reshape(t.shape[1], -1) for t in (dq, dk, dv)), *rest)


# -- providers --------------------------------------------------------------------------------


def _capture_stream_forward(device: torch.device):
    """Where the ``bwd`` mode's build-time forward runs: on CUDA, the stream CUDA Graph capture uses.

    Autograd runs each backward node on the stream its forward ran on. A forward run on the
    default (legacy) stream would put the captured backward's kernels there, which a capture
    refuses; on ``torch.cuda.graph``'s capture stream the whole backward is captured on it, and an
    eager call syncs with it as autograd does for any stream."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    graph = torch.cuda.graph
    if getattr(graph, "default_capture_stream", None) is None:
        graph.default_capture_stream = torch.cuda.Stream(device)
    stream = graph.default_capture_stream
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


def contiguous_views(row: torch.Tensor, heads: int, value_heads: int) -> tuple[torch.Tensor, ...]:
    """Contiguous copies of `split_views`: q, k, v as separate tensors (made once, outside the timed call)."""
    return tuple(t.contiguous() for t in split_views(row, heads, value_heads))


def _build(views, make_gdn, *, contiguous: bool = False):
    """A provider ``build``: ``views(row, H, HV) -> (q, k, v)`` and ``make_gdn(case, inputs)``, which
    returns ``gdn(q, k, v, g, beta, h0) -> (o, final_state)``; one runner per mode (module docstring).

    ``contiguous``: q, k, v are contiguous tensors of their own (`contiguous_views`, made when the
    provider is built) and the leaves of the gradient, the best case of a kernel that copies views:
    the timed call neither splits nor concatenates; dq, dk, dv are returned as the row gradient's
    parts (``[T, H D]``, ``[T, H D]``, ``[T, HV D]``). The layer step has no such form (its
    projection hands over one row)."""

    def build(case: Case, inputs: dict):
        p = case.params
        h, hv = p["heads"], p["value_heads"]
        gdn = make_gdn(case, inputs)
        do, dht = inputs["do"], inputs["dht"]
        g, beta, h0 = inputs["g"], inputs["beta"], inputs["initial_state"]
        if contiguous:
            return _contiguous_runner(case, gdn, inputs)
        if case.mode == "fwd":
            row = inputs["row"]
            return lambda: gdn(*views(row, h, hv), g, beta, h0)
        if case.mode == "layer":
            leaves = [t.detach().requires_grad_() for t in (inputs["weight"], g, beta, h0, inputs["hidden"])]

            def layer():
                row = F.linear(leaves[4], leaves[0])
                o, ht = gdn(*views(row, h, hv), *leaves[1:4])
                d_weight, *rest = torch.autograd.grad((o, ht), leaves, (do, dht))
                return (o.detach(), ht.detach(), *weight_parts(d_weight, h, hv), *rest)

            return layer
        leaves = [t.detach().requires_grad_() for t in (inputs["row"], g, beta, h0)]

        def forward(row, g_, beta_, h0_):
            return gdn(*views(row, h, hv), g_, beta_, h0_)

        def grads(o, ht, **kw):
            d_row, *rest = torch.autograd.grad((o, ht), leaves, (do, dht), **kw)
            return (o.detach(), ht.detach(), *row_parts(d_row, h, hv), *rest)

        return _grad_runner(case.mode, forward, leaves, grads, do.device)

    return build


def _grad_runner(mode: str, forward, leaves: list, grads, device: torch.device):
    """The runner of a gradient mode (module docstring): ``forward(*leaves) -> (o, final_state)``,
    ``grads(o, final_state, **autograd_grad_kwargs)`` -> the case's outputs."""
    if mode == "bwd":
        with _capture_stream_forward(device):
            o, ht = forward(*leaves)
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_stream(torch.cuda.graph.default_capture_stream)
        return lambda: grads(o, ht, retain_graph=True)
    if mode == "fwd+bwd":
        return lambda: grads(*forward(*leaves))
    if mode == "ckpt":
        from torch.utils.checkpoint import checkpoint

        # no RNG in the op: nothing to stash (and reading the CUDA RNG state is not capturable)
        return lambda: grads(*checkpoint(forward, *leaves, use_reentrant=False, preserve_rng_state=False))
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def _contiguous_runner(case: Case, gdn, inputs: dict):
    """`_build`'s runner on separate contiguous q, k, v (its ``contiguous`` form)."""
    if case.mode not in ("fwd", *GRAD_MODES):
        raise ValueError(f"mode {case.mode!r}: no contiguous form (the layer step hands over one row)")
    qkv = contiguous_views(inputs["row"], case.params["heads"], case.params["value_heads"])
    g, beta, h0, do, dht = (inputs[name] for name in ("g", "beta", "initial_state", "do", "dht"))
    if case.mode == "fwd":
        return lambda: gdn(*qkv, g, beta, h0)
    leaves = [t.detach().requires_grad_() for t in (*qkv, g, beta, h0)]

    def grads(o, ht, **kw):
        dq, dk, dv, *rest = torch.autograd.grad((o, ht), leaves, (do, dht), **kw)
        return (o.detach(), ht.detach(), *(t.flatten(2)[0] for t in (dq, dk, dv)), *rest)

    return _grad_runner(case.mode, gdn, leaves, grads, do.device)


def _no_layer_form(case: Case) -> str | None:
    return "the layer step hands over views of one projection row: no contiguous form" if case.mode == "layer" else None


def dsfuse_gdn(case: Case, inputs: dict, backend: str | None = None):
    """``chunk_gdn`` with ``backend``, else the case's (``triton`` unless the config says otherwise),
    ``cu_seqlens`` on the host."""
    from dsfuse.gdn import chunk_gdn

    p = case.params
    backend = backend or p["backend"]

    def gdn(q, k, v, g, beta, h0):
        return chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=inputs["cu_seqlens"],
                         use_qk_l2norm_in_kernel=p["l2norm"], backend=backend)

    return gdn


@functools.cache
def fla_import() -> tuple[object | None, str]:
    """``(chunk_gated_delta_rule, note)``, or ``(None, why not)``. Bypasses FLA's Hopper guard: sets
    ``fla.ops.common.chunk_o.IS_NVIDIA_HOPPER = False`` where that attribute exists (see `fla_gdn`).
    Keeps FLA on its own Triton kernels: ``FLA_FLASH_QLA=0`` unless the environment sets it (FLA 0.6
    otherwise dispatches to FlashQLA's fused kernels wherever the ``flash_qla`` package is installed)."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # not installed, or not importable with this torch/triton
        return None, f"flash-linear-attention (fla) is not importable: {type(exc).__name__}: {exc}"
    note = "no Hopper guard found"
    try:
        from fla.ops.common import chunk_o
    except Exception:  # noqa: BLE001  (an FLA without that module has no such guard)
        chunk_o = None
    if chunk_o is not None and hasattr(chunk_o, "IS_NVIDIA_HOPPER"):
        chunk_o.IS_NVIDIA_HOPPER = False
        note = "Hopper guard bypassed (fla.ops.common.chunk_o.IS_NVIDIA_HOPPER = False)"
    return chunk_gated_delta_rule, note


def fla_gdn(case: Case, inputs: dict):
    """flash-linear-attention's ``chunk_gated_delta_rule`` (imported on first use).

    Its Hopper guard is bypassed: before first use, ``fla.ops.common.chunk_o.IS_NVIDIA_HOPPER`` is
    set to False where that attribute exists. FLA refuses its backward on Hopper with Triton >= 3.4
    and < 3.7.1 (its issue 640: wrong dq, dk, dg from a transposed wgmma accumulator); with the
    guard bypassed FLA 0.6.0 matched the FP64 recurrence on the H200 test GPU at T = 4,096 (op
    brief), so its backward is a control here only where its outputs and gradients pass the same
    FP64 checks in the same run at the benchmark shape; otherwise the run records it as failing and
    it is never the baseline. ``cu_seqlens`` int64 on the device (made once, when built). FLA's
    Triton path (its FlashQLA backend off: `fla_import`); q, k, v plain split views of the row,
    which FLA makes contiguous (its ``input_guard``).
    """
    return _peer_gdn(fla_import()[0], case, inputs)


def _peer_gdn(fn, case: Case, inputs: dict):
    """``gdn`` of a peer's ``chunk_gated_delta_rule(q, k, v, g, beta, ...)`` (flash-linear-attention's
    signature, which FlashQLA shares), with ``cu_seqlens`` int64 on the device, made once."""
    p = case.params
    cu = inputs["cu_seqlens"].to(device=inputs["do"].device, dtype=torch.int64)

    def gdn(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=p["l2norm"])

    return gdn


def _fla_applies(case: Case) -> str | None:
    return fla_import()[1] if fla_import()[0] is None else None


@functools.cache
def flashqla_import() -> tuple[object | None, str]:
    """``(chunk_gated_delta_rule, note)`` of FlashQLA (the ``flash_qla`` package), or ``(None, why not)``.
    It travels apart from the ``cutedsl`` extra (its TileLang pins apache-tvm-ffi below 0.1.13, the
    extra wants 0.1.15 or later): ``bash scripts/gpu_install_carry.sh qla-a`` and ``qla-b``."""
    try:
        import flash_qla
    except Exception as exc:  # not installed, or not importable with this torch
        return None, f"FlashQLA (flash_qla) is not importable: {type(exc).__name__}: {exc}"
    return flash_qla.chunk_gated_delta_rule, f"flash_qla {flash_qla.__version__}"


def flashqla_gdn(case: Case, inputs: dict):
    """FlashQLA's ``chunk_gated_delta_rule`` (TileLang kernels; on Hopper its fused, warp-specialised
    forward and backward) with its defaults, automatic intra-GPU context parallelism included (its
    best setting; its split of long documents depends on the SM count). TileLang compiles the kernels
    on their first call, which the checks before timing make. ``cu_seqlens`` int64 on the device."""
    return _peer_gdn(flashqla_import()[0], case, inputs)


def _flashqla_applies(case: Case) -> str | None:
    fn, note = flashqla_import()
    return note if fn is None else _no_layer_form(case)


def tolerances(config: dict) -> tuple[float, ...]:
    """One relative RMS bound per output, in `OUTPUTS` order: the contract, updated by the config's
    ``relrms`` (by output name)."""
    override = config.get("relrms", {})
    unknown = sorted(set(override) - set(TOLERANCES))
    if unknown:
        raise ValueError(f"relrms: unknown outputs {unknown}; expected names from {list(OUTPUTS)}")
    bounds = TOLERANCES | {k: float(v) for k, v in override.items()}
    return tuple(bounds[name] for name in OUTPUTS)


def providers(config: dict) -> list[Provider]:
    check = dict(check="relrms", rtol=tolerances(config), expect=as_row_parts)
    table = {
        "fla": lambda: Provider("fla", _build(split_views, fla_gdn), role="control", applies=_fla_applies, **check),
        "fla-contiguous": lambda: Provider("fla-contiguous", _build(None, fla_gdn, contiguous=True), role="control",
                                           applies=lambda case: _fla_applies(case) or _no_layer_form(case), **check),
        "flashqla": lambda: Provider("flashqla", _build(None, flashqla_gdn, contiguous=True), role="control",
                                     applies=_flashqla_applies, **check),
        "dsfuse-packed": lambda: Provider("dsfuse-packed", _build(packed_views, dsfuse_gdn), role="candidate",
                                          **check),
        "dsfuse-split": lambda: Provider("dsfuse-split", _build(split_views, dsfuse_gdn), role="candidate", **check),
        # the Triton stages by name, beside a config whose backend is another (e.g. auto's CuTe DSL forward)
        "dsfuse-triton": lambda: Provider("dsfuse-triton", _build(packed_views, functools.partial(dsfuse_gdn,
                                                                                                   backend="triton")),
                                          role="candidate", **check),
    }
    return select_providers(table, config)


# -- report -----------------------------------------------------------------------------------


def report_extra(run_dir: Path, cases: list[str] | None = None) -> list[str]:
    """Packed against split views per case (the concatenation's cost), each provider's extra peak memory
    per case (where the run has ``memory.csv``), and the FLOPs: achieved TFLOP/s per provider and, where
    the config names ``peak_tflops``, the FLOPs floor (graph clock, L2 evicted; the wall clock of a smoke
    run)."""
    from tabulate import tabulate

    from dsfuse.bench.report import _fmt, load_run, summarize, valid_providers

    run = load_run(Path(run_dir), cases)
    med, _, _ = summarize(run)
    if med.empty:
        return []
    clock, regime = ("graph", "evicted") if "graph" in set(med["clock"]) else ("wall", "hot")
    valid = valid_providers(run["validation"])
    us = med.set_index(["case", "provider", "clock", "regime"])["us"]
    cases = run["cases"][run["cases"]["case"] != "copy"]
    lines: list[str] = []

    rows = []
    for case in cases["case"]:
        for clk in dict.fromkeys([clock, "eager"]):
            key_p, key_s = (case, "dsfuse-packed", clk, regime), (case, "dsfuse-split", clk, regime)
            if key_p not in us.index or key_s not in us.index:
                continue
            packed, split = float(us[key_p]), float(us[key_s])
            ok = all(p in valid.get(case, set()) for p in ("dsfuse-packed", "dsfuse-split"))
            rows.append([case, f"{clk}/{regime}", _fmt(split), _fmt(packed), _fmt(split - packed),
                         f"{_fmt(split / packed, 2)}x", "yes" if ok else "NO"])
    if rows:
        lines += ["### Packed views against plain split views", "",
                  "The same kernels; the split views' backward goes through torch's split backward, which "
                  "concatenates dq, dk, dv into a new row (the forward alone has no gradient: the same call). "
                  "'split - packed': that concatenation's cost in the step, in us.", "",
                  tabulate(rows, headers=["case", "clock/cache", "split us", "packed us", "split - packed",
                                          "split / packed", "checks pass"], tablefmt="github", floatfmt=".12g"), ""]

    lines += memory_table(run, list(cases["case"]))

    peak = run["config"].get("peak_tflops")
    rows = []
    for r in cases.itertuples():
        flops = float(r.flops)
        sel = med[(med["case"] == r.case) & (med["clock"] == clock) & (med["regime"] == regime)]
        achieved = ", ".join(f"{row.provider} {_fmt(flops / row.us / 1e6)}" for row in sel.itertuples())
        floor = _fmt(flops / (float(peak) * 1e6)) if peak else "n/a"
        rows.append([r.case, _fmt(flops / 1e9, 1), floor, achieved or "n/a"])
    if rows:
        rate = f"{peak} TFLOP/s (the config's `peak_tflops`, a datasheet figure)" if peak else "no peak given"
        lines += ["### FLOPs", "",
                  f"Matmul FLOPs of the chunked algorithm (module docstring of `dsfuse.bench.gdn`); floor: at {rate}; "
                  f"achieved: TFLOP/s at each provider's median, {clock} clock, {regime} cache.", "",
                  tabulate(rows, headers=["case", "GFLOP", "FLOPs floor us", "achieved TFLOP/s"], tablefmt="github",
                           floatfmt=".12g"), ""]

    if "fla" in run["config"].get("providers", []):
        checks = run["validation"][run["validation"]["provider"] == "fla"]
        failing = sorted(set(checks.loc[checks["status"] == "fail", "case"]))
        note = ("flash-linear-attention (`fla`) ran with its Hopper guard bypassed "
                "(`fla.ops.common.chunk_o.IS_NVIDIA_HOPPER = False` where FLA has it; `dsfuse.bench.gdn.fla_gdn`). "
                "It is a baseline only in the cases where every one of its checks against FP64 passed in this run")
        lines += [note + (f"; it failed in {', '.join(failing)}." if failing else "."), ""]
    return lines


def memory_table(run: dict, case_names: list[str]) -> list[str]:
    """``### Extra peak memory``: one row per case, one column per provider (the config's order), the
    peak MiB of ``memory.csv`` to the whole MiB, n/a where a provider has no row; nothing without rows."""
    from tabulate import tabulate

    from dsfuse.bench.report import _fmt

    memory = run["memory"]
    if memory.empty:
        return []
    peak = memory.groupby(["case", "provider"])["peak_mib"].max()
    names = list(dict.fromkeys([*run["config"].get("providers", []), *memory["provider"]]))
    rows = [[case, *(_fmt(peak[(case, name)], 0) if (case, name) in peak.index else "n/a" for name in names)]
            for case in case_names]
    return ["### Extra peak memory", "",
            ("MiB allocated during one eager call of each provider above what was allocated before it "
             "(`torch.cuda.max_memory_allocated`: the caching allocator's tensor bytes, not its reserved pool), "
             "the call made after the check before timing has warmed the provider up and before any CUDA Graph "
             "capture: the inputs excluded, the outputs and gradients included, in `bwd` the forward's saved "
             "tensors excluded (held before the call); providers that run in their own process measured in that "
             "process; n/a: not measured."), "",
            tabulate(rows, headers=["case", *names], tablefmt="github", colalign=["left"] + ["right"] * len(names)),
            ""]


# -- the op's piece of the tools that loop over every op (host time, fingerprints, ncu) --------

MODEL_CONFIG = "experiments/gdn/model.yaml"  # (H, HV) = (16, 48), K = V = 128
HOST_TIME_TOKENS, HOST_TIME_DOCUMENTS = 128, 2  # documents of 97 and 31 tokens: a few tiny kernels per stage
SEED_TOKENS, SEED_DOCUMENTS = 32768, 5  # the seed's shape (configs/h200.yaml): 8847, 2949, 11141, 5899, 3932 tokens
FINGERPRINT_SEED = 4  # the other ops' fingerprints use seeds 1 to 3


def _tool_case(mode: str, tokens: int, documents: int, backend: str) -> Case:
    """One case of this experiment (model geometry, bf16, L2 norm on) for the tools below."""
    config = dict(model_config=MODEL_CONFIG, tokens=tokens, documents=documents, dtype="bfloat16", modes=[mode],
                  l2norm=[True], backend=backend)
    return cases(config)[0]


def _reference_gdn(case: Case, inputs: dict):
    """The chunked reference in fp32 (eager PyTorch), as a ``make_gdn`` of ``_build``."""
    from dsfuse.gdn import chunk_gdn_reference

    def gdn(q, k, v, g, beta, h0):
        return chunk_gdn_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=inputs["cu_seqlens"], use_qk_l2norm_in_kernel=case.params["l2norm"],
                                   compute_dtype=torch.float32)

    return gdn


def host_time_calls(dev: torch.device) -> list[tuple]:
    """``(call, provider, fn)`` rows of ``python -m dsfuse.bench.host_time``: ``chunk_gdn`` (backend
    ``auto``) on packed views of the projection row and the fp32 chunked reference on split views
    (eager PyTorch), forward and autograd forward+backward (the experiment's steps, ``_build``), and
    the validation; T = 128 tokens in 2 documents (97 and 31), (H, HV) = (16, 48), K = V = 128, bf16,
    L2 norm on, an initial state and the final state: tiny, so the GPU keeps up with the host."""
    from dsfuse.gdn import api

    case = _tool_case("fwd+bwd", HOST_TIME_TOKENS, HOST_TIME_DOCUMENTS, "auto")
    fwd = _tool_case("fwd", HOST_TIME_TOKENS, HOST_TIME_DOCUMENTS, "auto")
    inputs = make_inputs(case, dev, seed=0)
    p = case.params
    q, k, v = packed_views(inputs["row"], p["heads"], p["value_heads"])
    g, beta, h0, cu = inputs["g"], inputs["beta"], inputs["initial_state"], inputs["cu_seqlens"]
    return [
        ("forward", "dsfuse", _build(packed_views, dsfuse_gdn)(fwd, inputs)),
        ("forward", "eager PyTorch", _build(split_views, _reference_gdn)(fwd, inputs)),
        ("autograd forward+backward", "dsfuse", _build(packed_views, dsfuse_gdn)(case, inputs)),
        ("autograd forward+backward", "eager PyTorch", _build(split_views, _reference_gdn)(case, inputs)),
        ("forward part: validation", "dsfuse", lambda: api._validate(q, k, v, g, beta, None, h0, cu)),
    ]


def fingerprint_outputs(device: torch.device, tokens: int = SEED_TOKENS, documents: int = SEED_DOCUMENTS,
                        backend: str = "triton") -> dict[str, torch.Tensor]:
    """Outputs and gradients of one forward+backward of ``chunk_gdn`` on packed views of the row (the
    experiment's ``fwd+bwd`` step of provider ``dsfuse-packed``): ``o``, ``final_state``, the packed
    row gradient's parts ``dq``, ``dk``, ``dv``, and ``dg``, ``dbeta``, ``dh0``. The experiment's
    inputs (``make_inputs``) drawn on the CPU from seed 4, then moved to ``device``; ``cu_seqlens``
    stays on the host, as in the experiment."""
    case = _tool_case("fwd+bwd", tokens, documents, backend)
    inputs = {name: t if name == "cu_seqlens" else t.to(device)
              for name, t in make_inputs(case, torch.device("cpu"), FINGERPRINT_SEED).items()}
    return dict(zip(OUTPUTS, _build(packed_views, dsfuse_gdn)(case, inputs)()))


def fingerprint_cases() -> dict:
    """``{entry: outputs(device)}`` of ``scripts/output_hashes.py``: ``fingerprint_outputs`` at the
    seed's shape, T = 32,768 tokens in five documents (8847, 2949, 11141, 5899, 3932: ``document_bounds``),
    (H, HV) = (16, 48), K = V = 128, bf16, L2 norm on, Triton backend."""
    return {OP: fingerprint_outputs}


def ncu_calls(dev: torch.device, backends: list[str]) -> dict:
    """``{call: fn}`` of ``scripts/ncu_backends.py``: the forward and the backward alone (the experiment's
    ``fwd`` and ``bwd`` steps of ``dsfuse-packed``) at the seed's shape (T = 32,768 in five documents,
    (H, HV) = (16, 48), K = V = 128, bf16, L2 norm on) on each backend."""
    inputs = make_inputs(_tool_case("fwd", SEED_TOKENS, SEED_DOCUMENTS, "triton"), dev, seed=0)
    found = {}
    for backend in backends:
        for mode in ("fwd", "bwd"):
            case = _tool_case(mode, SEED_TOKENS, SEED_DOCUMENTS, backend)
            found[f"{mode} T{SEED_TOKENS}: {backend}"] = _build(packed_views, dsfuse_gdn)(case, inputs)
    return found
