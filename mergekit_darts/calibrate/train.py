"""The Adam loop that fits one surgery module to one (merged, target) pair of captured states.

Training is judged before anything is kept: the loss over every training token is measured with
the module as initialised (the identity: the uncorrected merge) and once more after the last
step, batch by batch without gradients. A run diverged when a loss or weight is not finite, or
when it ends more than ``DIVERGENCE_FACTOR`` times worse than it started
(:meth:`TrainResult.divergence`); the one-batch training curve is too noisy for that verdict.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.plain_fit import closed_form, fit_closed_form
from mergekit_darts.config.schema import default
from mergekit_darts.correction import losses
from mergekit_darts.correction.darts_correction import SurgeryModule
from mergekit_darts.correction.darts_correction import token_positions as positions_of
from mergekit_darts.correction.metrics import delta, rho_l1

# A run whose loss over its training tokens ends above this multiple of the uncorrected merge's
# has diverged. Measured on the tiny test models (every module and loss, 100 steps, 2 seeds): at
# lr 1e-4..1 the worst run ends at 1.0x (at 0.1-1 the ReLU units die and the module stays near
# the identity), at lr 1e2 at 3.9-3000x, at 1e6 at 5e4-1e8x, and at 1e12 the loss is inf or NaN.
DIVERGENCE_FACTOR = 2.0


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings; the defaults are the block's (paper section 4.3)."""

    loss: str = default("loss")
    steps: int = default("steps")
    lr: float = default("lr")
    batch_size: int = default("batch_size")
    seed: int = default("seed")

    def __post_init__(self) -> None:
        if self.loss not in losses.LOSSES:
            raise ValueError(
                f"unknown loss {self.loss!r}; choose one of {', '.join(losses.LOSSES)}"
            )
        if self.steps < 0 or self.lr <= 0 or self.batch_size <= 0:
            raise ValueError("steps must be >= 0, lr and batch_size > 0")


@dataclass
class TrainResult:
    """The trained module and how much of the bias it removed on the calibration set."""

    module: SurgeryModule
    loss_curve: list[float]
    rho_l1: float
    delta_before: torch.Tensor  # [N, T] per-token bias, zero at uncounted positions
    delta_after: torch.Tensor
    seconds: float = 0.0
    loss_start: float = float("nan")  # over every training token, module as initialised
    loss_end: float = float("nan")  # the same tokens after the last step
    extra: dict = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        return self.loss_curve[-1] if self.loss_curve else float("nan")

    def divergence(self) -> str | None:
        """Why this run diverged, in a few words, or None when it did not."""
        weights = all(bool(p.isfinite().all()) for p in self.module.parameters())
        losses_ = [*self.loss_curve, self.loss_start, self.loss_end, self.rho_l1]
        if not weights or not all(math.isfinite(x) for x in losses_):
            return "its loss or weights became NaN or inf"
        if self.loss_end > DIVERGENCE_FACTOR * max(self.loss_start, 1e-12):
            return (
                f"its loss over the training tokens ended at {self.loss_end:.3g}, "
                f"{self.loss_end / max(self.loss_start, 1e-12):.3g}x the {self.loss_start:.3g} "
                "it started from"
            )
        return None


def _batch_loss(
    module: SurgeryModule,
    merged: Captured,
    target: Captured,
    rows: torch.Tensor,
    loss_mask: torch.Tensor,
    loss: str,
) -> torch.Tensor:
    width = int(merged.mask[rows].sum(-1).max())  # right-padded: crop the batch to its longest row
    h = merged.hidden[rows, :width].to(torch.float32)
    h_star = target.hidden[rows, :width].to(torch.float32)
    mask = loss_mask[rows, :width]
    h_hat = module(h, positions_of(merged.mask[rows, :width]))
    if loss in losses.LOGIT_LOSSES:
        pred_logits = merged.head.logits(h_hat)
        target_logits = target.head.logits(h_star)
        return getattr(losses, loss)(pred_logits, target_logits, mask)
    entropy = None if target.entropy is None else target.entropy[rows, :width]
    return _loss_of(loss, h_hat, h_star, entropy, mask)


