"""The model's real output path: LM head (weight and bias) plus what the architecture does after it.

``kl``, ``ce`` and the held-out metrics compare next-token distributions, so their logits must be
the ones the model itself produces, not ``h @ W.T``: phi's head has a bias, granite divides by
``logits_scaling``, cohere multiplies by ``logit_scale``, gemma2/3 apply
``tanh(x / c) * c`` (``final_logit_softcapping``). The transforms below are read from
transformers 5.24's modeling files. A model whose output path holds anything else is caught by
:meth:`OutputHead.verify`, run on the first captured batch against the model's own logits, and
the logit-based features then refuse it (:meth:`OutputHead.require`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from torch import nn

from mergekit_darts.errors import HeadError

# text-config model_type -> (config attribute, True: logits are divided by it, False: multiplied)
SCALES: dict[str, tuple[str, bool]] = {
    **{
        t: ("logits_scaling", True)
        for t in (
            "granite",
            "granite_swa",
            "granitemoe",
            "granitemoe_swa",
            "granitemoeshared",
            "granitemoehybrid",
        )
    },
    **{t: ("logit_scale", False) for t in ("cohere", "cohere2", "cohere2_moe")},
    "hyperclovax": ("logits_scaling", False),  # same name as granite's, opposite use
    "falcon_h1": ("lm_head_multiplier", False),
}
# tanh(logits / c) * c after the head wherever transformers defines this attribute (gemma2/3/3n/4,
# vaultgemma, nanochat, ...)
SOFTCAP = "final_logit_softcapping"
# max |head(h) - model logits| allowed, relative to max(1, max |model logits|), by model dtype:
# float32 agrees to rounding; half precision rounds the model's own logits to 8 or 11 bits.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}
HALF_TOLERANCE = 2e-2
LOGIT_CHUNK = 256  # positions per chunk in the metrics: float32 temporaries are [256, V]


def logit_chunks(positions: int) -> list[slice]:
    """``LOGIT_CHUNK`` positions at a time over ``positions``: an [N, V] tensor never exists."""
    return [slice(start, start + LOGIT_CHUNK) for start in range(0, positions, LOGIT_CHUNK)]


@dataclass
class OutputHead:
    """``logits(h) = softcap(scale * (h @ weight.T + bias))``, in float32."""

    weight: torch.Tensor  # [V, H] float32
    bias: torch.Tensor | None = None  # [V] float32
    scale: float = 1.0
    softcap: float | None = None
    model_class: str = ""
    verified: bool | None = None  # None: not checked against the model yet
    max_error: float | None = None  # of the check, relative to the largest logit

    @classmethod
    def of(cls, model: nn.Module, device: torch.device | str = "cpu") -> OutputHead:
        """The head of an HF causal LM, with the post-head transform its architecture applies."""
        head = model.get_output_embeddings()
        config = model.config.get_text_config(decoder=True)
        scale = 1.0
        if (known := SCALES.get(getattr(config, "model_type", None))) is not None:
            attr, divide = known
            value = float(getattr(config, attr))
            scale = 1.0 / value if divide else value
        softcap = getattr(config, SOFTCAP, None)
        # accelerate keeps an offloaded head's weights on the meta device between forward passes
        with align_module_device(head):
            bias = getattr(head, "bias", None)
            copy = has_offloaded_params(head)  # a copy outlives the onloaded tensors
            weight = head.weight.detach().to(device, torch.float32, copy=copy)
            bias = None if bias is None else bias.detach().to(device, torch.float32, copy=copy)
        return cls(
            weight=weight,
            bias=bias,
            scale=scale,
            softcap=None if softcap is None else float(softcap),
            model_class=type(model).__name__,
        )

    def to(self, device: torch.device | str) -> OutputHead:
        """The same head with its tensors on ``device`` (no copy when they are there already)."""
        bias = None if self.bias is None else self.bias.to(device)
        return dataclasses.replace(self, weight=self.weight.to(device), bias=bias)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states ``h`` [..., H] (differentiable, for kl / ce)."""
        logits = nn.functional.linear(h.to(torch.float32), self.weight, self.bias)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def top1(self, h: torch.Tensor) -> torch.Tensor:
        """The argmax token of ``logits(h)`` for each row of ``h`` [P, H], chunk by chunk."""
        out = torch.empty(h.shape[0], dtype=torch.long, device=self.weight.device)
        for part in logit_chunks(h.shape[0]):
            out[part] = self.logits(h[part]).argmax(-1)
        return out

    @torch.no_grad()
    def verify(self, h: torch.Tensor, model_logits: torch.Tensor, mask: torch.Tensor) -> bool:
        """Compare ``logits(h)`` with the model's own logits on the real tokens; records the result."""
        keep = mask.to(device=h.device, dtype=torch.bool)
        ours = self.logits(h[keep].to(self.weight.device))
        theirs = model_logits[keep].to(ours.device, torch.float32)
        if ours.shape != theirs.shape:  # e.g. logits_to_keep, or a head we do not understand
            self.verified, self.max_error = False, None
            return False
        error = float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1.0))
        self.max_error = error
        self.verified = error <= TOLERANCE.get(model_logits.dtype, HALF_TOLERANCE)
        return self.verified

    def require(self, what: str) -> None:
        """Raise one line naming the model class unless the check passed."""
        if self.verified:
            return
        if self.verified is None:
            raise HeadError(
                f"{what} needs the model's own logits, and {self.model_class}'s head was never "
                "checked against them; capture with with_head=True"
            )
        off = (
            "" if self.max_error is None else f" (off by {self.max_error:.2g} of the largest logit)"
        )
        raise HeadError(
            f"{what} needs the model's own logits, but {self.model_class}'s LM head and the "
            f"post-head transform known for it do not reproduce them{off}: an output path "
            "mergekit-darts does not know; use loss l1 or ewl1, and select: off or a select "
            "metric computed from hidden states (rho_l1, completion_rho_l1)"
        )

    # ---- storage: safetensors tensors, the small config as UTF-8 JSON bytes ----------------------

    def tensors(self, prefix: str = "head.") -> dict[str, torch.Tensor]:
        config = {
            "scale": self.scale,
            "softcap": self.softcap,
            "model_class": self.model_class,
            "verified": self.verified,
            "max_error": self.max_error,
        }
        text = json.dumps(config, sort_keys=True).encode("utf-8")
        out = {
            f"{prefix}weight": self.weight.contiguous(),
            f"{prefix}config": torch.tensor(list(text), dtype=torch.uint8),
        }
        if self.bias is not None:
            out[f"{prefix}bias"] = self.bias.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "head.") -> OutputHead:
        """The head :meth:`tensors` wrote; raises KeyError / ValueError on anything else."""
        config = json.loads(bytes(tensors[f"{prefix}config"].tolist()).decode("utf-8"))
        weight, bias = tensors[f"{prefix}weight"], tensors.get(f"{prefix}bias")
        if weight.dim() != 2 or (bias is not None and tuple(bias.shape) != weight.shape[:1]):
            raise ValueError("head tensors of inconsistent shapes")
        try:
            return cls(weight=weight.to(torch.float32), bias=bias, **config)
        except TypeError as err:  # a config with other keys: not ours
            raise ValueError(f"not a head config: {err}") from None
