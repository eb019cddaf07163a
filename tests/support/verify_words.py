"""A word-level tokenizer for the trl verify targets: token i is `WORDS[i]` (nothing downloaded).

tests/support/trl_grpo_verify.py and verify_corpus_trl.py turn token ids into
text with `WORDS` and hand the trainers this tokenizer, which gives the same ids
back (the specials are not prefixes of any word: a tokenizer matches special
tokens inside words before it splits them).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SPECIALS", "WORDS", "tokenizer"]

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
WORDS = (*SPECIALS, *(f"t{i}" for i in range(len(SPECIALS), 40)))
"""Token i's text: the specials (pad 0, bos 1, eos 2, unk 3), then "t4".."t39"."""


def tokenizer() -> Any:
    """A word-level tokenizer over `WORDS`, split on spaces.

    The specials are not prefixes of the words: a tokenizer matches special tokens inside
    words before it splits them, so a pad named "t0" would cut "t05" in two.
    """
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )  # fmt: skip
