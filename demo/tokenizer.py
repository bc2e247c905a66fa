"""Word-level tokenizer for the demo family, built locally (no hub access needed).

One token per space-separated word, so `decode(encode(text)) == text` for every text the
domain generators emit, which is what exact-match scoring relies on. No BOS is added by
the tokenizer, so lm-eval, calibration code and training all see identical token ids.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from demo.domains import vocabulary

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)
MODEL_MAX_LENGTH = 512


def build_tokenizer() -> PreTrainedTokenizerFast:
    """WordLevel vocabulary over every demo word, split on whitespace."""
    words = [*SPECIAL_TOKENS, *vocabulary()]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH,
    )
