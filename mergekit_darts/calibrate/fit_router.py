"""The gate of ``route:``: which task's correction a token needs, read from its own hidden state.

After the task modules are trained, the gate ``g(h) = softmax(W h + b)`` (:class:`Router`) is
fitted on the merged model's final hidden states the run has already captured (no model is
loaded for it): every counted position of a routed task's calibration prompts is a row labelled
with that task, and every real token of the ``background`` prompts (text that should get no
correction) a row labelled "none", the gate's last class.

The fit is a multinomial logistic regression, float32, full batch:

- prompts are split per class with :func:`~mergekit_darts.calibrate.selection.holdout_split`
  (``route.holdout``, the block's ``seed``); the gate is fitted on the prompts not held out and
  measured on the held-out ones, and that measured gate is the one saved;
- every class weighs the same whatever its token count (row weight ``1 / (K' n_k)``);
- features are standardised (class-balanced mean and standard deviation), so ``l2`` (a penalty
  ``l2 / 2 * ||V||^2`` on the standardised weights, the bias unpenalised) means the same on every
  model; the standardisation is folded back into ``W, b`` afterwards, so the stored gate is
  exactly ``softmax(W h + b)`` on the raw hidden state;
- L-BFGS (strong Wolfe line search) from zero for at most ``route.steps`` iterations: no random
  initialisation, so the seed enters only through the split, and equal inputs give equal bytes.

At H = 4096 and 50 prompts x 512 tokens per class this takes seconds (docs/surgery-block.md).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.selection import holdout_split
from mergekit_darts.calibrate.train import in_rows
from mergekit_darts.correction.darts_correction import NONE_CLASS, Router
from mergekit_darts.errors import SurgeryRunError

FITTED_ON = "prompts not held out"  # the manifest's word on which prompts the saved gate saw
CHUNK = 4096  # rows per step of the standardisation


@dataclass(frozen=True)
class RouteClass:
    """One class of the gate: a routed task (or the background) and its captured prompts."""

    name: str
    merged: Captured  # the merged model's states on the class's sequences
    counted: torch.Tensor  # [N, T] bool: the positions that are rows (a task's loss positions)
    sha256: Sequence[str]  # of each prompt, in order


@dataclass(frozen=True)
class FittedRouter:
    """The gate as saved, and its manifest ``router`` entry."""

    router: Router
    entry: dict[str, Any]


def fit_router(
    classes: Sequence[RouteClass],
    *,
    background: bool,
    holdout: float,
    l2: float,
    steps: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> FittedRouter:
    """Fit the gate over ``classes`` (the routed tasks in gate order, then the background when
    ``background``) on their prompts not held out; measure it on the held-out ones."""
    started = time.perf_counter()
    names = [c.name for c in classes]
    tasks = names[:-1] if background else names
    hidden_size = classes[0].merged.hidden.shape[-1]
    splits = [holdout_split(c.counted.shape[0], holdout, seed) for c in classes]
    masks = [in_rows(c.counted, train) for c, (train, _) in zip(classes, splits, strict=True)]
    counts = [int(mask.sum()) for mask in masks]
    for c, count in zip(classes, counts, strict=True):
        if count == 0:
            raise SurgeryRunError(
                f"surgery route: class {c.name!r} has no counted token on its prompts not held "
                "out, so the router has nothing to learn it from; give it more prompts"
            )
    # one [N, H] float32 tensor, filled class by class (no second copy from a concatenation)
    x = torch.empty(sum(counts), hidden_size, device=device, dtype=torch.float32)
    start = 0
    for c, mask, count in zip(classes, masks, counts, strict=True):
        x[start : start + count] = c.merged.hidden[mask.to(c.merged.hidden.device)].to(device)
        start += count
    weight, bias, fit = _logistic_regression(x, counts, l2=l2, steps=steps)
    del x
    router = Router(hidden_size, tasks, background)
    with torch.no_grad():
        router.weight.copy_(weight.cpu())
        router.bias.copy_(bias.cpu())
    router.eval()
    held = held_out_accuracy(router, classes, [held for _, held in splits])
    held["prompt_sha256"] = {
        c.name: [c.sha256[i] for i in held_rows.tolist()]
        for c, (_, held_rows) in zip(classes, splits, strict=True)
    }
    entry = {
        "tasks": tasks,
        "background": background,
        "held_out": held,
        "fitted_on": FITTED_ON,
        "fit": {
            "holdout": holdout,
            "l2": l2,
            "steps": steps,
            "seed": seed,
            **fit,
            "tokens": {c.name: n for c, n in zip(classes, counts, strict=True)},
            "prompts": {
                c.name: int(train.numel()) for c, (train, _) in zip(classes, splits, strict=True)
            },
        },
        "timings": {"fit_s": round(time.perf_counter() - started, 3)},
    }
    return FittedRouter(router, entry)


def _logistic_regression(
    x: torch.Tensor, counts: Sequence[int], *, l2: float, steps: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``W`` [K', H], ``b`` [K'] of a class-balanced, L2-regularised multinomial logistic
    regression of the rows ``x`` [N, H] (``counts[k]`` rows of class k, in class order),
    standardisation folded in. ``x`` is standardised in place."""
    k = len(counts)
    labels = torch.cat([torch.full((n,), i, device=x.device) for i, n in enumerate(counts)])
    weights = torch.cat([torch.full((n,), 1.0 / (k * n), device=x.device) for n in counts])
    mean = weights @ x  # class-balanced: each class's mean weighs 1 / K'
    x -= mean
    scale = torch.zeros_like(mean)
    for start in range(0, x.shape[0], CHUNK):  # no second [N, H] temporary
        part = slice(start, start + CHUNK)
        scale += weights[part] @ x[part].square()
    scale = scale.sqrt()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant features stay 0
    x /= scale
    v = torch.zeros(k, x.shape[1], device=x.device, requires_grad=True)
    c = torch.zeros(k, device=x.device, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [v, c],
        lr=1.0,
        max_iter=steps,
        history_size=10,
        tolerance_grad=1e-6,
        tolerance_change=1e-9,
        line_search_fn="strong_wolfe",
    )

    def objective() -> torch.Tensor:
        logits = torch.addmm(c, x, v.T)
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none") @ weights
        return loss + 0.5 * l2 * (v * v).sum()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        loss = float(objective())
        weight = v / scale
        bias = c - weight @ mean
    if not (bool(weight.isfinite().all()) and bool(bias.isfinite().all())):
        raise SurgeryRunError(
            "surgery route: the router's fit gave values that are not finite; raise route.l2"
        )
    iterations = int(optimizer.state[v].get("n_iter", 0))
    return weight.detach(), bias.detach(), {"iterations": iterations, "loss": loss}


