"""ldqa: retrieval-augmented long-document question answering on its own LLM runtime.

The design card's folders (`app/`, `retrieval/`, `indexes/`, `attention/`, `kernels/`, `eval/`) are
installed as `ldqa.app`, `ldqa.retrieval`, ... (see pyproject.toml), so nothing here takes a generic
top-level name such as `kernels` or `eval`.
"""

__version__ = "0.1.0"

__all__ = ["LongDocQA", "Answer", "IngestReport", "__version__"]


def __getattr__(name):  # lazy: `import ldqa` stays cheap (no torch import)
    if name in ("LongDocQA", "Answer", "IngestReport"):
        from ldqa.app import api

        return getattr(api, name)
    raise AttributeError(name)
