"""The CuTe DSL UT inverse (``dsfuse.gdn.cutedsl.ut_inverse``), the first kernel of the planned fused
forward: the identity it relies on (CPU, float64), its compilation for sm_90a and sm_100a (CPU), and
on a GPU its rows against the float64 reference with varlen documents, tails and the L2 norm."""

import pytest
import torch

from conftest import cutedsl_or_skip
from helpers import assert_rel_rms
from dsfuse.gdn.reference import (
    decay_matrix,
    l2norm,
    prepare_chunk_indices,
    to_chunks,
    ut_transform,
)

F64 = torch.float64


def _chunked(k, beta, g, cu_seqlens, group):
    """k ``[T, H, K]``, beta and g ``[T, HV]`` as the reference's chunks ``[NC, HV, C, *]`` (k expanded
    to the value heads), with ``g_cum`` the chunk-local cumulative gate."""
    ci = prepare_chunk_indices(cu_seqlens)
    k_c = to_chunks(k.repeat_interleave(group, dim=1), ci)  # [NC, HV, C, K]
    return ci, k_c, to_chunks(beta, ci), to_chunks(g, ci).cumsum(-1)  # beta, g_cum [NC, HV, C]


def test_gated_inverse_is_the_ungated_one_times_the_decays():
    """The identity the fused forward relies on: with D = diag(exp(G)), (I + D M D^-1)^-1 =
    D (I + M)^-1 D^-1, so ``ut_transform`` with the gate equals the ungated one times Gamma."""
    gen = torch.Generator().manual_seed(0)
    t, h, hv, d = 200, 2, 4, 32
    cu = [0, 1, 64, 130, 200]
    k = l2norm(torch.randn(t, h, d, generator=gen, dtype=F64))
    beta = torch.rand(t, hv, generator=gen, dtype=F64)
    g = -torch.rand(t, hv, generator=gen, dtype=F64) * 0.5
    _, k_c, beta_c, g_cum = _chunked(k, beta, g, cu, hv // h)
    gated = ut_transform(k_c, beta_c, g_cum)
    ungated = ut_transform(k_c, beta_c, torch.zeros_like(g_cum))
    torch.testing.assert_close(ungated * decay_matrix(g_cum, include_diagonal=True), gated, rtol=1e-12, atol=1e-12)


def test_refuses_what_it_cannot_compile():
    """The AOT specs (compiled by ``test_gdn_cutedsl_compile.py``) are the model's; other sizes are refused by name."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import ut_inverse as module

    assert [s.name for s in module.AOT_SPECS] == ["gdn_ut_inverse_bf16_l2", "gdn_ut_inverse_bf16",
                                                  "gdn_ut_inverse_gate_bf16_l2", "gdn_ut_inverse_gate_bf16",
                                                  "gdn_ut_inverse_prepare_bf16_l2", "gdn_ut_inverse_prepare_bf16"]
    assert module.shape_reasons(torch.bfloat16, 16, 48, 128) == []
    reasons = module.shape_reasons(torch.int8, 16, 40, 96)
    assert len(reasons) == 3 and "dtype" in reasons[0] and "multiple" in reasons[1] and "K = 96" in reasons[2]
    # K = 16: the rows' scales sum 32 channels a warp step and ldmatrix reads 32-wide tiles
    assert module.shape_reasons(torch.bfloat16, 2, 6, 16) == ["head dim K = 16 is not one of (32, 64, 128)"]
    with pytest.raises(ValueError, match="cannot compile this"):
        module.compile_ut_inverse(torch.bfloat16, 16, 40, 128, False, "sm_90a")


def test_the_preparing_form_checks_its_arguments_before_any_launch():
    """Refused by name (CPU tensors: no launch): no ``A`` kept without preparing, an ``A`` off
    16-byte alignment, half of the preparing form's tensors, preparing without the gate, q unlike
    k, a_round or factors of the wrong shape or dtype, q unaligned for the 16-byte copies, a tensor
    on another device."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.ut_inverse import launch_ut_inverse

    t, h, hv, d = 70, 2, 4, 64
    k = torch.zeros(t, h, d, dtype=torch.bfloat16)
    beta, g, g_cum = torch.zeros(t, hv, dtype=torch.bfloat16), torch.zeros(t, hv), torch.zeros(t, hv)
    ci, a = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(t, hv, 64)
    good = {"q": k.clone(), "a_round": torch.zeros(t, hv, 64, dtype=torch.bfloat16), "factors": torch.zeros(16, hv, 64)}

    def launch(a=a, gate=True, **prepared):
        launch_ut_inverse(k, beta, ci, a, g=g if gate else None, g_cum=g_cum if gate else None, **prepared)

    with pytest.raises(ValueError, match="a is None only with the preparing form"):
        launch(a=None)
    with pytest.raises(ValueError, match="16-byte aligned base"):  # A's rows leave by 16-byte stores
        launch(a=torch.zeros(t * hv * 64 + 1)[1:].view(t, hv, 64))
    with pytest.raises(ValueError, match="q, a_round and factors all or none"):
        launch(q=good["q"])
    with pytest.raises(ValueError, match="q, a_round and factors all or none, and only with g"):
        launch(gate=False, **good)
    unaligned = torch.zeros(t, h * d + 4, dtype=torch.bfloat16)[:, 4:].unflatten(1, (h, d))
    for bad, match in (({"q": good["q"].float()}, "q must be k's shape"),
                       ({"q": unaligned}, "q needs a 16-byte aligned base"),
                       ({"a_round": good["a_round"].float()}, "a_round must be contiguous"),
                       ({"a_round": good["a_round"][:-1]}, "a_round must be contiguous"),
                       ({"factors": good["factors"][:-1]}, "factors must be contiguous"),
                       ({"factors": good["factors"].to("meta")}, "factors must be on the inputs' device")):
        with pytest.raises(ValueError, match=match):
            launch(**(good | bad))


def test_three_ctas_fit_an_sm(tmp_path):
    """The model's inverse, ungated, gating and preparing (with A kept and not), with and without the L2 norm, as the DSL's own ptxas
    builds it for sm_90a (its cubin's resource usage, read by Triton's cuobjdump): at most 96
    registers a thread, so three CTAs of 192 threads share an SM (18 warps, at most 5 on a
    scheduler's 16,384 registers). The gating write loop unrolled by 8 took more, and the inverse was
    about 40 % slower at (16, 48) with the L2 norm on the H200."""
    import re
    import subprocess
    from pathlib import Path

    cutedsl_or_skip()
    import triton.backends.nvidia as nvidia
    from dsfuse.gdn.cutedsl import ut_inverse as module

    cuobjdump = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    for gate, prepare, keep_a in ((False, False, True), (True, False, True), (True, True, True), (True, True, False)):
        for l2 in (True, False):
            fn = module.compile_ut_inverse(torch.bfloat16, 16, 48, 128, l2, "sm_90a", gate=gate, prepare=prepare,
                                           keep_a=keep_a, keep_cubin=True, dump_dir=str(tmp_path))
            cubin = tmp_path / "kernel.cubin"
            cubin.write_bytes(fn.__cubin__)
            usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                                   check=True).stdout
            registers = int(re.search(r"REG:(\d+)", usage).group(1))
            assert registers <= 96 and "STACK:0 " in usage, (gate, prepare, keep_a, l2, usage)


