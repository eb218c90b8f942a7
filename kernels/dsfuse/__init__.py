"""dsfuse: fused training kernels for DeepSeek-V4.1 and Gated DeltaNet hybrids.

Each op lives in its own subpackage (``dsfuse.text_rope``, ...) with a plain
PyTorch reference (``reference.py``), Triton kernels (``triton.py``) and a public
API (``api.py``). Shared argument checks and launch helpers live in
``dsfuse._common``; the benchmark harness in ``dsfuse.bench``.
"""

__version__ = "0.1.0"
