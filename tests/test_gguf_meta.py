"""GGUF config and tokenizer rebuilt without torch (convert/gguf_meta) against transformers' own GGUF reading."""

from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer

from convert.source import open_source
from tests.hf_models import quick_gguf_loading
from tests.tokenizer_checks import CONVERSATION, MIXED, assert_same_tokenizer, spm_vocab
from zoo.cli import main
from zoo.registry.catalogue import bundled_gguf as smollm2_gguf


def _reference_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _ours(path: Path, tmp_path: Path):
    src = open_source(str(path))
    src.save_tokenizer(tmp_path / "tok")
    return src.hf_config, AutoTokenizer.from_pretrained(str(tmp_path / "tok"))


@pytest.mark.slow
def test_smollm2_config_and_tokenizer_match_transformers(smollm2_source, smollm2_tokenizer):
    """Slow (slow lane): transformers reads the whole 49,152-entry vocabulary from the GGUF file twice (its config,
    its tokenizer): through tests/hf_models.py's quick_gguf_loading, the gguf package's reader on a plain view of
    the same bytes (4 s against 12 s)."""
    path = smollm2_gguf()
    # Ours: what _ours() gives, the file opened and the tokenizer rebuilt once per session (conftest.py).
    config, ours = smollm2_source.hf_config, AutoTokenizer.from_pretrained(str(smollm2_tokenizer))
    with quick_gguf_loading():
        assert config == AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
        ref = _reference_tokenizer(path)
    assert_same_tokenizer(ours, ref, MIXED, CONVERSATION)
    # The chat template carries the system turn, and there is exactly one BOS-free start.
    text = ours.apply_chat_template(CONVERSATION, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a terse") and text.count("<|im_start|>") == 4
    assert ours("hi")["input_ids"] == ref("hi")["input_ids"] and ours.bos_token_id not in ours("hi")["input_ids"]


def test_checkpoint_tokenizer_is_the_rebuilt_one(smollm2_source, smollm2_tokenizer):
    # convert writes the rebuilt tokenizer into the checkpoint (no torch on the way): open_source(...).save_tokenizer,
    # done once per session into smollm2_tokenizer (conftest.py).
    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer))
    assert tok.chat_template == smollm2_source.reader.reader.fields["tokenizer.chat_template"].contents()


# --- files written here, to reach the other table rows (sentencepiece vocabularies, split regexes, untied heads)

def _write_gguf(path: Path, tokenizer: str, tokens, types, *, scores=None, merges=None, pre=None,
                add_bos=None, untied=False) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(8)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(tokenizer)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    if untied:
        w.add_tensor("output.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPM_TEXT = ("the quick brown fox jumps over the lazy dog; hello world! système naïve "
            "Ünknown ćhars → bytes 😀, numbers one two three 123, <|user|> inline, "
            "  double  spaces and\nnew lines\n") * 2


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    tokens, scores, types = spm_vocab()
    path = _write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, untied=True)
    config, ours = _ours(path, tmp_path)
    assert config == AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == len(tokens)
    ref = _reference_tokenizer(path)
    assert_same_tokenizer(ours, ref, SPM_TEXT, CONVERSATION[:3])
    # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise: exactly one.
    assert ours("the fox")["input_ids"].count(1) == 1 and ours("the fox")["input_ids"][0] == 1


@pytest.mark.slow
def test_byte_level_split_regex_and_user_tokens_match_transformers(smollm2_source, tmp_path):
    smol = smollm2_source.reader.reader  # the gguf package's GGUFReader of the SmolLM2 file, read once (conftest.py)
    # SmolLM2's first 2,252 tokens (its specials, its whole byte alphabet: ids 17-251, then merged pieces in merge
    # order) and the merges among them: the same regex, specials and byte-level BPE, at a twentieth of the
    # vocabulary both sides read and build (three times each) from the file.
    tokens = smol.fields["tokenizer.ggml.tokens"].contents()[:2252]
    kept = set(tokens)
    merges = [m for m in smol.fields["tokenizer.ggml.merges"].contents()
              if {*m.split(" "), m.replace(" ", "")} <= kept]
    assert len(merges) >= 1900
    types = smol.fields["tokenizer.ggml.token_type"].contents()[:2252]
    types[3] = 4  # <repo_name> as a user-defined (non-special) token
    path = _write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=merges, pre="llama-bpe", add_bos=True)
    config, ours = _ours(path, tmp_path)
    assert config == AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    assert config["tie_word_embeddings"] is True
    ref = _reference_tokenizer(path)
    assert_same_tokenizer(ours, ref, MIXED, CONVERSATION)
    assert ours("x")["input_ids"][0] == 1  # add_bos_token from the file


def test_unsupported_gguf_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["convert", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rwkv6" in err and "llama" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["tokenizer.ggml.model"])
def test_unsupported_tokenizer_is_a_clear_error(tmp_path, key):
    from convert.gguf_meta import build_tokenizer
    from zoo.errors import UserError

    with pytest.raises(UserError, match="tokenizer 'bert' is not supported"):
        build_tokenizer({key: "bert", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")
