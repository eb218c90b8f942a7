"""Vision RoPE on CUDA: the layouts SDPA really delivers; on every fused backend of the backward (the
``backend`` fixture): the model geometries (odd T: no dK row is 16-byte aligned) and the extremes,
CUDA Graph replay with changed inputs, no compile for a new T, explicit streams, determinism,
cross-device refusals; the real tower's two blocks."""

import pytest
import torch
from helpers import assert_bitwise, compiled_kernels
from test_vision_rope import check_backward

from dsfuse.vision_rope import (
    attention_front,
    vision_cos_sin,
    vision_rope_backward,
    vision_rope_backward_autograd,
)

pytestmark = pytest.mark.gpu
GEOMETRIES = [(39, 39), (35, 46), (55, 74), (74, 74), (69, 122), (93, 93), (3, 3063), (1, 1), (7, 11)]


def model_grads(n_h, n_w, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = n_h * n_w
    dq = torch.randn(16, tokens, 64, generator=gen, device="cuda").bfloat16()
    dk_hdt = torch.randn(16, 64, tokens, generator=gen, device="cuda").bfloat16()
    dv = torch.randn(16, tokens, 64, generator=gen, device="cuda").bfloat16()
    return (dq, dk_hdt, dv, *vision_cos_sin(n_h, n_w, device="cuda"))


def test_sdpa_delivers_the_native_layouts():
    """3D math SDPA hands back dQ, dV in [H, T, D] storage and dK in [H, D, T] storage (torch may change this)."""
    tokens = 1521
    cos, sin = vision_cos_sin(39, 39, device="cuda")
    qkv = torch.randn(tokens, 3072, device="cuda").bfloat16().requires_grad_()
    q, k, v = attention_front(qkv, cos, sin, 16)
    seen = {}
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        t.register_hook(lambda g, name=name: seen.__setitem__(name, (tuple(g.shape), g.stride())))
    torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    assert seen["dq"] == ((16, tokens, 64), (tokens * 64, 64, 1))
    assert seen["dv"] == ((16, tokens, 64), (tokens * 64, 64, 1))
    assert seen["dk"] == ((16, tokens, 64), (tokens * 64, 1, tokens))


@pytest.mark.serves("backward")
@pytest.mark.parametrize("grid", GEOMETRIES, ids=lambda g: f"{g[0]}x{g[1]}")
def test_model_geometries_bitwise(grid, backend):
    for seed in (1, 2):  # two input banks, fresh buffers each
        args = model_grads(*grid, seed)
        want = check_backward(args, f"{grid} bank {seed}", backend)
        out = torch.full_like(want, float("nan"))  # out= with the [T, D/2] tables too
        assert_bitwise(vision_rope_backward(*args, out=out, backend=backend), want, f"{grid} bank {seed} out=, 2D")


@pytest.mark.serves("backward")
def test_graph_replay_with_changed_inputs_and_dynamic_tokens(backend):
    args = model_grads(55, 74, 3)
    out = torch.empty(55 * 74, 3072, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and loads the kernel before capture
        vision_rope_backward(*args, out=out, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    compiled = compiled_kernels("vision_rope", backend)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vision_rope_backward(*args, out=out, backend=backend)
    for seed in (4, 5):
        fresh = model_grads(55, 74, seed)
        for buf, new in zip(args, fresh):
            buf.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, vision_rope_backward_autograd(*fresh), f"replay {seed}")
    for grid in ((35, 47), (69, 123), (13, 17)):  # new odd token counts: nothing compiles
        args = model_grads(*grid, 6)
        assert_bitwise(vision_rope_backward(*args, backend=backend), vision_rope_backward_autograd(*args), str(grid))
    assert compiled_kernels("vision_rope", backend) == compiled, "a new token count compiled the kernel again"


@pytest.mark.serves("backward")
@pytest.mark.parametrize("grid", [(39, 39), (93, 93)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_explicit_stream_and_determinism(grid, backend):
    """The kernel runs on the stream it is given: while the default stream sleeps, the side stream
    computes the result and copies it to the host (a launch on the default stream would leave the
    NaN-poisoned output there). Then three repeats give the same bits."""
    args = model_grads(*grid, 7)
    want = vision_rope_backward_autograd(*args).cpu()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda._sleep(200_000_000)  # ~0.1 s of the default stream
    got = vision_rope_backward(*args, stream=stream, backend=backend)
    with torch.cuda.stream(stream):
        host = got.to("cpu", non_blocking=False)
    assert_bitwise(host, want, "side stream, before the default stream wakes")
    torch.cuda.synchronize()
    for _ in range(3):
        assert_bitwise(vision_rope_backward(*args, backend=backend), got, "repeat")


@pytest.mark.refusals
def test_cross_device_errors(backend):
    args = list(model_grads(3, 3, 8))
    args[3] = args[3].cpu()
    with pytest.raises(ValueError, match="cos: expected device cuda:0"):
        vision_rope_backward(*args, backend=backend)


def test_tower_two_real_blocks_and_profile():
    """Two blocks of the real widths in bf16: exact equality of every tensor; one fused kernel per block."""
    from torch.profiler import ProfilerActivity, profile

    from dsfuse.models.vision_tower import TowerConfig, VisionTower, synthetic_weights

    cfg = TowerConfig(layers=2)
    model = VisionTower(synthetic_weights(cfg, device="cuda"), cfg)
    patches = torch.randn(39 * 39, 588, device="cuda").bfloat16()
    results = {}
    for rope in ("eager", "dsfuse"):
        x = patches.clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out, hidden = model(x, 39, 39, rope=rope)
            grads = torch.autograd.grad(out, [x, *model.params], torch.ones_like(out))
            torch.cuda.synchronize()
        results[rope] = [out, *hidden, *grads]
        calls = sum(e.count for e in prof.key_averages() if "_vision_rope_bwd_kernel" in e.key)
        assert calls == (cfg.layers if rope == "dsfuse" else 0), (rope, calls)
    for i, (a, b) in enumerate(zip(results["eager"], results["dsfuse"])):
        assert_bitwise(b, a, f"tensor {i}")
