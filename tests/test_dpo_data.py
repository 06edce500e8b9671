"""DPO data: preference rows -> one pair row (prompt + chosen | prompt + rejected), with the SmolLM2 tokenizer."""

import json

import numpy as np
import pytest

from chat.formats import BadRow
from dpo.config import DPOConfig
from dpo.task import DPOTask
from prefs.pairs import (
    CHOSEN,
    PROMPT,
    REJECTED,
    PairTokens,
    fit_pair,
    normalize_pair,
    pair_document,
    pair_length,
    tokenize_pair,
)
from pretrain.config import load_config
from zoo.errors import UserError


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer))


@pytest.fixture
def bos_tok(tok):
    """The same tokenizer configured to prepend its BOS (<|im_start|>, id 1) to every text."""
    import copy

    from tokenizers.processors import TemplateProcessing

    t = copy.deepcopy(tok)
    t._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    assert t("a")["input_ids"][0] == 1
    return t


def _cfg(path, *extra):
    return load_config(None, ["model.path=unused", f"data.path={path}", "max_steps=1", "data.seq_len=128", *extra],
                       DPOConfig)


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


CONV = {"prompt": [{"role": "user", "content": "colour red"}],
        "chosen": [{"role": "assistant", "content": "red red"}],
        "rejected": [{"role": "assistant", "content": "blue blue"}]}


def test_conversation_answers_end_with_one_end_of_turn_and_share_the_prompt(tok):
    t = tokenize_pair(normalize_pair(CONV), tok)
    assert _decode(tok, t.chosen) == "red red<|im_end|>" and _decode(tok, t.rejected) == "blue blue<|im_end|>"
    assert (t.chosen == tok.eos_token_id).sum() == 1 and t.chosen[-1] == tok.eos_token_id
    prompt = tok.apply_chat_template(CONV["prompt"], tokenize=False, add_generation_prompt=True)
    assert _decode(tok, t.prompt) == prompt and prompt.endswith("<|im_start|>assistant\n")
    # The tokens the model sees are those of the whole rendered conversation, up to its end-of-turn.
    full = tok.apply_chat_template(CONV["prompt"] + CONV["chosen"], tokenize=False)
    assert full.startswith(_decode(tok, np.concatenate([t.prompt, t.chosen])))


def test_pair_row_layout_segments_positions_and_mask(tok):
    """The plain layout (sliding-window models): prompt + chosen | prompt + rejected, positions from 0 in each."""
    t = tokenize_pair(normalize_pair(CONV), tok)
    d = pair_document(t, shared_prompt=False)
    p, c, r = len(t.prompt), len(t.chosen), len(t.rejected)
    np.testing.assert_array_equal(d["tokens"], np.concatenate([t.prompt, t.chosen, t.prompt, t.rejected]))
    np.testing.assert_array_equal(d["tokens_segment_ids"], [CHOSEN] * (p + c) + [REJECTED] * (p + r))
    np.testing.assert_array_equal(d["tokens_positions"], list(range(p + c)) + list(range(p + r)))
    np.testing.assert_array_equal(d["loss_mask"], [0] * p + [1] * c + [0] * p + [1] * r)
    assert "tokens_prefix_ids" not in d and pair_length(t, False) == len(d["tokens"])
    # Through the batch transform: the targets trained in segment 1 are exactly the chosen answer's tokens,
    # and the first token of segment 2 is not predicted from segment 1's last.
    from zoo.data.batching import padded, to_model_batch

    b = to_model_batch({k: v[None] for k, v in padded(d, 128).items()})
    w, seg = b["weights"][0] > 0, b["segment_ids"][0]
    np.testing.assert_array_equal(b["targets"][0][w & (seg == CHOSEN)], t.chosen)
    np.testing.assert_array_equal(b["targets"][0][w & (seg == REJECTED)], t.rejected)


