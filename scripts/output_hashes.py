"""Fingerprints (SHA-256 of the bytes) of every op's outputs and gradients at the DeepSeek-V4.1 shapes.

    python scripts/output_hashes.py --write tests/golden/h200_output_fingerprints.json   # record
    python scripts/output_hashes.py --check tests/golden/h200_output_fingerprints.json   # compare, exit 1 on a change

Inputs are drawn on the CPU from fixed seeds (so they are the same bits on any machine) and
moved to the GPU; only the public API is called, through each of its paths (functional,
``out=``, in place, autograd, plan). A refactor that keeps every fingerprint keeps every bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def fingerprint(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:32]


def _randn(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def text_rope_outputs(device) -> dict[str, torch.Tensor]:
    from dsfuse.text_rope import apply_rope, rope_angles, yarn_inv_freq

    gen = torch.Generator().manual_seed(1)
    inv_freq = yarn_inv_freq(64, 160000.0, factor=16.0, original_max_position=65536)
    pos = torch.randint(0, 1_000_000, (1, 4096), generator=gen)
    angles = rope_angles(pos, inv_freq).to(device)
    q = _randn(gen, (1, 4096, 64, 512), torch.bfloat16, device)
    kv = _randn(gen, (1, 4096, 512), torch.bfloat16, device)
    dq = _randn(gen, q.shape, torch.bfloat16, device)
    out = {"q_fwd": apply_rope(q, angles), "q_inverse": apply_rope(q, angles, inverse=True),
           "kv_fwd": apply_rope(kv, angles)}
    buf = torch.empty_like(q)
    out["q_out"] = apply_rope(q, angles, out=buf).clone()
    out["q_inplace"] = apply_rope(q.clone(), angles, inplace=True)
    leaf = q.clone().requires_grad_()
    apply_rope(leaf, angles).backward(dq)
    out["q_grad"] = leaf.grad
    leaf = q.clone().requires_grad_()
    apply_rope(leaf * 1, angles, inplace=True).backward(dq)  # in place on a non-leaf
    out["q_inplace_grad"] = leaf.grad
    return out


def vision_rope_outputs(device) -> dict[str, torch.Tensor]:
    from dsfuse.vision_rope import vision_cos_sin, vision_rope_attention_front, vision_rope_backward

    gen = torch.Generator().manual_seed(2)
    heads, dim, tokens = 16, 64, 8649
    cos, sin = vision_cos_sin(93, 93, dim // 2, 10000.0, device=device)
    dq = _randn(gen, (heads, tokens, dim), torch.bfloat16, device)
    dk_hdt = _randn(gen, (heads, dim, tokens), torch.bfloat16, device)
    dv = _randn(gen, (heads, tokens, dim), torch.bfloat16, device)
    out = {"dqkv": vision_rope_backward(dq, dk_hdt, dv, cos, sin)}
    buf = torch.empty_like(out["dqkv"])
    out["dqkv_out"] = vision_rope_backward(dq, dk_hdt, dv, cos, sin, out=buf).clone()
    qkv = _randn(gen, (tokens, 3 * heads * dim), torch.bfloat16, device).requires_grad_()
    q, k, v = vision_rope_attention_front(qkv, cos, sin, heads)
    out.update(front_q=q, front_k=k)
    (q * dq + k * dk_hdt.transpose(1, 2) + v * dv).float().sum().backward()
    out["front_qkv_grad"] = qkv.grad
    return out


def engram_gate_outputs(device) -> dict[str, torch.Tensor]:
    from dsfuse.engram_gate import EngramGatePlan, engram_gate, engram_gate_backward, engram_gate_forward

    gen = torch.Generator().manual_seed(3)
    n, streams, dim, eps = 4096, 4, 5120, 1e-20
    x = _randn(gen, (n, streams, dim), torch.bfloat16, device)
    kv = _randn(gen, (n, (streams + 1) * dim), torch.bfloat16, device)
    weight = (torch.rand((streams, dim), generator=gen) * 2).to(device)
    mask = (torch.rand(n, generator=gen) > 0.1).to(device)
    dout = _randn(gen, x.shape, torch.bfloat16, device)
    o, saved = engram_gate_forward(x, kv, weight, mask, eps=eps)
    dx, dkv, dw = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=eps)
    out = {"fwd_out": o, "fwd_saved": saved, "bwd_dx": dx, "bwd_dkv": dkv, "bwd_dweight": dw}
    plan = EngramGatePlan(streams=streams, dim=dim, max_tokens=n, device=device, eps=eps)
    po, ps = plan.forward(x, kv, weight, mask, torch.empty_like(x), torch.empty(n, streams, 4, device=device))
    pg = plan.backward(dout, x, kv, weight, mask, ps, torch.empty_like(x), torch.empty_like(kv),
                       torch.empty(streams, dim, device=device))
    out.update(plan_out=po, plan_saved=ps, plan_dx=pg[0], plan_dkv=pg[1], plan_dweight=pg[2])
    leaves = [t.clone().requires_grad_() for t in (x, kv, weight)]
    engram_gate(*leaves, mask, eps=eps).backward(dout)
    out.update(autograd_out=engram_gate(x, kv, weight, mask, eps=eps), autograd_dx=leaves[0].grad,
               autograd_dkv=leaves[1].grad, autograd_dweight=leaves[2].grad)
    return out


OPS: dict[str, Callable] = {"text_rope": text_rope_outputs, "vision_rope": vision_rope_outputs,
                            "engram_gate": engram_gate_outputs}


def all_fingerprints(device="cuda") -> dict[str, dict[str, str]]:
    result = {}
    for op, fn in OPS.items():
        outputs = fn(torch.device(device))
        result[op] = {name: f"{fingerprint(t)} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
                      for name, t in outputs.items()}
    return result


def compare(recorded: dict, now: dict) -> list[str]:
    """Differences as lines ``op/output: recorded -> now``; empty when every fingerprint matches."""
    lines = []
    for op, outs in recorded.items():
        for name, value in outs.items():
            got = now.get(op, {}).get(name)
            if got != value:
                lines.append(f"{op}/{name}: {value} -> {got}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="record the fingerprints here (JSON)")
    group.add_argument("--check", type=Path, help="compare with the fingerprints recorded here")
    args = parser.parse_args(argv)
    now = all_fingerprints()
    gpu = torch.cuda.get_device_name()
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "outputs": now}, indent=1) + "\n")
        print(f"wrote {args.write}")
        return 0
    recorded = json.loads(args.check.read_text())
    if recorded["gpu"] != gpu:  # other GPUs may round differently where the contract is a tolerance
        print(f"fingerprints recorded on {recorded['gpu']}, this is {gpu}: not compared")
        return 0
    diff = compare(recorded["outputs"], now)
    print("\n".join(diff) or f"all {sum(map(len, now.values()))} fingerprints equal ({gpu})")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
