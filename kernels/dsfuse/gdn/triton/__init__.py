"""Triton kernels of the chunked Gated DeltaNet, one module per stage.

Every module holds its kernel(s), a launcher that writes into given outputs (no validation:
the public function did it) and ``AOT_SPECS`` for the model's specialisations
(``K = V = 128``, ``H = 16``, ``HV = 48``, bf16, chunk ``BT = 64``). Forward stages, in order:

* ``cumsum``: chunk-local cumulative gate ``g_cum`` (``launch_chunk_cumsum``);
* ``wy``: UT transform ``A = (I + L)^-1`` and WY representation ``w``, ``u`` (``launch_wy``);
* ``state``: sequential pass over chunks for the chunk states ``h`` and ``v_new``;
* ``output``: the chunk output ``o``.

Shared layout (packed tokens, documents by ``cu_seqlens``, each chunked from its own start):
``chunk_indices`` int32 ``[NC, 3]`` = (sequence, start token, end token); ``g_cum`` fp32
``[T, HV]``; ``A`` fp32 ``[T, HV, BT]`` (row ``i`` of a chunk's matrix at token
``start + i``); ``w`` ``[T, HV, K]`` and ``u`` ``[T, HV, V]`` in the input dtype.
Tokens in no chunk (past ``cu_seqlens[-1]``: the public function refuses such a ``cu_seqlens``,
the stages are tested with one) are left unwritten by ``cumsum`` and ``wy``; ``state`` and
``output`` write zeros there in ``v_new`` and ``o``.
"""