def test_shared_prompt_layout_holds_the_prompt_once(tok):
    """The default layout: prompt[:-1] | prompt[-1] + chosen | prompt[-1] + rejected, the answers' positions
    continuing the prompt's and both answer segments reading the prompt segment as their prefix."""
    t = tokenize_pair(normalize_pair(CONV), tok)
    d = pair_document(t)
    p, c, r = len(t.prompt), len(t.chosen), len(t.rejected)
    last = t.prompt[-1:]
    np.testing.assert_array_equal(d["tokens"], np.concatenate([t.prompt[:-1], last, t.chosen, last, t.rejected]))
    np.testing.assert_array_equal(d["tokens_segment_ids"], [PROMPT] * (p - 1) + [CHOSEN] * (1 + c) + [REJECTED] * (1 + r))
    np.testing.assert_array_equal(d["tokens_prefix_ids"], [0] * (p - 1) + [PROMPT] * (2 + c + r))
    np.testing.assert_array_equal(d["tokens_positions"],
                                  list(range(p - 1)) + list(range(p - 1, p + c)) + list(range(p - 1, p + r)))
    np.testing.assert_array_equal(d["loss_mask"], [0] * p + [1] * c + [0] + [1] * r)
    assert len(d["tokens"]) == pair_length(t) == p + c + r + 1 < pair_length(t, False)
    from zoo.data.batching import padded, to_model_batch

    b = to_model_batch({k: v[None] for k, v in padded(d, 128).items()})
    w, seg = b["weights"][0] > 0, b["segment_ids"][0]
    np.testing.assert_array_equal(b["targets"][0][w & (seg == CHOSEN)], t.chosen)
    np.testing.assert_array_equal(b["targets"][0][w & (seg == REJECTED)], t.rejected)
    np.testing.assert_array_equal(b["prefix_ids"][0], padded(d, 128)["tokens_prefix_ids"][:-1])


def test_shared_prompt_mask_gives_each_answer_exactly_its_own_context():
    """In the attention mask of a shared-prompt row, an answer token sees the prompt and its own answer's
    earlier tokens: never the other answer, never padding."""
    import jax.numpy as jnp

    from zoo.model.masks import attention_mask

    t = PairTokens(np.arange(10, 14, dtype=np.int32), np.arange(100, 103, dtype=np.int32),
                   np.arange(200, 202, dtype=np.int32))
    from zoo.data.batching import padded

    d = padded(pair_document(t), 14)  # 4 + 3 + 2 + 1 = 10 tokens, then 4 of padding
    m = np.asarray(attention_mask(jnp.asarray(d["tokens_segment_ids"][None]),
                                  prefix_ids=jnp.asarray(d["tokens_prefix_ids"][None])))[0, 0]
    ids = d["tokens"]
    seen = {int(ids[q]): sorted(int(ids[k]) for k in np.flatnonzero(m[q])) for q in range(10) if q not in (3, 7)}
    assert seen[102] == [10, 11, 12, 13, 100, 101, 102]  # the prompt, then the chosen answer so far
    assert seen[201] == [10, 11, 12, 13, 200, 201]  # the prompt (its last token: the rejected segment's copy)
    assert sorted(int(ids[k]) for k in np.flatnonzero(m[7])) == [10, 11, 12, 13]  # prompt[-1]'s second copy
    assert not m[:10, 10:].any() and m[10:, :10].sum() == 0  # padding and real tokens never meet


def test_strings_prompt_tokenized_once_eos_once_no_double_bos(bos_tok):
    t = tokenize_pair(normalize_pair({"prompt": "Say a colour:", "chosen": " red", "rejected": " blue"}), bos_tok)
    assert list(t.prompt) == [1] + bos_tok("Say a colour:", add_special_tokens=False)["input_ids"]
    assert list(t.chosen) == bos_tok(" red", add_special_tokens=False)["input_ids"] + [bos_tok.eos_token_id]
    # A prompt that already starts with the BOS gets no second one; an answer ending with EOS no second EOS.
    t = tokenize_pair(normalize_pair({"prompt": "<|im_start|>Say", "chosen": " red<|im_end|>", "rejected": " b"}),
                      bos_tok)
    assert list(t.prompt).count(1) == 1 and list(t.chosen).count(bos_tok.eos_token_id) == 1
    # Conversations: the template writes its own BOS (<|im_start|>), so none is added.
    t = tokenize_pair(normalize_pair(CONV), bos_tok)
    assert t.prompt[0] == 1 and t.prompt[1] != 1


