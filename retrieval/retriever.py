"""Query -> ranked passages: dense (faiss), BM25 (FTS5) or both fused by reciprocal rank fusion."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ldqa.retrieval.fusion import rrf

MODES = ("hybrid", "dense", "bm25")


class EmptyCollectionError(RuntimeError):
    """Search on a store that holds no chunks."""


@dataclass
class RetrievedPassage:
    """One retrieved chunk with where it came from and how it was ranked.

    score: the ranking score of the mode used (RRF score for hybrid, cosine for dense, -bm25 for bm25);
    dense_score / bm25_score: the chunk's score in that list, None if it was not among its candidates;
    dense_rank / bm25_rank: 1-based rank in that candidate list, or None.
    page: 1-based page (None for unpaged sources); start, end: character offsets in the document text
    (text == document text[start:end]); header: the table header rows the chunk's text continues ("" for
    none), read before the text by the LLM; anchor: the text of the document's first chunk when block
    attention encodes this chunk after it (set by the answering side, None otherwise).
    """

    chunk_id: int
    doc_id: int
    title: str
    path: str
    page: int | None
    start: int
    end: int
    text: str
    score: float
    dense_score: float | None = None
    bm25_score: float | None = None
    dense_rank: int | None = None
    bm25_rank: int | None = None
    header: str = ""
    anchor: str | None = None


class Retriever:
    """Searches one `Store` with one `Embedder`.

    Parameters
    ----------
    store : ldqa.indexes.store.Store
    embedder : ldqa.retrieval.embedders.Embedder (or anything with ``name``, ``dim``, ``encode_query``)

    Raises
    ------
    IndexMismatchError (`ldqa.indexes.vector_index`, raised by `store.check_embedder`)
        If the embedder is not the one the store was built with.
    """

    def __init__(self, store, embedder):
        store.check_embedder(embedder.name, int(embedder.dim))
        self.store = store
        self.embedder = embedder

    def search(self, query: str, top_k: int = 5, mode: str = "hybrid", candidates: int = 50) -> list[RetrievedPassage]:
        """Retrieve the `top_k` passages for `query`.

        Parameters
        ----------
        query : str
            The question, free text (any punctuation is safe).
        top_k : int
            Passages wanted, >= 1; clamped to the number of chunks in the store.
        mode : {"hybrid", "dense", "bm25"}
            hybrid: RRF (k = 60) of the dense and BM25 candidate lists; dense / bm25: that list alone.
        candidates : int
            Length of each candidate list before fusion (>= top_k is enforced; clamped to the store).

        Returns
        -------
        list of RetrievedPassage
            Best first, at most `top_k` (bm25 mode may return fewer, even none, when few chunks share
            a word with the query).

        Raises
        ------
        ValueError
            On an unknown mode, a non-str or blank query, top_k < 1 or candidates < 1.
        EmptyCollectionError
            If the store holds no chunks.
        """
        self._validate(query, top_k, mode, candidates)
        n = self.store.n_chunks()
        if n == 0:
            raise EmptyCollectionError(
                f"no documents ingested in store {self.store.path}; run `ldqa ingest PATH --store {self.store.path}` first"
            )
        top_k = min(int(top_k), n)
        n_cand = min(max(int(candidates), top_k), n)
        dense = self.store.dense_search(self.embedder.encode_query(query), n_cand) if mode != "bm25" else []
        bm25 = self.store.bm25_search(query, n_cand) if mode != "dense" else []
        if mode == "hybrid":
            ranked = rrf([[i for i, _ in dense], [i for i, _ in bm25]])
        else:
            ranked = dense or bm25
        return self._passages(ranked[:top_k], dense, bm25)

    @staticmethod
    def _validate(query, top_k, mode, candidates) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown retrieval mode {mode!r}; choose one of {', '.join(MODES)}")
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"query must be a non-empty string, got {query!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
        if isinstance(candidates, bool) or not isinstance(candidates, numbers.Integral) or candidates < 1:
            raise ValueError(f"candidates must be an integer >= 1, got {candidates!r}")

    def _passages(self, ranked, dense, bm25) -> list[RetrievedPassage]:
        dense_at = {cid: (rank, s) for rank, (cid, s) in enumerate(dense, start=1)}
        bm25_at = {cid: (rank, s) for rank, (cid, s) in enumerate(bm25, start=1)}
        rows = {r["id"]: r for r in self.store.get_chunks([cid for cid, _ in ranked])}
        out = []
        for cid, score in ranked:
            row = rows.get(cid)
            if row is None:  # deleted between search and fetch
                continue
            d_rank, d_score = dense_at.get(cid, (None, None))
            b_rank, b_score = bm25_at.get(cid, (None, None))
            out.append(RetrievedPassage(
                chunk_id=cid, doc_id=row["doc_id"], title=row["title"], path=row["path"], page=row["page"],
                start=row["start"], end=row["end"], text=row["text"], score=float(score),
                dense_score=d_score, bm25_score=b_score, dense_rank=d_rank, bm25_rank=b_rank,
                header=row.get("header", ""),
            ))
        return out
