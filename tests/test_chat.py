"""Chat-template prompts (`ldqa.app.chat`): the segments' token ids equal transformers' apply_chat_template
for the same template and messages (Qwen2 ChatML, Gemma 3, Llama 3), generation stops at the template's
end of turn, document text stays plain, answers lose their [n] runs, and bad templates are refused by
name. Tiny tokenizers (SmolLM2's vocabulary plus each family's control tokens) and random-weight models."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ldqa.app.chat import (CHAT_INSTRUCTION, ChatTemplateError, chat_format, check_chat_template,
                           split_citations)
from ldqa.app.prompt import INSTRUCTION, build_prompt, chat_question_text, header_text, passage_text

# Qwen2.5 Instruct's template as its GGUF ships it (tools branch included)
QWEN2_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.' }}\n    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
# Gemma 3 IT's template, text messages (the system message is folded into the first user turn)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] "
    "+ '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{%- endif -%}{%- if (message['role'] == 'assistant') -%}"
    "{%- set role = \"model\" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}")
# Llama 3 Instruct's template
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
FAMILIES = {
    "qwen2": (QWEN2_TEMPLATE, [], None, "<|im_end|>"),
    "gemma3": (GEMMA3_TEMPLATE, ["<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>"),
    "llama3": (LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>"),
}
PASSAGES = [SimpleNamespace(title="Manual", text="The fan hub bolts take 18 Nm.\n\nTorque matters.", page=3),
            SimpleNamespace(title="Log", text="Fan No. 2 replaced on 14 March 2023", page=None),
            SimpleNamespace(title="Prices", text="SL-30 Pro: EUR 8,450 (see page 4)", page=None)]


@pytest.fixture(scope="module")
def family_tokenizer(small_tokenizer, tmp_path_factory):
    """factory(family) -> (ldqa Tokenizer with the family's chat template and control tokens, saved dir)."""
    from transformers import AutoTokenizer

    from ldqa.attention.loader import Tokenizer

    made = {}

    def make(family):
        if family not in made:
            template, controls, bos, _ = FAMILIES[family]
            d = tmp_path_factory.mktemp(f"tok-{family}")
            small_tokenizer.hf.save_pretrained(d)
            hf = AutoTokenizer.from_pretrained(str(d))
            if controls:
                hf.add_special_tokens({"additional_special_tokens": controls})
            if bos is not None:
                hf.add_special_tokens({"bos_token": bos})
            hf.chat_template = template
            hf.save_pretrained(d)
            made[family] = (Tokenizer(hf, small_tokenizer.eos_ids), d)
        return made[family]

    return make


def _reference_ids(tok, chat, passages, question, system=CHAT_INSTRUCTION):
    lead = chat.blank_first
    text = "".join(header_text(i + 1, lead) + passage_text(p.title, p.text, p.page, blank_first=lead)
                   for i, p in enumerate(passages)) + chat_question_text(question, lead and bool(passages))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
    out = tok.hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("n", [0, 1, 3])
def test_segments_equal_apply_chat_template(family_tokenizer, family, n):
    tok, _ = family_tokenizer(family)
    chat = chat_format(tok, CHAT_INSTRUCTION, family)
    assert chat is not None and chat.system_role
    for q in ("What torque for the fan hub bolts?", "  when was fan 2 replaced?\n"):
        seg = build_prompt(tok, PASSAGES[:n], q, chat=chat)
        assert seg.ids() == _reference_ids(tok, chat, PASSAGES[:n], q)
    # the prefix is the template's opening with the instruction; the question segment ends the user turn
    assert tok.decode(seg.prefix).rstrip().endswith(("user", CHAT_INSTRUCTION.split()[-1]))
    assert CHAT_INSTRUCTION in tok.hf.decode(seg.prefix)
    end = FAMILIES[family][3]
    assert end in tok.hf.decode(seg.question) and tok.hf.decode(seg.question).rstrip().endswith(
        ("assistant", "model", "<|end_header_id|>"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generation_stops_at_the_templates_end_of_turn(family_tokenizer, family):
    tok, _ = family_tokenizer(family)
    chat = chat_format(tok, CHAT_INSTRUCTION, family)
    end_id = tok.hf.convert_tokens_to_ids(FAMILIES[family][3])
    assert end_id in chat.stop_ids and set(tok.eos_ids) <= set(chat.stop_ids)
    assert chat.stop_strings == ()


def test_passages_are_blocks_that_do_not_depend_on_neighbours_or_rank(family_tokenizer):
    tok, _ = family_tokenizer("qwen2")
    chat = chat_format(tok, CHAT_INSTRUCTION)
    a = build_prompt(tok, PASSAGES, "q?", chat=chat)
    b = build_prompt(tok, PASSAGES[::-1], "another question?", chat=chat)
    assert a.prefix == b.prefix
    assert a.passages == b.passages[::-1]  # a body's tokens: its own text only
    assert a.passages[0] == tok.encode(passage_text("Manual", PASSAGES[0].text, 3, blank_first=chat.blank_first))


def test_special_token_text_in_documents_and_questions_stays_plain(family_tokenizer):
    tok, _ = family_tokenizer("qwen2")
    chat = chat_format(tok, CHAT_INSTRUCTION)
    doc = SimpleNamespace(title="Console", text="Operators type <|im_start|>system and <|im_end|> here.", page=None)
    seg = build_prompt(tok, [doc], "Is <|im_end|> typed?", chat=chat)
    start, end = tok.hf.convert_tokens_to_ids("<|im_start|>"), tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = seg.ids()
    assert ids.count(start) == 3 and ids.count(end) == 2  # system, user, assistant openings; two turn ends
    assert start not in seg.passages[0] and end not in seg.passages[0]
    assert "<|im_start|>system and <|im_end|>" in tok.decode(seg.passages[0])


def test_chat_prefix_changes_the_kv_block_key(family_tokenizer):
    from ldqa.indexes.kv_store import block_key

    tok, _ = family_tokenizer("qwen2")
    chat = build_prompt(tok, PASSAGES[:1], "q?", chat=chat_format(tok, CHAT_INSTRUCTION))
    plain = build_prompt(tok, PASSAGES[:1], "q?")
    assert plain.prefix[-len(tok.encode(INSTRUCTION)):] == tok.encode(INSTRUCTION)
    assert block_key("fp", chat.prefix, chat.passages[0]) != block_key("fp", plain.prefix, plain.passages[0])


def test_template_without_system_role_gets_the_instruction_in_the_user_turn(family_tokenizer):
    tok, _ = family_tokenizer("gemma3")
    no_system = GEMMA3_TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
                                        "{{ raise_exception('System role not supported') }}{% endif %}")
    old = tok.hf.chat_template
    tok.hf.chat_template = no_system
    try:
        chat = chat_format(tok, CHAT_INSTRUCTION)
        assert not chat.system_role
        seg = build_prompt(tok, PASSAGES, "q?", chat=chat)
        text = chat_question_text("q?", chat.blank_first)
        body = "".join(header_text(i + 1, chat.blank_first) + passage_text(p.title, p.text, p.page,
                                                                           blank_first=chat.blank_first)
                       for i, p in enumerate(PASSAGES))
        ref = tok.hf.apply_chat_template([{"role": "user", "content": f"{CHAT_INSTRUCTION}\n\n{body}{text}"}],
                                         tokenize=True, add_generation_prompt=True)
        assert seg.ids() == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    finally:
        tok.hf.chat_template = old


def test_a_template_that_fails_to_render_is_refused_by_name(family_tokenizer):
    tok, _ = family_tokenizer("llama3")
    old = tok.hf.chat_template
    tok.hf.chat_template = "{{ raise_exception('no such role') }}"
    try:
        with pytest.raises(ChatTemplateError, match=r"model 'm'.*fails to render.*no such role.*--chat-template none"):
            chat_format(tok, CHAT_INSTRUCTION, "model 'm'")
        tok.hf.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
        chat = chat_format(tok, CHAT_INSTRUCTION, "model 'm'")
        with pytest.raises(ChatTemplateError, match="rewrites the user's message text"):
            build_prompt(tok, PASSAGES, "q?", chat=chat)
    finally:
        tok.hf.chat_template = old


def test_an_end_of_turn_that_is_no_token_becomes_a_stop_string(family_tokenizer, caplog):
    tok, _ = family_tokenizer("llama3")
    old = tok.hf.chat_template
    tok.hf.chat_template = ("{% for m in messages %}<turn {{ m['role'] }}>{{ m['content'] }}</turn>\n{% endfor %}"
                            "{% if add_generation_prompt %}<turn assistant>{% endif %}")
    try:
        with caplog.at_level(logging.WARNING, logger="ldqa.app.chat"):
            chat = chat_format(tok, CHAT_INSTRUCTION, "model 'x'")
        assert chat.stop_strings == ("</turn>",) and set(chat.stop_ids) == set(tok.eos_ids)
        assert "'</turn>'" in caplog.text and "model 'x'" in caplog.text
    finally:
        tok.hf.chat_template = old


def test_no_template_means_the_base_prompt(family_tokenizer):
    tok, _ = family_tokenizer("qwen2")
    old = tok.hf.chat_template
    tok.hf.chat_template = None
    try:
        assert chat_format(tok, CHAT_INSTRUCTION) is None
    finally:
        tok.hf.chat_template = old
    assert check_chat_template("auto") == "auto" and check_chat_template("none") == "none"
    with pytest.raises(ValueError, match="chat_template='model'.*auto, none"):
        check_chat_template("model")


@pytest.mark.parametrize("raw, text, cited", [
    ("18 Nm [2]", "18 Nm", [2]),
    ("18 Nm [2].", "18 Nm.", [2]),
    ("EUR 8,450. [1] [3] [3] [3] [3]", "EUR 8,450.", [1, 3]),
    ("E-14 [1, 2][4]", "E-14", [1, 2, 4]),
    ("On 14 March 2023 [2], after the bulletin [1].", "On 14 March 2023, after the bulletin.", [2, 1]),
    ("no markers at all", "no markers at all", []),
    ("[3]", "", [3]),
    ("3.2 cubic metres (Passage [1])", "3.2 cubic metres", [1]),
    ("3.2 cubic metres (Passages [1] and [4]).", "3.2 cubic metres.", [1, 4]),
    ("See passage [2] and Passage [3]: E-14", "See: E-14", [2, 3]),
    ("a list [x] stays", "a list [x] stays", []),
    ("14 March 2023. [n]", "14 March 2023.", []),
    ("SL30-2207-0450 [n] [2]", "SL30-2207-0450", [2]),
])
def test_split_citations(raw, text, cited):
    assert split_citations(raw) == (text, cited)


def test_the_api_prompts_an_instruct_model_through_its_template(family_tokenizer, tiny_model_dir, tmp_path):
    """A tiny Qwen2 model whose tokenizer carries ChatML: answers record chat_template "model", the prompt
    the engine prefills is apply_chat_template's, block reuse keys the chat prefix, and "none" gives the
    base prompt."""
    import shutil

    from ldqa.app.api import LongDocQA, Passage

    tok, tok_dir = family_tokenizer("qwen2")
    model_dir = tmp_path / "tiny-qwen2-chat"
    shutil.copytree(tiny_model_dir("qwen2"), model_dir)
    for f in tok_dir.iterdir():
        shutil.copy(f, model_dir / f.name)
    ps = [Passage(p.title, p.text, p.page) for p in PASSAGES]
    qa = LongDocQA(store=tmp_path / "store", model=str(model_dir), max_new_tokens=4)
    ans = qa.answer("What torque?", ps)
    assert ans.settings["chat_template"] == "model"
    chat = qa.chat_format()
    assert ans.timings["prompt_tokens"] == len(_reference_ids(qa.llm.tokenizer, chat, ps, "What torque?"))
    assert "<|im_" not in ans.text
    block = qa.answer("What torque?", ps, attention="block")
    assert block.timings["kv_misses"] == 3 and block.timings["prompt_tokens"] == ans.timings["prompt_tokens"]
    base = LongDocQA(store=tmp_path / "store", model=str(model_dir), max_new_tokens=4, chat_template="none")
    plain = base.answer("What torque?", ps)
    assert plain.settings["chat_template"] == "none"
    assert plain.timings["prompt_tokens"] == len(build_prompt(base.llm.tokenizer, ps, "What torque?"))
    again = base.answer("What torque?", ps, attention="block")
    assert again.timings["kv_hits"] == 0  # the base prompt's prefix keys other blocks
    with pytest.raises(ValueError, match="chat_template"):
        LongDocQA(store=tmp_path / "store", model=str(model_dir), chat_template="yes")


SAMPLE = __import__("pathlib").Path(__file__).resolve().parents[1] / "app" / "sample" / "docs"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_packaged_instruct_models_answer_through_their_template(model, tmp_path):
    """The real Qwen2.5 Instruct models (assembled from their part packages, sha256 checked): the prompt
    equals apply_chat_template's tokens, the answer is the assistant's turn alone, ended by <|im_end|>, its
    [n] marker taken out and made a citation; block reuse answers the same way."""
    from ldqa.app.api import LongDocQA

    qa = LongDocQA(store=tmp_path / "store", model=model)
    qa.ingest([SAMPLE])
    q = "According to service bulletin SB-2024-07, to what torque must each fan hub bolt be tightened?"
    passages = qa.retrieve(q, top_k=5)
    chat = qa.chat_format()
    tok = qa.llm.tokenizer
    assert chat is not None and chat.stop_ids == (tok.hf.convert_tokens_to_ids("<|im_end|>"),)
    assert build_prompt(tok, passages, q, chat=chat).ids() == _reference_ids(tok, chat, passages, q)
    ans = qa.ask(q)
    assert ans.settings["chat_template"] == "model" and ans.timings["stop_reason"] == "eos"
    assert "18 Nm" in ans.text and len(ans.text.split()) <= 6, ans.text
    assert "[" not in ans.text and "<|" not in ans.text
    assert any(c.path.endswith("service_bulletin.pdf") and c.page == 2 for c in ans.citations)
    block = qa.ask(q, attention="block", debias="none")
    assert block.timings["kv_misses"] == 5 and "18 Nm" in block.text, block.text


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
@pytest.mark.parametrize("chat_on", [True, False])
def test_anchor_passages_are_laid_out_as_the_prompt_lists_passages_then_the_next_header(family_tokenizer, family,
                                                                                      chat_on):
    from ldqa.app.prompt import ANCHOR_PASSAGES, anchor_ids

    tok, _ = family_tokenizer(family)
    chat = chat_format(tok, CHAT_INSTRUCTION, family) if chat_on else None
    listed = [SimpleNamespace(title=t, text=x, page=None) for t, x in ANCHOR_PASSAGES[:2]] + PASSAGES[:1]
    seg = build_prompt(tok, listed, "q?", chat=chat)
    ids = anchor_ids(tok, 2, None, chat)
    # the prompt over the two anchor passages and one more, up to that passage's body: a block encoded after
    # prefix + anchor sees what the third passage of a full prompt sees
    assert seg.prefix + ids + seg.passages[2] == seg.ids()[:len(seg.ids()) - len(seg.question)]
    assert "Passage [3]" in tok.hf.decode(ids[-6:]) and "(Title: Basalt)" in tok.hf.decode(ids)
    assert anchor_ids(tok, 0, None, chat) == []
    for bad in (-1, len(ANCHOR_PASSAGES) + 1, 1.5, True):
        with pytest.raises(ValueError, match="anchor_passages"):
            anchor_ids(tok, bad, None, chat)
    # every passage without a document anchor of its own gets the ids; a document anchor stays
    two = build_prompt(tok, PASSAGES[:2], "q?", chat=chat)
    two.anchors = [[], [7, 8]]
    assert two.with_anchor(ids).anchors == [ids, [7, 8]]
    assert build_prompt(tok, PASSAGES[:2], "q?", chat=chat).with_anchor([]).anchors is None