def test_serves_the_forward_on_hopper():
    """Registered for the forward (its backward the Triton stages), first in ``auto``'s order on
    sm_90 and never ``auto``'s pick on sm_100; context parallelism's ``stages`` stay Triton's."""
    from dsfuse.gdn.api import BACKENDS

    assert BACKENDS.serving("forward") == ("triton", "cutedsl") and BACKENDS.serving("backward") == ("triton", "cutedsl")
    assert BACKENDS.serving("stages") == ("triton",)
    assert BACKENDS.preference["sm_90"] == ("cutedsl", "triton") and BACKENDS.preference["sm_100"] == ("triton",)
    from dsfuse.bench.env import kernel_files

    files = [p.as_posix() for p in kernel_files("gdn")]  # what a run's "kernel source changed" mark compares
    assert any("/gdn/triton/" in f for f in files) and any("/gdn/cutedsl/fused_fwd_head.py" in f for f in files)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("l2", [True, False])
# value heads per qk head: 3, 3, 6 (two passes of 3), 1, 5 (a pass of 3, then one of 2), 8 (4 a pass)
@pytest.mark.parametrize("dims", [(2, 6, 64), (16, 48, 128), (1, 6, 32), (4, 4, 128), (1, 5, 64),
                                  (2, 16, 128)])
