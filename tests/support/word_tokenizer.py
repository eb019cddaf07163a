"""A word-level tokenizer built offline, for the trl tests (no hub, no download)."""

from __future__ import annotations

from typing import Any

VOCAB = 40
"""Tokens "t0".."t39": t0 pad, t1 bos, t2 eos, t3 unk."""


def tokenizer() -> Any:
    """A `PreTrainedTokenizerFast` over "t0".."t39" (t0 pad, t1 bos, t2 eos, t3 unk)."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"t\d+"), "isolated")]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3"
    )
