"""Whole-tower validation and timing of the fused vision RoPE backward.

Runs after the operator experiment of ``python -m dsfuse.bench run vision_rope`` on a
GPU (when the config has a ``tower`` section), or alone::

    python -m dsfuse.bench.vision_tower --run-dir experiments/vision_rope/raw/<run-id>

(relative paths: to the working directory when they exist there, else to the repository root).

The 32-layer vision tower and aligner (dsfuse.models.vision_tower) with synthetic
weights of the real shapes, written to and read back from a safetensors file. For
each configured image geometry and input bank it runs forward + checkpointed
backward twice, with the model's rotary front end and with dsfuse's, and compares
the output, the 32 hidden states, the input gradient and the 263 parameter
gradients bit for bit; a profiler pass counts the fused backward kernel per run.
Then it times both variants in paired blocks (CUDA events around forward and
backward). Writes tower_validation.csv, tower_profile.csv, tower_samples.csv.
"""

import argparse
import csv
import tempfile
import time
from pathlib import Path

import torch
import yaml
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from dsfuse.bench.harness import bits
from dsfuse.bench.paths import cli_path, repo_path
from dsfuse.models.vision_geometry import ProcessorConfig, patch_grid
from dsfuse.models.vision_tower import (
    PARAM_NAMES,
    TowerConfig,
    VisionTower,
    load_weights,
    save_weights,
    synthetic_weights,
)


def step(model, patches, n_h, n_w, rope, grad_out):
    x = patches.clone().requires_grad_()
    out, hidden = model(x, n_h, n_w, rope=rope)
    grads = torch.autograd.grad(out, [x, *model.params], grad_out)
    return [out.detach(), *[h.detach() for h in hidden], *grads]


def run_tower(config: dict, run_dir: Path) -> None:
    """Validate and time the tower for ``config["tower"]``; write the three CSVs into ``run_dir``."""
    model_cfg = yaml.safe_load(repo_path(config["model_config"]).read_text())
    tower = config["tower"]
    proc = ProcessorConfig(**model_cfg["processor"])
    cfg = TowerConfig(layers=model_cfg["layers"], hidden=model_cfg["hidden"], heads=model_cfg["heads"],
                      mlp=model_cfg["mlp"], theta=model_cfg["theta"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vision.safetensors"
        save_weights(synthetic_weights(cfg, seed=0, device="cuda"), path)
        model = VisionTower(load_weights(path, cfg, device="cuda"), cfg)
    names = ["output"] + [f"hidden.{i}" for i in range(cfg.layers)] + ["grad.input"] + [f"grad.{n}" for n in PARAM_NAMES]
    validation, profiles, samples = [], [], []
    grids = [patch_grid(h, w, proc) for h, w in tower["geometries"]]
    for n_h, n_w in tqdm(grids, desc="tower geometries"):
        geometry = f"{n_h}x{n_w}"
        for bank in range(tower["banks"]):
            gen = torch.Generator(device="cuda").manual_seed(1000 * bank + n_h * n_w)
            patches = torch.randn(n_h * n_w, 588, generator=gen, device="cuda").bfloat16()
            rows = -(-n_h // 3) * -(-n_w // 3)
            grad_out = torch.randn(rows, cfg.llm_hidden, generator=gen, device="cuda").bfloat16()
            results = {}
            for rope in ("eager", "dsfuse"):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    results[rope] = step(model, patches, n_h, n_w, rope, grad_out)
                    torch.cuda.synchronize()
                counts = {e.key: e.count for e in prof.key_averages() if "_vision_rope_" in e.key}
                profiles.append(dict(geometry=geometry, bank=bank, rope=rope,
                                     fused_bwd_calls=counts.get("_vision_rope_bwd_kernel", 0),
                                     fused_fwd_calls=counts.get("_vision_rope_fwd_kernel", 0)))
            for name, a, b in zip(names, results["eager"], results["dsfuse"]):
                same = bool(torch.equal(bits(a), bits(b)))
                diff = 0.0 if same else float((a.float() - b.float()).abs().max())
                validation.append(dict(geometry=geometry, bank=bank, tensor=name, bitwise_equal=same,
                                       max_abs_diff=diff, numel=a.numel()))
            del results
        # paired timing blocks: eager and dsfuse alternate, order rotated per block
        gen = torch.Generator(device="cuda").manual_seed(7)
        patches = torch.randn(n_h * n_w, 588, generator=gen, device="cuda").bfloat16()
        grad_out = torch.randn(-(-n_h // 3) * -(-n_w // 3), cfg.llm_hidden, generator=gen, device="cuda").bfloat16()
        for rope in ("eager", "dsfuse"):
            step(model, patches, n_h, n_w, rope, grad_out)  # warm-up
        for block in range(tower["timing"]["blocks"]):
            order = ("eager", "dsfuse") if block % 2 == 0 else ("dsfuse", "eager")
            for rope in order:
                for sample in range(tower["timing"]["samples"]):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    start.record()
                    step(model, patches, n_h, n_w, rope, grad_out)
                    end.record()
                    torch.cuda.synchronize()
                    samples.append(dict(geometry=geometry, tokens=n_h * n_w, provider=rope, block=block, sample=sample,
                                        gpu_ms=round(start.elapsed_time(end), 4),
                                        wall_ms=round((time.perf_counter() - t0) * 1e3, 4)))
    for name, rows in (("tower_validation", validation), ("tower_profile", profiles), ("tower_samples", samples)):
        with (Path(run_dir) / f"{name}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    bad = [r for r in validation if not r["bitwise_equal"]]
    print(f"tower: {len(validation)} tensor comparisons, {len(bad)} not bitwise equal; "
          f"fused backward calls per dsfuse run: {sorted({p['fused_bwd_calls'] for p in profiles if p['rope'] == 'dsfuse'})}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="experiments/vision_rope/configs/h200.yaml",
                        help="config YAML (relative: to the working directory if it exists there, else to the repo)")
    parser.add_argument("--run-dir", required=True, type=Path, help="the operator run's folder (same rule as --config)")
    args = parser.parse_args()
    run_tower(yaml.safe_load(cli_path(args.config).read_text()), cli_path(args.run_dir))


if __name__ == "__main__":
    main()
