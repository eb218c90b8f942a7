"""The cooperative backward's variant of a shipped launcher check, frozen at commit 9110dd7.

``backward_shape`` is the shipped launchers' check from ``kernels/dsfuse/engram_gate/triton.py`` at
commit 9110dd7 (unchanged up to 1f14b2b), less its test that no output overlaps an input (that
one lives in the package's private ``dsfuse._common``), so the experiment imports no private name
of the shipped kernels (and the package never imports this folder). The jit helpers this design
calls are in the shared snapshot ``../shipped_helpers_9110dd7.py``.
"""

MAX_DIM = 16384  # the shipped kernels' limit of channels per row


def backward_shape(dout, x, kv, weight, saved, dx, dkv, dweight, workspace) -> tuple[int, int, int]:
    """``(N, S, D)`` with D within the limit (the shipped launchers' check, less its test that no output
    overlaps an input: that one lives in the package's private ``_common``)."""
    n, streams, dim = x.shape
    if dim > MAX_DIM:
        raise ValueError(f"x: D = {dim} is above the fused kernels' limit of {MAX_DIM} channels per row")
    return n, streams, dim
