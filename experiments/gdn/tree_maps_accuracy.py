"""How accurate a segment's state map is when composed by a fixed tree in fp32 rather than walked
(`dsfuse.gdn.chunk_maps.chunk_affine_maps`, `compose_maps`; the design in
`notes/long-document-split.md`). One document, one value head, K = V = 128, chunks of 64, the
L2 norm on, the model's gates and strong ones, on the CPU. For each segment length it writes the
relative RMS error against the float64 walk of ``M`` (the state pass from the identity with u = 0)
and ``E`` (from zero), for the tree in fp32 and for the walk in fp32, and the float64 ``M``'s norm.

    python experiments/gdn/tree_maps_accuracy.py OUT_DIR [--chunks 16 128]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT / "tests"), str(ROOT / "tests" / "gdn")]

from dsfuse.gdn import chunk_gdn_stages  # noqa: E402
from dsfuse.gdn.chunk_maps import chunk_affine_maps, compose_maps  # noqa: E402
from dsfuse.gdn.reference import (  # noqa: E402
    chunk_local_cumsum,
    chunk_state_pass,
    to_chunks,
    ut_transform,
    wy_representation,
)
from helpers import model_like_gates  # noqa: E402

F64, K, C = torch.float64, 128, 64


def maps(chunks: int, gates: str, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t = chunks * C
    q, k = (torch.randn(1, t, 1, K, generator=gen) for _ in range(2))
    v = torch.randn(1, t, 1, K, generator=gen)
    g, beta = model_like_gates((1, t, 1), gen, gates)
    st = chunk_gdn_stages(q, k, v, g, beta, scale=K**-0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=[0, t],
                          chunk_size=C, compute_dtype=F64)
    ci = st.chunk_indices
    kc, vc, bc, gc = (to_chunks(x, ci, C) for x in (st.k, v[0].double(), beta[0].double(), g[0].double()))
    g_cum = chunk_local_cumsum(gc)
    w, u = wy_representation(ut_transform(kc, bc, g_cum), kc, vc, bc, g_cum)
    eye = torch.eye(K, dtype=F64).expand(1, 1, K, K)

    def walk(dtype):
        k_, w_, u_, g_ = (x.to(dtype) for x in (kc, w, u, g_cum))
        m = chunk_state_pass(k_, w_, torch.zeros_like(u_), g_, ci, 1, eye.to(dtype))[2][0]
        e = chunk_state_pass(k_, w_, u_, g_, ci, 1, torch.zeros(1, 1, K, K, dtype=dtype))[2][0]
        return m, e

    m64, e64 = walk(F64)
    m_walk, e_walk = walk(torch.float32)
    m_tree, e_tree = compose_maps(*chunk_affine_maps(*(x.float() for x in (kc, w, u, g_cum))))

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm()) if b.norm() > 0 else float("nan")

    return dict(chunks=chunks, gates=gates, m_norm=float(m64.norm()), e_norm=float(e64.norm()),
                m_tree_fp32=rel(m_tree, m64), m_walk_fp32=rel(m_walk, m64),
                e_tree_fp32=rel(e_tree, e64), e_walk_fp32=rel(e_walk, e64))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 128])
    args = parser.parse_args()
    rows = [maps(n, gates) for n in args.chunks for gates in ("model", "strong")]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "accuracy.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
