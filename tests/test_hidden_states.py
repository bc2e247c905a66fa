"""What `output_hidden_states=True` returns with a surgery attached (docs/design.md): the
correction sits on the LM head's input, so `hidden_states[-1]` is the uncorrected final hidden
state in every transformers path (apply_surgery, hence hf-darts, and the export), and only the
logits carry the correction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_export import batch, exported, head_input, load, merged  # noqa: F401 (fixtures)
from transformers import AutoModelForCausalLM

from mergekit_darts import apply_surgery


def plain(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("path", ["apply_surgery", "export"])
def test_last_hidden_state_is_uncorrected(path, merged, exported, batch):  # noqa: F811
    h, plain_logits = head_input(plain(merged), batch)
    if path == "apply_surgery":
        model = plain(merged)
        apply_surgery(model, merged / "surgery", "pos_corr")
    else:
        model = load(exported / "pos_corr")
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out.hidden_states[-1][real], h[real], rtol=0, atol=1e-6)
    assert (out.logits - plain_logits)[real].abs().max() > 0.1  # the logits are corrected
