"""The tokenizer of ldqa's runtime: a transformers tokenizer with ldqa's rules for document text and for
a chat template's control tokens (`Tokenizer`). `loader.load_tokenizer` gives a model's without loading its
weights; `loader.load_model` pairs it with the model.
"""

from __future__ import annotations


class Tokenizer:
    """Thin wrapper over a transformers tokenizer with ldqa's rules.

    `encode` never adds special tokens and never parses special-token text: a document containing
    "<bos>" or "<|im_start|>" is tokenized as the plain characters (split_special_tokens=True).
    """

    def __init__(self, hf_tokenizer, eos_ids: list[int]):
        self.hf = hf_tokenizer
        self.bos_id = hf_tokenizer.bos_token_id
        ids = set(eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_ids = sorted(ids)
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as plain text (no BOS/EOS, special-token strings not recognised)."""
        if not text:
            return []
        return self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_control(self, text: str) -> list[int]:
        """Token ids of a chat template's own text, its control-token strings ("<|im_start|>", "<bos>") read
        as the control tokens they name; never used for document or question text (see `encode`)."""
        if not text:
            return []
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def count(self, text: str) -> int:
        """Number of tokens of `text` (see `encode`)."""
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)