def test_implicit_prompt_is_the_common_prefix_of_messages(tok):
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "colour red"}
    row = {"chosen": [system, user, {"role": "assistant", "content": "red red"}],
           "rejected": [system, user, {"role": "assistant", "content": "blue blue"}]}
    pair = normalize_pair(row)
    assert pair.prompt == [system, user] and pair.chosen == row["chosen"][2:]
    explicit = tokenize_pair(normalize_pair({"prompt": [system, user], "chosen": "red red",
                                             "rejected": "blue blue"}), tok)
    implicit = tokenize_pair(pair, tok)
    for a, b in zip((explicit.prompt, explicit.chosen, explicit.rejected),
                    (implicit.prompt, implicit.chosen, implicit.rejected)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("row, why", [
    ({"prompt": "p", "rejected": "b"}, "'chosen' is missing"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "identical"),
    ({"prompt": "p", "chosen": "  ", "rejected": "b"}, "'chosen' is empty"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
      "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]}, "no common prompt"),
])
def test_bad_rows(row, why):
    with pytest.raises(BadRow, match=why):
        normalize_pair(row)


def test_bad_rows_name_file_and_row_or_are_skipped(tok, tmp_path):
    good = {"prompt": "p:", "chosen": " a", "rejected": " b"}
    rows = [good, {"prompt": "p", "chosen": None, "rejected": "b"}, {"prompt": "p", "chosen": "x", "rejected": "x"},
            good]
    f = tmp_path / "prefs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = DPOTask(_cfg(f))
    src = task.load(str(f), _cfg(f))
    with pytest.raises(UserError, match=r"prefs.jsonl, line 2: field 'chosen' is missing.*skip_bad_rows"):
        task.documents(src, tok, str(f), False)
    made = task.documents(src, tok, str(f), True)
    assert made.bad == 2 and sorted(made.docs) == [0, 3]


def test_conversations_without_shared_prompt_name_the_row(tok, tmp_path):
    conv = lambda u: [{"role": "user", "content": u}, {"role": "assistant", "content": "x" + u}]  # noqa: E731
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"chosen": conv("a"), "rejected": conv("b")}) + "\n")
    task = DPOTask(_cfg(f))
    with pytest.raises(UserError, match=r"c.jsonl, line 1: .*no common prompt"):
        task.documents(task.load(str(f), _cfg(f)), tok, str(f), False)


def test_missing_columns_are_one_error(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    with pytest.raises(UserError, match="need 'chosen' and 'rejected'"):
        DPOTask(_cfg(f)).load(str(f), _cfg(f))


def test_truncation_cuts_the_prompt_from_the_left_first_then_the_answers():
    t = PairTokens(np.arange(10, 20, dtype=np.int32), np.arange(100, 104, dtype=np.int32),
                   np.arange(200, 202, dtype=np.int32))
    # The plain layout (two copies of the prompt):
    assert fit_pair(t, 26, False) == (t, False)
    cut, was_cut = fit_pair(t, 16, False)  # 2 * prompt + 6 answer tokens <= 16: the prompt keeps its last 5 tokens
    assert was_cut and list(cut.prompt) == list(range(15, 20)) and len(cut.chosen) == 4 and len(cut.rejected) == 2
    cut, _ = fit_pair(t, 6, False)  # the prompt keeps one token; the answers share the remaining 4, longer cut first
    assert list(cut.prompt) == [19] and list(cut.chosen) == [100, 101] and list(cut.rejected) == [200, 201]
    # The shared prompt (one copy, plus its last token once more): prompt + 6 + 1 tokens.
    assert fit_pair(t, 17) == (t, False)
    cut, was_cut = fit_pair(t, 12)  # prompt + 6 + 1 <= 12: the prompt keeps its last 5 tokens
    assert was_cut and list(cut.prompt) == list(range(15, 20)) and len(cut.chosen) == 4 and len(cut.rejected) == 2
    cut, _ = fit_pair(t, 6)  # the prompt keeps one token; the answers share the remaining 4, longer cut first
    assert list(cut.prompt) == [19] and list(cut.chosen) == [100, 101] and list(cut.rejected) == [200, 201]
    assert pair_length(cut) == 6


def test_long_pairs_are_counted_and_truncated_or_dropped(tok, tmp_path):
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"prompt": "word " * 100, "chosen": "a", "rejected": "b"}) + "\n"
                 + json.dumps({"prompt": "short", "chosen": "a", "rejected": "b"}) + "\n")
    cfg = _cfg(f, "data.seq_len=40")
    task = DPOTask(cfg)
    made = task.documents(task.load(str(f), cfg), tok, str(f), False)
    docs = made.docs
    assert made.too_long == {0} and len(docs[0]["tokens"]) <= 41 and sorted(docs) == [0, 1]
    cfg = _cfg(f, "data.seq_len=40", "data.long_examples=drop")
    task = DPOTask(cfg)
    made = task.documents(task.load(str(f), cfg), tok, str(f), False)
    assert made.too_long == {0} and sorted(made.docs) == [1]


