"""Model fixtures used by the tests and the experiments; not kernels.

Plain-PyTorch pieces of the DeepSeek-V4.1 models that the ops are checked and
timed inside, so that an op can be validated in its real surroundings:

* `dsfuse.models.vision_tower`: the 32-layer vision tower and aligner, with
  a safetensors weight loader and synthetic weights of the real shapes (the
  whole-tower validation of the vision RoPE backward).
* `dsfuse.models.vision_geometry`: the image processor's geometry (patch
  grid and LLM token count for an image size).

Nothing here is part of the kernel API; the op packages (``dsfuse.text_rope``,
``dsfuse.vision_rope``, ...) never import from this folder.
"""
