"""Run under ``torchrun`` by ``test_data_parallel.py``: ``hf-darts`` with ``tp_plan=auto``.

Writes, per rank, ``<out>/rank<r>.safetensors`` (the corrected logits of each tiny prompt, through
HFLM's own ``_model_call``) and ``<out>/rank<r>.json`` (the local shapes of the sharded weights).
Usage: ``torchrun --nproc_per_node 2 tests/tp_worker.py <merged folder> <surgery task> <out>``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny import PROMPTS

from lm_eval_darts.model import DartsHFLM


def local_shape(weight: torch.Tensor) -> list[int]:
    """The shape this rank holds (a DTensor's local shard, or the plain tensor's)."""
    to_local = getattr(weight, "to_local", None)
    return list((to_local() if to_local else weight).shape)


def main(merged: str, task: str, out: Path) -> None:
    lm = DartsHFLM(pretrained=merged, surgery=task, dtype="float32", tp_plan="auto", batch_size=1)
    rank = int(os.environ["RANK"])
    model = lm.model
    shapes = {
        "q_proj": local_shape(model.model.layers[0].self_attn.q_proj.weight),
        "lm_head": local_shape(model.get_output_embeddings().weight),
        "world_size": lm.world_size,
        "tp_size": getattr(model, "tp_size", None),
    }
    logits = {}
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([lm.tok_encode(prompt)])
        logits[f"p{i}"] = lm._model_call(ids)[0].contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(logits, out / f"rank{rank}.safetensors")
    (out / f"rank{rank}.json").write_text(json.dumps(shapes))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