@torch.no_grad()
def held_out_accuracy(
    router: Router, classes: Sequence[RouteClass], held: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """How often ``router`` picks each held-out token's class, and each held-out prompt's
    (argmax of the mean gate over the prompt's counted tokens); confusion in tokens (rows: true
    class, columns: predicted, in gate order). Prompts without a counted token are skipped."""
    k = len(classes)
    confusion = torch.zeros(k, k, dtype=torch.int64)
    right_prompts = torch.zeros(k, dtype=torch.int64)
    prompts = torch.zeros(k, dtype=torch.int64)
    for label, (c, held_rows) in enumerate(zip(classes, held, strict=True)):
        device = c.merged.hidden.device
        gate_of = router if router.weight.device == device else copy.deepcopy(router).to(device)
        for row in held_rows.tolist():
            keep = c.counted[row].to(device)
            if not keep.any():
                continue
            gate = gate_of(c.merged.hidden[row][keep])  # [P, K']
            confusion[label] += torch.bincount(gate.argmax(-1).cpu(), minlength=k)
            right_prompts[label] += int(int(gate.mean(0).argmax()) == label)
            prompts[label] += 1
    tokens = confusion.sum(1)
    right = confusion.diagonal()

    def share(part: int, whole: int) -> float | None:
        return part / whole if whole else None

    return {
        "classes": list(router.classes),
        "token_accuracy": share(int(right.sum()), int(tokens.sum())),
        "sequence_accuracy": share(int(right_prompts.sum()), int(prompts.sum())),
        "tokens": int(tokens.sum()),
        "prompts": int(prompts.sum()),
        "per_task": {
            c.name: {
                "token_accuracy": share(int(right[i]), int(tokens[i])),
                "sequence_accuracy": share(int(right_prompts[i]), int(prompts[i])),
                "tokens": int(tokens[i]),
                "prompts": int(prompts[i]),
            }
            for i, c in enumerate(classes)
        },
        "confusion": confusion.tolist(),
    }


def route_classes(
    tasks: Sequence[tuple[str, Captured, torch.Tensor, Sequence[str]]],
    background: tuple[Captured, Sequence[str]] | None,
) -> list[RouteClass]:
    """The gate's classes: each routed task (name, merged capture, counted positions, prompt
    hashes) in gate order, then the background's every real token as "none"."""
    classes = [RouteClass(name, merged, counted.cpu(), sha) for name, merged, counted, sha in tasks]
    if background is not None:
        merged, sha = background
        classes.append(RouteClass(NONE_CLASS, merged, merged.mask.cpu(), sha))
    return classes
