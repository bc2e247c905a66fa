"""The plain kinds' closed-form fits against a float64 reference written here: a weighted ridge
regression towards the identity, solved as an augmented least-squares problem."""

from __future__ import annotations

import pytest
import torch

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.plain_fit import RIDGE
from mergekit_darts.calibrate.train import TrainSettings, train_surgery
from mergekit_darts.correction.modules import build_module

N, T, H = 6, 9, 5


def captures(seed: int = 0) -> tuple[Captured, Captured]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 7, 9, 2, 6])
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    h = torch.randn(N, T, H, generator=g)
    mix = torch.eye(H) + 0.3 * torch.randn(H, H, generator=g)
    h_star = h @ mix.T + 0.05 * torch.randn(N, T, H, generator=g)
    entropy = torch.rand(N, T, generator=g) + 0.1
    merged = Captured(hidden=h * mask.unsqueeze(-1), mask=mask)
    target = Captured(hidden=h_star * mask.unsqueeze(-1), mask=mask, entropy=entropy)
    return merged, target


def reference_weights(target: Captured, loss: str) -> torch.Tensor:
    mask = target.mask
    if loss == "l1":
        return torch.ones(int(mask.sum()), dtype=torch.float64)
    e = target.entropy[mask].double()
    return e / e.mean()


@pytest.mark.parametrize("loss", ["l1", "ewl1"])
def test_head_is_the_weighted_ridge_towards_the_identity(loss: str) -> None:
    merged, target = captures()
    module = build_module("head", H, 2, 4)
    train_surgery(module, merged, target, TrainSettings(loss=loss), progress=False)
    mask = merged.mask
    x, y = merged.hidden[mask].double(), target.hidden[mask].double()
    root = reference_weights(target, loss).sqrt().unsqueeze(-1)
    lam = RIDGE * float(((root * x) ** 2).sum(0).mean())
    # min_A sum w ||y - A x||^2 + lam ||A - I||^2, row by row: [sqrt(w) x; sqrt(lam) I] a = [sqrt(w) y; sqrt(lam) I]
    design = torch.cat([root * x, lam**0.5 * torch.eye(H, dtype=torch.float64)])
    wanted = torch.cat([root * y, lam**0.5 * torch.eye(H, dtype=torch.float64)])
    a = torch.linalg.lstsq(design, wanted).solution.T
    expected_m = torch.eye(H, dtype=torch.float64) - a
    assert (module.weight.double() - expected_m).abs().max() < 1e-5


@pytest.mark.parametrize("loss", ["l1", "ewl1"])
def test_norm_is_the_weighted_ridge_per_channel(loss: str) -> None:
    merged, target = captures(1)
    module = build_module("norm", H, 2, 4)
    result = train_surgery(module, merged, target, TrainSettings(loss=loss), progress=False)
    mask = merged.mask
    x, y = merged.hidden[mask].double(), target.hidden[mask].double()
    w = reference_weights(target, loss).unsqueeze(-1)
    lam = RIDGE * float((w * x * x).sum(0).mean())
    for j in range(H):
        s = (float((w[:, 0] * y[:, j] * x[:, j]).sum()) + lam) / (
            float((w[:, 0] * x[:, j] ** 2).sum()) + lam
        )
        assert abs((1 - float(module.shift[j].detach())) - s) < 1e-5
    assert result.loss_end < result.loss_start and result.rho_l1 > 0


def test_only_the_training_rows_are_fitted() -> None:
    merged, target = captures(2)
    rows = torch.tensor([0, 2, 3])
    alone = build_module("head", H, 2, 4)
    train_surgery(alone, merged, target, TrainSettings(loss="l1"), rows=rows, progress=False)
    changed = Captured(hidden=merged.hidden.clone(), mask=merged.mask)
    changed.hidden[1] += 5.0  # a held-out row must not move the fit
    again = build_module("head", H, 2, 4)
    train_surgery(again, changed, target, TrainSettings(loss="l1"), rows=rows, progress=False)
    assert torch.equal(alone.weight, again.weight)