def _loss_of(
    loss: str,
    h_hat: torch.Tensor,
    h_star: torch.Tensor,
    entropy: torch.Tensor | None,
    mask: torch.Tensor,
) -> torch.Tensor:
    """A hidden-state loss (``l1``, ``ewl1``) of one batch."""
    if loss == "l1":
        return losses.l1(h_hat, h_star, mask)
    if loss == "ewl1":
        return losses.ewl1(h_hat, h_star, entropy, mask)
    raise ValueError(f"stacked training takes the hidden-state losses l1 and ewl1, not {loss!r}")


def adam(parameters: list[torch.nn.Parameter], settings: TrainSettings) -> torch.optim.Adam:
    """The optimizer of every training run: Adam(0.9, 0.999) at ``settings.lr``."""
    return torch.optim.Adam(parameters, lr=settings.lr, betas=(0.9, 0.999))


def optimizer_step(
    module: SurgeryModule,
    optimizer: torch.optim.Optimizer,
    merged: Captured,
    target: Captured,
    batch: torch.Tensor,
    counted: torch.Tensor,
    loss: str,
) -> torch.Tensor:
    """One step of :func:`train_surgery` on the sequences ``batch``: forward, ``loss`` over its
    ``counted`` tokens, backward, update. Returns the loss (before the update)."""
    value = _batch_loss(module, merged, target, batch, counted, loss)
    optimizer.zero_grad(set_to_none=True)
    value.backward()
    optimizer.step()
    return value