def test_rows_match_the_float64_reference(dtype, l2, dims):
    """Documents of 1, 63, 64, 65 and 200 tokens (partial chunks, one-token chunks) and a tail of
    tokens in no chunk: every row of every chunk against the float64 ungated inverse (relative RMS
    per chunk and head <= 1e-5; fp32 blocked substitution), the tail left as poisoned, and a second
    launch bitwise equal."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.ut_inverse import launch_ut_inverse

    h, hv, d = dims
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = [1, 63, 64, 65, 200]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t = cu[-1] + 7  # 7 tokens in no chunk
    k_hd = torch.randn(t, h, 3 * d, device="cuda", generator=gen).to(dtype)[:, :, d:2 * d]  # a strided view
    if not l2:
        k_hd = (k_hd.float() * d**-0.5).to(dtype)
    beta = torch.rand(t, hv, device="cuda", generator=gen).to(dtype)
    ci = prepare_chunk_indices(cu).to(device="cuda", dtype=torch.int32).contiguous()
    a = torch.full((t, hv, 64), float("nan"), device="cuda")
    launch_ut_inverse(k_hd, beta, ci, a, use_qk_l2norm=l2)
    again = torch.full_like(a, float("nan"))
    launch_ut_inverse(k_hd, beta, ci, again, use_qk_l2norm=l2)
    torch.cuda.synchronize()
    assert torch.equal(a[:cu[-1]], again[:cu[-1]])
    assert a[cu[-1]:].isnan().all()  # tokens in no chunk: not written

    k64 = k_hd.to(F64).cpu()
    k64 = l2norm(k64) if l2 else k64
    ci_cpu, k_c, beta_c, _ = _chunked(k64, beta.to(F64).cpu(), torch.zeros(t, hv, dtype=F64), cu[:], hv // h)
    expected = ut_transform(k_c, beta_c, torch.zeros(beta_c.shape, dtype=F64))  # [NC, HV, C, C]
    got = a.double().cpu()
    for c, (_, start, end) in enumerate(ci_cpu.tolist()):
        rows = end - start
        for i_hv in range(hv):
            assert_rel_rms(got[start:end, i_hv], expected[c, i_hv, :rows], 1e-5, f"chunk {c}, value head {i_hv}")


def test_unaligned_keys_compile_for_their_own_reads():
    """k rows not 16-byte aligned take element-by-element reads: that variant compiles too (CPU)."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.ut_inverse import compile_ut_inverse, vector_reads

    compile_ut_inverse(torch.bfloat16, 2, 6, 64, True, "sm_90a", aligned=False)
    rows = torch.zeros(10, 2, 3 * 64, dtype=torch.bfloat16)
    assert vector_reads(rows[:, :, 64:128]) and not vector_reads(rows[:, :, 65:129])


@pytest.mark.gpu
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("dims", [(2, 6, 64), (16, 48, 128)])
def test_unaligned_keys_give_the_same_bits(l2, dims):
    """The same key values read by 16-byte copies (aligned rows) and element by element (rows one
    element off 16 bytes): bitwise equal rows of A."""
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl.ut_inverse import launch_ut_inverse, vector_reads

    h, hv, d = dims
    gen = torch.Generator(device="cuda").manual_seed(2)
    cu = [0, 1, 63, 64, 65, 200]
    t = cu[-1]
    values = torch.randn(t, h, d, device="cuda", generator=gen).bfloat16()
    k_aligned = torch.zeros(t, h, 3 * d, device="cuda", dtype=torch.bfloat16)[:, :, d:2 * d]
    k_off = torch.zeros(t, h, 3 * d, device="cuda", dtype=torch.bfloat16)[:, :, d + 1:2 * d + 1]
    k_aligned.copy_(values)
    k_off.copy_(values)
    assert vector_reads(k_aligned) and not vector_reads(k_off)
    beta = torch.rand(t, hv, device="cuda", generator=gen).bfloat16()
    ci = prepare_chunk_indices(cu).to(device="cuda", dtype=torch.int32).contiguous()
    a, b = (torch.full((t, hv, 64), float("nan"), device="cuda") for _ in range(2))
    launch_ut_inverse(k_aligned, beta, ci, a, use_qk_l2norm=l2)
    launch_ut_inverse(k_off, beta, ci, b, use_qk_l2norm=l2)
    torch.cuda.synchronize()
    assert not a.isnan().any() and torch.equal(a, b)
