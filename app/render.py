"""How an answer reads: the one rendering of an `Answer`'s timings and settings, shown by the CLI
(`ldqa ask`, `ldqa demo`) and by the web app, each joining the phrases in its own way.

    answer_facts(ans)   # ["retrieval 12 ms", "TTFT 840 ms", "21.4 tokens/s", "total 1.9 s",
                        #  "0/812 prompt tokens reused from the KV store", "attention full", "model ...", ...]
    " | ".join(...)     # the CLI's line;  " · ".join(...) in <small>: the web app's
"""

from __future__ import annotations

from pathlib import Path


def answer_facts(ans) -> list[str]:
    """How `ans` (an `Answer`) was made, one phrase each, in reading order: the retrieval time; for an
    answer the model gave, TTFT, decode speed, total time, the prompt tokens not computed for it
    (`reuse_text`), the attention mode that ran, the model (file or directory name), retrieval
    attention's key budget (`retrieval_attention_text`) and the debias method with its time. An
    abstention (the model not asked; the notice says why) has only the retrieval time."""
    t, s = ans.timings, ans.settings
    facts = [f"retrieval {t.retrieval_ms:.0f} ms"]
    if s.abstained:
        return facts
    facts += [f"TTFT {t.ttft_ms:,.0f} ms", f"{t.tokens_per_s:.1f} tokens/s", f"total {t.total_ms / 1000:.1f} s",
              reuse_text(t), f"attention {s.attention_used or s.attention}", f"model {Path(s.model).name}"]
    r = t.retrieval_stats
    if r is not None and (r.steps or r.dense_steps):
        facts.append(retrieval_attention_text(r))
    if s.debias not in (None, "none"):
        debias_ms = t.debias_stats.debias_ms if t.debias_stats is not None else 0.0
        facts.append(f"debias {s.debias} (+{debias_ms:,.0f} ms)")
    return facts


def reuse_text(t) -> str:
    """How much of the prompt was not computed for this answer, from its `Timings` `t`: tokens read from
    stored KV blocks (block modes), or the whole prompt when its exact prefill was a copy of an identical
    earlier prompt's (the prefill memo, shared by every session and user); with debiasing, whose extra
    prefills may be copies while the question is recomputed, the prefill time those copies saved."""
    n, kv, memo_ms = t.prompt_tokens, t.tokens_reused, t.reused_prefill_ms or 0.0
    if memo_ms > 0 and not kv and t.debias_stats is None:  # the answer's context is the memo's copy
        return f"{n:,}/{n:,} prompt tokens reused from an identical earlier prompt's prefill"
    text = f"{kv:,}/{n:,} prompt tokens reused from the KV store"
    if memo_ms > 0:
        text += f", plus prefills of identical earlier prompts ({memo_ms:,.0f} ms of prefill reused)"
    return text


def retrieval_attention_text(r) -> str:
    """What retrieval attention's decode steps attended to, from its `RetrievalStats` `r`."""
    if not r.steps:
        return "retrieval attention: context shorter than min_indexed keys, attended to everything"
    return (f"retrieval attention: {r.keys_touched_per_step:.0f} keys touched per step and KV head "
            f"({100 * r.keys_touched_fraction:.1f}% of the context), index built in {r.build_ms:.0f} ms "
            f"({r.index_kind})")
