"""Is a family in the paper's regime? The share of each fine-tuning gain a merge keeps.

The paper merges fine-tunes of a weak base and task arithmetic keeps roughly 0.7-1.0 of each
expert's gain over the base; surgery then works at the margin of what is lost. The measure is
(merge - base) / (expert - base) on each expert's own domain (raw retention merge / expert
is not: a strong base passes it while the merge loses all fine-tuning added). This module
computes it for the demo's results and, as `python -m demo.regime`, for a
candidate recipe (the recipe table in docs/demo.md), with a plain task-arithmetic merge
(base + 0.5 * sum of task vectors, mergekit's `task_arithmetic` at weight 0.5) and no surgery.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from demo.domains import DOMAIN_NAMES

MIN_GAIN = 1e-9  # points: an expert no better than the base has no gain to keep


def gains_kept(
    base: Mapping[str, float],
    experts: Mapping[str, Mapping[str, float]],
    merged: Mapping[str, float],
) -> dict[str, float | None]:
    """(merge - base) / (expert - base) on each expert's own domain (None: no gain to keep)."""
    kept: dict[str, float | None] = {}
    for domain, scores in experts.items():
        gain = scores[domain] - base[domain]
        kept[domain] = (merged[domain] - base[domain]) / gain if gain > MIN_GAIN else None
    return kept


def task_vector_norms(base: Path, experts: Mapping[str, Path]) -> dict[str, float]:
    """||expert - base|| / ||base|| over all weights, per expert (how far fine-tuning moved)."""
    from safetensors.torch import load_file

    theta = load_file(str(base / "model.safetensors"))
    base_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in theta.values()))
    norms = {}
    for domain, folder in experts.items():
        other = load_file(str(folder / "model.safetensors"))
        sq = sum(float((other[k].double() - t.double()).pow(2).sum()) for k, t in theta.items())
        norms[domain] = math.sqrt(sq) / base_norm
    return norms


def _task_arithmetic(base: Path, experts: Mapping[str, Path], out: Path, weight: float) -> Path:
    """base + weight * sum of task vectors, saved as an HF folder next to the family."""
    from safetensors.torch import load_file, save_file

    theta = load_file(str(base / "model.safetensors"))
    merged = {k: t.clone() for k, t in theta.items()}
    for folder in experts.values():
        for k, t in load_file(str(folder / "model.safetensors")).items():
            merged[k] += weight * (t - theta[k])
    out.mkdir(parents=True, exist_ok=True)
    for name in base.iterdir():
        if name.name != "model.safetensors" and name.is_file():
            (out / name.name).write_bytes(name.read_bytes())
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def measure(out: Path, seed: int, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Build the family of the full recipe with `overrides`; report the regime's properties."""
    from demo.evaluation import DemoSettings, evaluate
    from demo.family import SCALES, build_family

    recipe = replace(SCALES["full"], **overrides)
    family = build_family(out / "family", seed, "full", recipe=recipe)
    settings = DemoSettings(out=out)
    key = family.stamp.read_text()

    def score(path: Path) -> dict[str, float]:
        return evaluate(settings, family, "hf", f"pretrained={path},dtype=float32", key).scores

    merged = _task_arithmetic(family.base, family.experts, out / "ta_merge", 0.5)
    base = score(family.base)
    experts = {d: score(p) for d, p in family.experts.items()}
    ta = score(merged)
    stamp = json.loads(key)
    return {
        "seed": seed,
        "recipe": asdict(recipe),
        "build_seconds": stamp["build_seconds"],
        "final_loss": stamp["final_loss"],
        "base": base,
        "experts_own": {d: experts[d][d] for d in DOMAIN_NAMES},
        "experts": experts,
        "task_arithmetic": ta,
        "gains_kept": gains_kept(base, experts, ta),
        "task_vector_norm": task_vector_norms(family.base, family.experts),
    }


def main() -> None:
    """`python -m demo.regime OUT SEED '{"expert_lr": 3e-4}'` -> OUT/regime.json."""
    import sys

    from demo.pinning import apply_in_process, reexec_if_unpinned

    reexec_if_unpinned("demo.regime", sys.argv[1:])
    apply_in_process()
    out, seed = Path(sys.argv[1]), int(sys.argv[2])
    overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    if "task_mix" in overrides:
        overrides["task_mix"] = tuple(overrides["task_mix"])
    report = measure(out, seed, overrides)
    (out / "regime.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
