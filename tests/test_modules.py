"""Surgery modules: exact inits, parameter counts, and the forward against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from mergekit_darts import build_module
from mergekit_darts.correction.darts_correction import MODULE_KINDS

H, R, T_MAX = 16, 4, 8


def _randomise(module, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


@pytest.mark.parametrize("kind", MODULE_KINDS)
def test_fresh_module_is_identity(kind):
    module = build_module(kind, H, R, T_MAX, seed=0)
    h = torch.randn(2, 10, H)  # positions past T_MAX included
    positions = torch.arange(10).expand(2, 10)
    assert torch.equal(module(h, positions), h)
    if hasattr(module, "up"):  # the bottleneck kinds start from a zero W_up
        assert torch.count_nonzero(module.up.weight) == 0


def test_pos_corr_parameters_and_init():
    module = build_module("pos_corr", H, R, T_MAX)
    assert sum(p.numel() for p in module.parameters()) == 2 * R * H + T_MAX * H
    assert torch.count_nonzero(module.position_bias) == 0
    assert set(module.state_dict()) == {"down.weight", "up.weight", "position_bias"}
    assert module.down.weight.shape == (R, H) and module.up.weight.shape == (H, R)
    assert build_module("standard", H, R, T_MAX).state_dict().keys() == {"down.weight", "up.weight"}


def test_down_projection_is_kaiming_uniform():
    module = build_module("standard", 256, 64, T_MAX, seed=0)
    bound = 1 / 256**0.5  # kaiming_uniform_(a=sqrt(5)) on fan_in=256
    w = module.down.weight
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound


def _ref_pos_corr(module, h, positions):
    """h - W_up relu(W_down h) - b_p in float64, b_p = 0 outside [0, T_max)."""
    down = module.down.weight.double()
    up = module.up.weight.double()
    bias = module.position_bias.double()
    out = torch.empty(h.shape, dtype=torch.float64)
    for i in range(h.shape[0]):
        for t in range(h.shape[1]):
            x = h[i, t].double()
            corr = up @ torch.clamp(down @ x, min=0)
            p = int(positions[i, t])
            if 0 <= p < module.max_positions:
                corr = corr + bias[p]
            out[i, t] = x - corr
    return out


def test_pos_corr_forward_matches_reference_and_ignores_far_positions():
    module = _randomise(build_module("pos_corr", H, R, T_MAX))
    h = torch.randn(2, 12, H)
    positions = torch.tensor([list(range(12)), [-1, -1] + list(range(10))])
    got = module(h, positions).double()
    torch.testing.assert_close(got, _ref_pos_corr(module, h, positions), rtol=1e-5, atol=1e-5)
    # at and beyond T_max only the content term acts
    content_only = h - module.content(h)
    torch.testing.assert_close(module(h, positions)[0, T_MAX:], content_only[0, T_MAX:])


def test_add_and_parallel_reference():
    h = torch.randn(1, 5, H)
    positions = torch.arange(5).unsqueeze(0)
    add = _randomise(build_module("add", H, R, T_MAX), 1)
    e = add.position_embedding[:5]
    expected = h - add.up(torch.relu(add.down(h + e)))
    torch.testing.assert_close(add(h, positions), expected)
    par = _randomise(build_module("parallel", H, R, T_MAX), 2)
    e = par.position_embedding[:5]
    expected = (
        h - par.up(torch.relu(par.down(h))) - par.position_up(torch.relu(par.position_down(e)))
    )
    torch.testing.assert_close(par(h, positions), expected)


def test_correction_computed_in_float32_and_cast_back():
    module = _randomise(build_module("pos_corr", H, R, T_MAX))
    h = torch.randn(1, 4, H).to(torch.bfloat16)
    positions = torch.arange(4).unsqueeze(0)
    out = module(h, positions)
    assert out.dtype == torch.bfloat16
    expected = module(h.to(torch.float32), positions).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_seeded_build_is_deterministic_and_independent_of_global_rng():
    torch.manual_seed(123)
    a = build_module("pos_corr", H, R, T_MAX, seed=5)
    torch.manual_seed(456)
    b = build_module("pos_corr", H, R, T_MAX, seed=5)
    assert torch.equal(a.down.weight, b.down.weight)


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="unknown surgery module 'lora'"):
        build_module("lora", H)
    with pytest.raises(ValueError, match="must be positive"):
        build_module("standard", H, rank=0)
    with pytest.raises(ValueError, match="needs token positions"):
        build_module("pos_corr", H)(torch.zeros(1, 2, H))


def test_every_kind_is_one_registered_class():
    from mergekit_darts.correction.darts_correction import (
        PLAIN_KINDS,
        SurgeryModule,
        correction_module,
        register_kind,
    )

    classes = {kind: type(correction_module(kind, H, R, T_MAX)) for kind in MODULE_KINDS}
    assert MODULE_KINDS == ("standard", "pos_corr", "add", "parallel", "none", "head", "norm")
    assert PLAIN_KINDS == ("head", "norm")
    assert len(set(classes.values())) == len(MODULE_KINDS)
    assert all(issubclass(c, SurgeryModule) and c.kind == k for k, c in classes.items())

    class Again(SurgeryModule):
        kind = "standard"

    with pytest.raises(ValueError, match="taken or reserved"):
        register_kind(Again)
