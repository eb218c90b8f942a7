"""Text RoPE on CUDA, every fused backend (the ``backend`` fixture): model shapes, CUDA Graphs,
streams, determinism, int64 offsets, no compile for a new sequence length.

Everything here is bitwise against the eager model on the same GPU.
"""

import pytest
import torch
from helpers import assert_bitwise, compiled_kernels

from dsfuse.text_rope import apply_rope, rope_angles, rope_reference, yarn_inv_freq

pytestmark = pytest.mark.gpu

# DeepSeek-V4.1: 64 heads x 512, RoPE on the last 64 channels, KV latent 512, theta 160000 + YaRN.
INV_FREQ = dict(rotary_dim=64, theta=160000.0, factor=16.0, original_max_position=65536)


def model_angles(batch, seq, offset=0, device="cuda"):
    positions = offset + torch.arange(seq, device=device)[None].expand(batch, seq)
    return rope_angles(positions, yarn_inv_freq(**INV_FREQ))


def randn(*shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def fwd_bwd(fn, values, angles, inverse, grad):
    leaf = values.clone().requires_grad_()
    out = fn(leaf, angles, inverse)
    (dvalues,) = torch.autograd.grad(out, leaf, grad)
    return out, dvalues


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "name,shape,inverse",
    [("q", (1, 4096, 64, 512), False), ("kv", (2, 4096, 512), False), ("o", (1, 4096, 64, 512), True),
     ("q_tail", (3, 1027, 64, 512), False)],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_model_shapes_bitwise(name, shape, inverse, dtype, backend):
    values, grad = randn(*shape, dtype=dtype, seed=1), randn(*shape, dtype=dtype, seed=2)
    angles = model_angles(shape[0], shape[1], offset=12345)
    fused = lambda v, a, i: apply_rope(v, a, i, backend=backend)  # noqa: E731
    out, dvalues = fwd_bwd(fused, values, angles, inverse, grad)
    ref_out, ref_dvalues = fwd_bwd(rope_reference, values, angles, inverse, grad)
    assert_bitwise(out, ref_out, f"{name} forward")
    assert_bitwise(dvalues, ref_dvalues, f"{name} backward")
    work = values.clone()
    apply_rope(work, angles, inverse, inplace=True, backend=backend)
    assert_bitwise(work, ref_out, f"{name} in place")


def test_cuda_graph_replay_with_changed_inputs(backend):
    shape = (1, 2048, 64, 512)
    values, angles = randn(*shape, seed=3), model_angles(1, 2048)
    grad = randn(*shape, seed=4)
    leaf = values.clone().requires_grad_()
    out_buf = torch.empty(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        out = apply_rope(leaf, angles, backend=backend)
        (dvalues,) = torch.autograd.grad(out, leaf, grad)
        apply_rope(leaf.detach(), angles, True, out=out_buf, backend=backend)
        return out, dvalues

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dvalues = step()
    for seed in (5, 6):
        with torch.no_grad():
            leaf.copy_(randn(*shape, seed=seed))
            grad.copy_(randn(*shape, seed=seed + 10))
            angles.copy_(model_angles(1, 2048, offset=seed * 1000))
            for t in (out, dvalues, out_buf):
                t.fill_(float("nan"))  # poison: replay must rewrite every element
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_d = fwd_bwd(rope_reference, leaf.detach(), angles, False, grad)
        assert_bitwise(out, ref_out, "graph forward")
        assert_bitwise(dvalues, ref_d, "graph backward")
        assert_bitwise(out_buf, rope_reference(leaf.detach(), angles, True), "graph inverse out=")


def test_explicit_stream(backend):
    shape = (1, 4096, 64, 512)
    values, angles = randn(*shape, seed=7), model_angles(1, 4096)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # values/angles were produced on the current stream
    out = torch.empty_like(values)
    torch.cuda._sleep(10_000_000)  # keep the current stream busy: a result on it would race
    apply_rope(values, angles, out=out, stream=stream, backend=backend)
    with torch.cuda.stream(stream):
        owned = apply_rope(values, angles, backend=backend)
    torch.cuda.current_stream().wait_stream(stream)
    ref = rope_reference(values, angles)
    assert_bitwise(out, ref, "out= on a side stream")
    assert_bitwise(owned, ref, "allocating call on a side stream")


def test_deterministic(backend):
    shape = (1, 4096, 64, 512)
    values, angles, grad = randn(*shape, seed=8), model_angles(1, 4096), randn(*shape, seed=9)
    fused = lambda v, a, i: apply_rope(v, a, i, backend=backend)  # noqa: E731
    first = fwd_bwd(fused, values, angles, False, grad)
    for _ in range(3):
        again = fwd_bwd(fused, values, angles, False, grad)
        assert_bitwise(again[0], first[0], "forward repeat")
        assert_bitwise(again[1], first[1], "backward repeat")


def test_int64_offsets(backend):
    """More than 2**31 elements: offsets past the int32 range must still be right."""
    shape = (1, 65537, 64, 512)  # 2**31 + 32768 elements of bf16 (4 GiB)
    values = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    values[:, -16:] = randn(1, 16, 64, 512, seed=10)
    values[:, :16] = randn(1, 16, 64, 512, seed=11)
    angles = model_angles(1, shape[1])
    out = apply_rope(values, angles, backend=backend)
    for rows in (slice(0, 16), slice(-16, None)):
        assert_bitwise(out[:, rows], rope_reference(values[:, rows], angles[:, rows]), f"rows {rows}")
    del out, values
    torch.cuda.empty_cache()


def test_sequence_length_changes_do_not_recompile(backend):
    angles_of = lambda s: model_angles(1, s)  # noqa: E731
    apply_rope(randn(1, 4097, 8, 512), angles_of(4097), backend=backend)
    compiled = compiled_kernels("text_rope", backend)
    for seq in (4099, 5001, 6007, 9):  # seq == 1 would be a new specialisation (Triton specialises 1)
        apply_rope(randn(1, seq, 8, 512), angles_of(seq), backend=backend)
    new = compiled_kernels("text_rope", backend) - compiled
    assert new == 0, f"{new} new compilations for new sequence lengths"
