"""The answering prompt, built as token segments.

Layout (token ids, each segment tokenized on its own, as plain text):

    [BOS][instruction]                      <- the shared prefix (the "sink" of Block-Attention)
    [Passage [1] (Title: ..., page p) text\n\n]   <- one segment per retrieved passage
    ...
    [Passage [k] ...]
    [Question: ...\nAnswer:]                 <- the question segment, always last

The wording follows the prompt of "Lost in the Middle" (Liu et al. 2023), with passages numbered so the
answer can cite them as [n]. Keeping the segments separate is what lets a passage's KV states be computed
once and reused (issue 3): a passage's tokens never depend on its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant). Cite the passages you use as [n].\n\n"
)
STOP_STRINGS = ("\n\n", "\nQuestion:", "\nPassage [")


@dataclass
class PromptSegments:
    """Token ids of the prompt's parts: prefix (BOS + instruction), passages (one list each), question."""

    prefix: list[int]
    passages: list[list[int]]
    question: list[int]

    def ids(self) -> list[int]:
        """The whole prompt, in order."""
        out = list(self.prefix)
        for p in self.passages:
            out += p
        return out + self.question

    def __len__(self) -> int:
        return len(self.prefix) + sum(map(len, self.passages)) + len(self.question)


def passage_text(n: int, title: str, text: str, page: int | None = None) -> str:
    """The text of passage block n (1-based), e.g. 'Passage [2] (Title: Manual, page 3) ...'."""
    where = f"Title: {title}" + (f", page {page}" if page else "")
    return f"Passage [{n}] ({where}) {text.strip()}\n\n"


def question_text(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def build_prompt(tokenizer, passages, question: str) -> PromptSegments:
    """Tokenize the prompt for `question` over `passages` (objects with title, text, page).

    Every text segment goes through `tokenizer.encode`, which treats special-token strings in documents
    (`<bos>`, `<|im_start|>`, ...) as plain text; only the BOS id is a real control token.
    """
    prefix = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(INSTRUCTION)
    blocks = [tokenizer.encode(passage_text(i + 1, p.title, p.text, p.page)) for i, p in enumerate(passages)]
    return PromptSegments(prefix, blocks, tokenizer.encode(question_text(question)))
