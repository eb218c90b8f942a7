"""How accurate a segment's state map is when composed by a fixed tree rather than walked, with the
products a tensor-core kernel would take (`dsfuse.gdn.chunk_maps`; the design in
`notes/long-document-split.md`). One document of two segments, K = V = 128, chunks of 64, the L2
norm on, several value heads, on the CPU. Gates: the model's (its initialisation's decay rates,
under which a segment of 16 chunks or more forgets its initial state: ``M`` vanishes), strong ones,
and weak ones (a log decay of at most 1e-3 a token); keys drawn in all K directions, or in a
16-dimensional subspace (``rank16``: the delta rule then leaves the rest of the state, so with weak
gates ``M`` carries the state across the segment).

For each segment length, gates and value head it writes the relative error (Frobenius) against
float64 of the second segment's ``E`` (its walk from zero) and of its final state from the first
segment's true final state ``S`` (by the tree: ``M S + E`` merged in float64, as the split merges;
by a walk: walked from ``S``). The walks: fp32, and fp32 with each product's operands rounded to
bf16 (as the chain kernels' wgmma products take them: the error the unsplit chain already has).
The trees: products in fp32, tf32 (operands rounded to 10 mantissa bits), bf16x3 (each operand as
a bf16 pair, three bf16 products) and bf16, accumulating in fp32. Every method starts from the same
chunk inputs (``k``, ``w``, ``u``, gates made in float64, then cast), so only the state pass's
roundings differ.

    python experiments/gdn/tree_maps_accuracy.py OUT_DIR [--chunks 16 128] [--heads 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT / "tests"), str(ROOT / "tests" / "gdn")]

from dsfuse.gdn import chunk_gdn_stages  # noqa: E402
from dsfuse.gdn.chunk_maps import chunk_affine_maps, compose_maps  # noqa: E402
from dsfuse.gdn.reference import chunk_local_cumsum, to_chunks, ut_transform, wy_representation  # noqa: E402
from helpers import model_like_gates  # noqa: E402

F64, F32, K, C = torch.float64, torch.float32, 128, 64


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to tf32's 10 mantissa bits, to nearest, ties to even."""
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(F32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(F32)


PRODUCTS = {  # how a product a @ b takes its fp32 operands (fp32 accumulation throughout)
    "fp32": lambda a, b: a @ b,
    "tf32": lambda a, b: tf32(a) @ tf32(b),
    "bf16x3": lambda a, b: bf16(a) @ bf16(b) + bf16(a) @ bf16(b - bf16(b)) + bf16(a - bf16(a)) @ bf16(b),
    "bf16": lambda a, b: bf16(a) @ bf16(b),
}


def walk(k, w, u, g_cum, h, mm):
    """`dsfuse.gdn.reference.chunk_state_pass`'s final state over one segment from ``h`` (its chunks
    ``[NC, HV, C, ..]``), every product by ``mm`` (which that function does not take)."""
    g_last = g_cum[..., -1]
    k_dec = k * (g_last[..., None] - g_cum).exp()[..., None]
    for c in range(k.shape[0]):
        v_new = u[c] - mm(w[c], h)
        h = g_last[c].exp()[:, None, None] * h + mm(k_dec[c].transpose(-1, -2), v_new)
    return h


def rows(chunks: int, gates: str, keys: str, heads: int, seed: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    t = 2 * chunks * C
    q, k, v = (torch.randn(1, t, n, K, generator=gen) for n in (1, 1, heads))
    if keys == "rank16":  # keys in a 16-dimensional subspace: the delta rule leaves the rest of the state
        k = torch.randn(1, t, 1, 16, generator=gen) @ torch.randn(16, K, generator=gen)
    g, beta = model_like_gates((1, t, heads), gen, "model" if gates == "weak" else gates)
    if gates == "weak":  # decays the model's gates rarely reach: the state map M then carries the state
        g = -1e-3 * torch.rand(1, t, heads, generator=gen)
    st = chunk_gdn_stages(q, k, v, g, beta, scale=K**-0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=[0, t],
                          chunk_size=C, compute_dtype=F64)
    ci = st.chunk_indices
    kc, vc, bc, gc = (to_chunks(x, ci, C) for x in (st.k, v[0].double(), beta[0].double(), g[0].double()))
    g_cum = chunk_local_cumsum(gc)
    w, u = wy_representation(ut_transform(kc, bc, g_cum), kc, vc, bc, g_cum)
    first, second = slice(0, chunks), slice(chunks, 2 * chunks)
    f64 = lambda a, b: a @ b  # noqa: E731
    zero = torch.zeros(heads, K, K, dtype=F64)
    s_in = walk(kc[first], w[first], u[first], g_cum[first], zero, f64)  # the first segment's true state
    inputs = [x[second] for x in (kc, w, u, g_cum)]
    e64 = walk(*inputs, zero, f64)
    s64 = walk(*inputs, s_in, f64)
    m64 = walk(inputs[0], inputs[1], torch.zeros_like(inputs[2]), inputs[3], torch.eye(K, dtype=F64).expand(heads, K, K), f64)
    in32 = [x.float() for x in inputs]

    def rel(a, b):  # per value head
        return ((a.double() - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)).tolist()

    found = {}
    for name, mm in (("walk_fp32", PRODUCTS["fp32"]), ("walk_bf16ops", PRODUCTS["bf16"])):
        found[f"e_{name}"] = rel(walk(*in32, zero.float(), mm), e64)
        found[f"s_{name}"] = rel(walk(*in32, s_in.float(), mm), s64)
    for name, mm in PRODUCTS.items():
        m, e = compose_maps(*chunk_affine_maps(*in32, mm=mm), mm=mm)
        found[f"e_tree_{name}"] = rel(e, e64)
        found[f"s_tree_{name}"] = rel(m.double() @ s_in + e.double(), s64)  # the merge in float64
    decay = (-g_cum[second][..., -1].sum(0)).tolist()  # the segment's total log decay per head
    return [dict(chunks=chunks, gates=gates, keys=keys, head=h, segment_log_decay=decay[h],
                 m_norm=float(m64[h].norm()), e_norm=float(e64[h].norm()), s_in_norm=float(s_in[h].norm()),
                 **{key: vals[h] for key, vals in found.items()}) for h in range(heads)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    table = pd.DataFrame([r for n in args.chunks for gates in ("model", "strong", "weak") for keys in ("full", "rank16")
                          for r in rows(n, gates, keys, args.heads)])
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "accuracy.csv", index=False)
    errors = [c for c in table.columns if c.startswith(("e_", "s_")) and not c.endswith("_norm")]
    print(table.groupby(["chunks", "gates", "keys"])[errors].max().T.to_string(float_format="{:.1e}".format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
