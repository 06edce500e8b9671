"""Tool-call rows (chat/tool_rows.py): SFT's ids and loss masks against TRL 1.16's own SFT preprocessing
(``SFTTrainer._prepare_dataset`` with ``assistant_only_loss=True``, run on the same rows) on five real templates,
DPO and KTO rows with tools, and the bad rows (one line naming the file and row).

TRL's side is TRL's code: its dataset preparation on the rows, with the template TRL's SFTTrainer picks
(``get_training_chat_template`` for Qwen3 and gpt-oss; for Llama 3.1 and the Mistrals, which TRL refuses, the real
template with generation markers written by hand: tests/tool_rows_data.py). Its labels (-100 = not trained) are the
oracle of our mask; its input_ids of our ids."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from tests.tool_rows_data import CALC, FAMILIES, family_tokenizer, marked_template, tool_rows, with_string_arguments


def trl_sft(tok: Any, rows: list[dict[str, Any]], tmp_path, marked: str | None) -> list[tuple[list[int], list[bool]]]:
    """(input_ids, trained) of each row by TRL 1.16's SFTTrainer._prepare_dataset (an IterableDataset, so that
    the rows reach the template as written, without Arrow's struct padding), under TRL's choice of template
    (SFTTrainer.__init__'s: get_training_chat_template's), or the ``marked`` one where TRL has none."""
    from datasets import IterableDataset
    from trl import SFTConfig
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    from trl.trainer.sft_trainer import SFTTrainer

    from chat.templates import DEFAULT_DATE, fixed_clock

    args = SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, max_length=None,
                     report_to="none", use_cpu=True, bf16=False)
    template = marked or (None if has_generation_markers(tok.chat_template) else get_training_chat_template(tok))
    trainer = SimpleNamespace(chat_template=template, _tokenizer=tok, completion_only_loss=False, args=args,
                              _signature_columns=None)
    data = IterableDataset.from_generator(lambda: iter(rows))
    with fixed_clock(DEFAULT_DATE):  # gpt-oss writes today's date: both sides render the same day
        out = list(SFTTrainer._prepare_dataset(trainer, data, tok, args, False, None, "train"))
    return [(r["input_ids"], [label != -100 for label in r["labels"]]) for r in out]


class _Tokenizers(dict):
    """Each family's tokenizer with its real template, made when first asked for (each costs ~0.4 s)."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, name: str) -> Any:
        self[name] = family_tokenizer(self.folder, name)
        return self[name]


@pytest.fixture(scope="module")
def tokenizers(smollm2_tokenizer):
    """The families' tokenizers, by name (:class:`_Tokenizers`)."""
    return _Tokenizers(smollm2_tokenizer)


@pytest.mark.slow  # TRL's SFTTrainer module takes ~3 s to import, a family's tokenizer ~0.4 s
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tool_rows_train_what_trls_sft_trains(tokenizers, name, tmp_path):
    """Tool-call rows (calls with arguments as objects and as JSON strings, tool answers, two user turns, a
    system or developer turn, a tools column): our ids and loss mask are TRL's SFT preprocessing's, token for token;
    the tool schema is in the render, no tool output is ever trained, and every call and answer is."""
    from chat.formats import normalize
    from chat.loss_masks import tokenize_example

    ours_tok = tokenizers[name]
    family = FAMILIES[name]
    marked = None
    if family.marks:  # TRL refuses these templates; the marked one renders the very same text
        from trl.chat_template_utils import get_training_chat_template

        with pytest.raises(ValueError, match="not training-compatible"):
            get_training_chat_template(ours_tok)
        marked = marked_template(name)
        conv = tool_rows(False)[1]
        assert (ours_tok.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
                == ours_tok.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False,
                                                chat_template=marked))
    rows = tool_rows(family.developer) + (tool_rows(False)[:1] if family.developer else [])
    oracle = trl_sft(ours_tok, rows, tmp_path, marked)
    for row, (ids, trained) in zip(rows, oracle, strict=True):
        for written in (row, with_string_arguments(row)):
            our_ids, mask = tokenize_example(normalize(written, "messages"), ours_tok)
            assert our_ids.tolist() == ids, (name, written)
            assert mask.tolist() == trained, (name, written)
        text = ours_tok.decode(ids)
        said = ours_tok.decode([i for i, t in zip(ids, trained) if t])
        assert "Evaluate an arithmetic expression." in text and "Toolsaid" in text
        assert "Toolsaid" not in said and "numbers only" not in said and "37 * 48" not in said.split("1776")[-1]
        assert said.count("calculate") == sum(1 for m in row["messages"]
                                              for c in m.get("tool_calls", []) if c["function"]["name"] == "calculate")
        finals = [m["content"] for m in row["messages"] if m["role"] == "assistant" and not m.get("tool_calls")]
        assert all(f in said for f in finals)


