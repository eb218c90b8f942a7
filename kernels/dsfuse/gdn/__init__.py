"""Gated DeltaNet (chunked, grouped value heads, variable-length documents).

The references (the oracles), the forward and backward as a backend's stages (the Triton ones in
``dsfuse.gdn.triton``) strung together by ``dsfuse.gdn.schedule``, [`chunk_gdn`][dsfuse.gdn.chunk_gdn]
and [`packed_qkv_views`][dsfuse.gdn.packed_qkv_views]; context parallelism over
``torch.distributed`` (``dsfuse.gdn.cp``, [`cp_shards`][dsfuse.gdn.cp_shards]).
"""

from dsfuse.gdn.api import chunk_gdn
from dsfuse.gdn.cp import CPShard, cp_shard, cp_shards
from dsfuse.gdn.packed import packed_qkv_views

from dsfuse.gdn.reference import (
    CHUNK_SIZE,
    L2NORM_EPS,
    ChunkStages,
    chunk_gdn_reference,
    chunk_gdn_stages,
    chunk_local_cumsum,
    chunk_output,
    chunk_state_pass,
    decay_matrix,
    from_chunks,
    gdn_gates,
    l2norm,
    naive_recurrent_gdn,
    packed_cu_seqlens,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    split_by_documents,
    to_chunks,
    ut_transform,
    wy_representation,
)

__all__ = [
    "chunk_gdn",
    "packed_qkv_views",
    "CPShard",
    "cp_shard",
    "cp_shards",
    "CHUNK_SIZE",
    "L2NORM_EPS",
    "ChunkStages",
    "chunk_gdn_reference",
    "chunk_gdn_stages",
    "chunk_local_cumsum",
    "chunk_output",
    "chunk_state_pass",
    "decay_matrix",
    "from_chunks",
    "gdn_gates",
    "l2norm",
    "naive_recurrent_gdn",
    "packed_cu_seqlens",
    "prepare_chunk_indices",
    "prepare_chunk_offsets",
    "split_by_documents",
    "to_chunks",
    "ut_transform",
    "wy_representation",
]