@pytest.mark.parametrize("override, message", [
    ("dpo.loss_type=xyz", "config key 'dpo.loss_type' is 'xyz'; choose one of sigmoid, ipo, hinge, robust, simpo"),
    ("dpo.beta=0", "config key 'dpo.beta' must be positive, got 0.0"),
    ("dpo.label_smoothing=0.5", "config key 'dpo.label_smoothing' must be in [0, 0.5), got 0.5"),
    ("dpo.reference_model=x", "dpo.reference_model is read only with dpo.reference: precomputed"),
    ("dpo.loss_type=orpo dpo.reference=base", "dpo.loss_type orpo uses no reference model (it compares the "
                                              "policy's own answers), but dpo.reference is base: remove"),
    ("dpo.loss_type=cpo dpo.reference=ckpt/ref", "dpo.loss_type cpo uses no reference model"),
    ("dpo.reference=none", "dpo.loss_type sigmoid needs a reference model: set dpo.reference to base (LoRA), "
                           "precomputed or a checkpoint path, or use a reference-free loss (orpo, cpo, simpo)"),
    ("dpo.loss_type=orpo dpo.sft_weight=0.5", "dpo.sft_weight adds RPO's NLL term, which dpo.loss_type orpo has "
                                              "built in"),
    ("dpo.loss_type=cpo dpo.cpo_alpha=-1", "config key 'dpo.cpo_alpha' must be"),
])
def test_config_validation(override, message, tmp_path):
    with pytest.raises(UserError) as e:
        _cfg(tmp_path / "d.jsonl", *override.split())
    assert message in str(e.value) and "\n" not in str(e.value)


def test_print_config_shows_the_dpo_keys(capsys):
    from dpo.cli import main

    assert main(["train", "--print-config", "model.path=m", "data.path=d.jsonl", "max_steps=1",
                 "dpo.loss_type=ipo"]) == 0
    out = capsys.readouterr().out
    assert "dpo:\n  loss_type: ipo\n  beta: 0.1\n" in out and "reference: null" in out


def test_reference_cache_key_covers_dtype_template_and_tokens():
    """A stale cache is never reused: the key changes with the params dtype, the template (its text,
    variables and date) and the tokens; it is stable for the same inputs."""
    from chat.templates import ChatTemplate
    from dpo.reference import cache_key

    doc = {"tokens": np.arange(5, dtype=np.int32), "loss_mask": np.ones(5, bool)}
    docs = {"p.jsonl": {0: doc}}
    tpl = ChatTemplate().identity()
    key = cache_key(docs, "w", "float32", "float32", tpl)
    assert key == cache_key(docs, "w", "float32", "float32", ChatTemplate().identity())
    others = [
        cache_key(docs, "w", "float32", "bfloat16", tpl),
        cache_key(docs, "w", "float32", "float32", ChatTemplate(kwargs={"enable_thinking": False}).identity()),
        cache_key(docs, "w", "float32", "float32", ChatTemplate(date="2026-12-01").identity()),
        cache_key(docs, "w", "float32", "float32", ChatTemplate(source="{{ messages }}").identity()),
        cache_key({"p.jsonl": {0: {**doc, "tokens": doc["tokens"][::-1].copy()}}}, "w", "float32", "float32", tpl),
        cache_key(docs, "w", "bfloat16", "float32", tpl),
        cache_key(docs, "v", "float32", "float32", tpl),
    ]
    assert len({key, *others}) == len(others) + 1