def _bad(tmp_path, row: dict[str, Any], tok: Any, good: dict[str, Any] | None = None) -> str:
    """The one-line error of a data file whose second row is ``row`` (the first: ``good``, a tool-call row)."""
    from chat.loss_masks import tokenize_rows
    from zoo.errors import UserError

    good = good or tool_rows(False)[0]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError) as e:
        tokenize_rows([good, row], "messages", tok, None, str(path), skip_bad_rows=False)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}, row 2: "), message
    return message


def test_bad_tool_rows_are_one_line_errors_naming_the_row(tokenizers, smollm2_tokenizer, tmp_path):
    """Arguments that are not JSON, a tool message with no call before it, tools a template does not write (SmolLM2's
    ChatML), a developer turn a template drops (Qwen3), calls a template cannot write (more than one for Llama 3.1):
    each is an error naming the file, the row and the turn or column."""
    from transformers import AutoTokenizer

    qwen3 = tokenizers["qwen3"]
    good = tool_rows(False)[0]["messages"]
    not_json = [*good[:2], {**good[2], "tool_calls": [{"function": {"name": "calculate", "arguments": "{37 * 48"}}]},
                *good[3:]]
    assert "messages[2] (assistant) tool call 0 (calculate) arguments are not JSON" in _bad(
        tmp_path, {"messages": not_json}, qwen3)
    orphan = [good[1], good[3], good[4]]
    assert "messages[1] (tool) has no tool call before it" in _bad(tmp_path, {"messages": orphan}, qwen3)
    assert "column 'tools' is not JSON" in _bad(tmp_path, {"messages": good, "tools": "{calculate"}, qwen3)
    chatml = AutoTokenizer.from_pretrained(str(smollm2_tokenizer))
    plain = {"messages": [good[1], {"role": "assistant", "content": "1776"}]}
    assert "does not write the row's tools" in _bad(tmp_path, {"messages": good[1:], "tools": [CALC]}, chatml, plain)
    developer = tool_rows(True)[0]
    assert "turn 0 (developer)" in _bad(tmp_path, developer, qwen3) and "drops its content" in _bad(
        tmp_path, developer, qwen3)
    two = [*good[:2], {**good[2], "tool_calls": good[2]["tool_calls"] * 2}, *good[3:]]
    assert "only supports single tool-calls" in _bad(tmp_path, {"messages": two, "tools": [CALC]},
                                                     tokenizers["llama-3.1"])


@pytest.mark.parametrize("name,call", [
    ("llama-3.1", '{"name": "calculate", "parameters": {"expression": "37 * 48"}}<|eot_id|>'),
    ("mistral-small-3.2", '[TOOL_CALLS]calculate[CALL_ID]call00001[ARGS]{"expression": "37 * 48"}</s>')])
def test_dpo_and_kto_rows_carry_tools(tokenizers, name, call):
    """A preference pair with a tools column (chosen: the call; rejected: a guess) and the same rows as KTO's: the
    prompt ends with the tool schema written into it, each answer is its call or text through the end-of-turn
    token, as the family's model card writes them."""
    from chat.templates import ChatTemplate
    from prefs.pairs import normalize_pair, pair_texts
    from prefs.unpaired import tokenize_row, unpaired_rows

    tok = tokenizers[name]
    conv = tool_rows(False)[0]["messages"]
    row = {"prompt": conv[:2], "chosen": [conv[2]], "rejected": "About 1800.", "tools": [CALC]}
    pair = normalize_pair(row)
    (prompt, chosen), (prompt_r, rejected) = pair_texts(pair, tok, ChatTemplate())[0]
    assert prompt == prompt_r and "Evaluate an arithmetic expression." in prompt and "37 * 48?" in prompt
    assert chosen == call
    assert rejected.strip() == "About 1800." + tok.eos_token
    assert "Evaluate" not in pair_texts(normalize_pair({**row, "tools": None}), tok, ChatTemplate())[0][0][0]
    for kto in unpaired_rows([row], "paired"):
        prompt_ids, answer_ids, label = tokenize_row(kto, tok, ChatTemplate())
        assert "Evaluate an arithmetic expression." in tok.decode(prompt_ids)
        assert tok.decode(answer_ids).strip() == (call if label else "About 1800." + tok.eos_token)