def epoch_batches(
    rows: torch.Tensor, batch_size: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless seeded shuffles of ``rows``, cut into batches (the last of an epoch may be short)."""
    while True:
        order = rows[torch.randperm(rows.numel(), generator=generator)]
        yield from order.split(batch_size)


def train_surgery(
    module: SurgeryModule,
    merged: Captured,
    target: Captured,
    settings: TrainSettings,
    *,
    loss_mask: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
    desc: str = "train",
) -> TrainResult:
    """Fit ``module`` so that ``module(h_merged)`` matches ``h_target`` on the counted tokens.

    ``loss_mask`` [N, T] chooses which real tokens the loss and rho_L1 cover (default: all).
    ``rows`` (sequence indices, default all) trains on a subset without copying the captures:
    the rest is held out, and the result's rho_L1 covers the training rows only. A module
    without parameters (kind ``none``) is measured, not trained: delta after = delta before.
    The plain kinds under ``l1`` / ``ewl1`` are fitted in closed form (``calibrate.plain_fit``;
    ``steps`` and ``lr`` unused), under ``kl`` / ``ce`` by Adam like the others.
    """
    _check_captures(merged, target, settings)
    rows, counted = _training_tokens(merged, loss_mask, rows)
    merged, target = _to(merged, device), _to(target, device)
    counted = counted.to(device)
    module = module.to(device=device, dtype=torch.float32).train()
    curve: list[float] = []
    loss_start = dataset_loss(module, merged, target, rows, counted, settings)
    start = time.perf_counter()
    if closed_form(module) and settings.loss not in losses.LOGIT_LOSSES:  # one solve, no steps
        fit_closed_form(module, merged, target, counted, settings.loss)
        seconds = time.perf_counter() - start
        result = _result(module, merged, target, settings, rows, counted, [], seconds, loss_start)
        result.loss_curve.append(result.loss_end)
        return result
    # A module without parameters (``none``: the merge as it is) has nothing to train: no
    # optimizer, and its curve is its one loss over the training tokens.
    trainable = [p for p in module.parameters() if p.requires_grad]
    steps = settings.steps if trainable else 0
    if not trainable:
        curve.append(loss_start)
    optimizer = adam(trainable, settings) if steps else None
    batches = epoch_batches(rows, settings.batch_size, torch.Generator().manual_seed(settings.seed))
    for _ in tqdm(range(steps), desc=desc, disable=not progress, leave=False):
        batch = next(batches).to(device)
        if not counted[batch].any():
            continue
        loss = optimizer_step(module, optimizer, merged, target, batch, counted, settings.loss)
        curve.append(loss.item())
    seconds = time.perf_counter() - start
    return _result(module, merged, target, settings, rows, counted, curve, seconds, loss_start)


def _check_captures(merged: Captured, target: Captured, settings: TrainSettings) -> None:
    """The two captures fit each other and ``settings.loss``."""
    if merged.hidden.shape != target.hidden.shape or not torch.equal(merged.mask, target.mask):
        raise ValueError(
            f"merged and target captures differ: {tuple(merged.hidden.shape)} vs "
            f"{tuple(target.hidden.shape)}; they must come from the same token sequences"
        )
    if settings.loss == "ewl1" and target.entropy is None:
        raise ValueError("the ewl1 loss needs the target's entropy: capture it with_entropy=True")
    if settings.loss in losses.LOGIT_LOSSES:
        if merged.head is None or target.head is None:
            raise ValueError(f"the {settings.loss} loss needs both output heads: with_head=True")
        for captured in (merged, target):
            captured.head.require(f"the {settings.loss} loss")


def _training_tokens(
    merged: Captured, loss_mask: torch.Tensor | None, rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``rows`` as a CPU index, default all; [N, T] bool: the tokens of those rows the loss
    counts), refusing a set that counts none."""
    n = merged.hidden.shape[0]
    rows = torch.arange(n) if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
    counted = merged.mask if loss_mask is None else loss_mask.to(torch.bool) & merged.mask
    counted = in_rows(counted, rows)
    if not counted.any():
        raise ValueError("no token is counted by the loss mask")
    return rows, counted


def _result(
    module: SurgeryModule,
    merged: Captured,
    target: Captured,
    settings: TrainSettings,
    rows: torch.Tensor,
    counted: torch.Tensor,
    curve: list[float],
    seconds: float,
    loss_start: float,
) -> TrainResult:
    """The trained ``module`` judged on its training tokens: final loss, bias, rho_L1."""
    module.eval()
    loss_end = dataset_loss(module, merged, target, rows, counted, settings)
    before, after, rho = measure_bias(module, merged, target, counted)
    return TrainResult(module, curve, rho, before, after, seconds, loss_start, loss_end)


def train_stacked(
    modules: list[SurgeryModule],
    merged: Captured,
    target: Captured,
    settings: TrainSettings,
    rows: list[torch.Tensor],
    *,
    loss_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
    desc: str = "train",
) -> list[TrainResult]:
    """:func:`train_surgery` of several modules of one kind and shape at once, module ``k`` on
    the sequences ``rows[k]`` (cross-fitting: one module per fold, each on the other folds).

    Every step stacks their parameters and runs them together (``torch.func.vmap`` over the
    module's own forward): one gather of the cached states, one batched forward and backward.
    Module ``k`` sees the batches its own :func:`train_surgery` run would see (its rows, shuffled
    by ``settings.seed``) and has its own Adam, which skips the steps whose batch counts no token
    of it, so the results equal one-by-one training up to float rounding. Modules without
    parameters, the closed-form plain kinds, and the logit losses (which run the LM heads), go
    to :func:`train_surgery`.
    """
    trainable = any(p.requires_grad for p in modules[0].parameters()) if modules else False
    if not trainable or settings.loss in losses.LOGIT_LOSSES or closed_form(modules[0]):
        return [
            train_surgery(
                m,
                merged,
                target,
                settings,
                loss_mask=loss_mask,
                rows=r,
                device=device,
                progress=progress,
                desc=desc,
            )
            for m, r in zip(modules, rows, strict=True)
        ]
    _check_captures(merged, target, settings)
    rows, own = zip(*(_training_tokens(merged, loss_mask, r) for r in rows), strict=True)
    counted = merged.mask if loss_mask is None else loss_mask.to(torch.bool) & merged.mask
    merged, target = _to(merged, device), _to(target, device)
    counted, own = counted.to(device), [c.to(device) for c in own]
    modules = [m.to(device=device, dtype=torch.float32).train() for m in modules]
    starts = [
        dataset_loss(m, merged, target, r, c, settings)
        for m, r, c in zip(modules, rows, own, strict=True)
    ]
    names = [name for name, _ in modules[0].named_parameters()]
    shape = copy.deepcopy(modules[0]).to("meta")

    def forward(params: dict, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(shape, params, (h, positions))

    stacked = torch.vmap(forward)
    optimizers = [adam(list(m.parameters()), settings) for m in modules]
    streams = [
        epoch_batches(r, settings.batch_size, torch.Generator().manual_seed(settings.seed))
        for r in rows
    ]
    curves: list[list[float]] = [[] for _ in modules]
    start = time.perf_counter()
    for _ in tqdm(range(settings.steps), desc=desc, disable=not progress, leave=False):
        batches = [next(stream) for stream in streams]
        losses_k = _stacked_losses(
            stacked, modules, names, batches, merged, target, counted, settings
        )
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        if losses_k:
            sum(losses_k.values()).backward()
        for k, loss in losses_k.items():
            curves[k].append(loss.item())
            optimizers[k].step()
    seconds = (time.perf_counter() - start) / len(modules)
    return [
        _result(module, merged, target, settings, r, c, curve, seconds, loss_start)
        for module, r, c, loss_start, curve in zip(modules, rows, own, starts, curves, strict=True)
    ]


def _stacked_losses(
    stacked: Callable[..., torch.Tensor],
    modules: list[SurgeryModule],
    names: list[str],
    batches: list[torch.Tensor],
    merged: Captured,
    target: Captured,
    counted: torch.Tensor,
    settings: TrainSettings,
) -> dict[int, torch.Tensor]:
    """One stacked forward of every module on its own batch: the loss of each module whose
    batch counts a token (the others skip the step, as their own training would)."""
    device = merged.hidden.device
    index = torch.stack([_padded(b, settings.batch_size) for b in batches]).to(device)
    real = torch.stack([_padded_mask(b, settings.batch_size) for b in batches]).to(device)
    width = int(merged.mask[index].sum(-1).max())
    h = merged.hidden[index, :width].to(torch.float32)  # [K, B, T, H]
    h_star = target.hidden[index, :width].to(torch.float32)
    mask = counted[index, :width] & real.unsqueeze(-1)
    flat = merged.mask[index, :width].flatten(0, 1)
    positions = positions_of(flat).view(len(modules), -1, width)
    params = {n: torch.stack([m.get_parameter(n) for m in modules]) for n in names}
    h_hat = stacked(params, h, positions)
    found = {}
    for k in (k for k in range(len(modules)) if mask[k].any()):
        entropy = None if target.entropy is None else target.entropy[index[k], :width]
        found[k] = _loss_of(settings.loss, h_hat[k], h_star[k], entropy, mask[k])
    return found


def _padded(batch: torch.Tensor, size: int) -> torch.Tensor:
    """``batch`` filled up to ``size`` rows with its first row (masked out by :func:`_padded_mask`)."""
    return torch.cat([batch, batch[:1].expand(size - batch.numel())])


def _padded_mask(batch: torch.Tensor, size: int) -> torch.Tensor:
    return torch.arange(size) < batch.numel()


@torch.no_grad()
def dataset_loss(
    module: SurgeryModule,
    merged: Captured,
    target: Captured,
    rows: torch.Tensor,
    counted: torch.Tensor,
    settings: TrainSettings,
) -> float:
    """The training loss over every counted token of ``rows``: batches in order, token-weighted."""
    total, tokens = 0.0, 0
    for batch in rows.to(counted.device).split(settings.batch_size):
        n = int(counted[batch].sum())
        if n:
            loss = _batch_loss(module, merged, target, batch, counted, settings.loss)
            total, tokens = total + float(loss) * n, tokens + n
    return total / tokens


@torch.no_grad()
def measure_bias(
    module: SurgeryModule, merged: Captured, target: Captured, counted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-token bias before / after the module, and rho_L1, over the counted tokens."""
    h = merged.hidden.to(torch.float32)
    h_star = target.hidden.to(torch.float32)
    h_hat = module(h, positions_of(merged.mask))
    keep = counted.to(torch.float32)
    before = delta(h, h_star) * keep
    after = delta(h_hat, h_star) * keep
    return before.cpu(), after.cpu(), rho_l1(h, h_hat, h_star, counted)


def in_rows(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[N, T] bool: the tokens of ``mask`` [N, T] that lie in the sequences ``rows``."""
    keep = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    keep[rows.to(mask.device)] = True
    return mask.to(torch.bool) & keep.unsqueeze(-1)


def _to(captured: Captured, device: torch.device | str) -> Captured:
    return Captured(
        **{
            f.name: None if (t := getattr(captured, f.name)) is None else t.to(device)
            for f in dataclasses.fields(captured)
        }
    )
