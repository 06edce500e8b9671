"""The training tests' tiny LM and its tokenizer: a byte-level BPE tokenizer of 512 ids shaped like SmolLM2's
and a tiny random Llama of its vocabulary, built once per session (conftest.py's ``tiny_lm``) and copied into a
module's own folder."""

from __future__ import annotations

import json
from pathlib import Path

from tests.hf_models import make_llama
from tests.run_files import TEN_WORDS, write_word_texts

# The training tests' model: a tiny Llama of a 512-id tokenizer (tiny_lm_zoo): its head and loss cost next to
# nothing, where SmolLM2's 49152-id vocabulary made them most of every step.
TINY_LM = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1)
TINY_VOCAB = 512
# Words the training tests write, so that the small vocabulary spells them in a few tokens each.
TINY_WORDS = ("the a cat dog sat ran on under mat log red blue big small quickly slowly and then green yellow black "
              "white circle square triangle star colour color Repeat What is Answer with just number name age city "
              "You are careful assistant. Read user's repeat it twice, nothing else.")


def small_vocab_tokenizer(folder: Path, like: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` ids saved at ``folder`` as a transformers tokenizer folder:
    trained (the `tokenizers` library; deterministic) on the demo's data (demo/data/*.jsonl) and TINY_WORDS, with
    the special tokens (same ids), pre-tokenizer, decoder, tokenizer settings and chat template of the tokenizer
    folder ``like`` (SmolLM2's), so chat templates, special tokens and byte-level decoding behave as with it."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    def strings(x):
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict | list):
            for v in x.values() if isinstance(x, dict) else x:
                yield from strings(v)

    real = Tokenizer.from_file(str(like / "tokenizer.json"))
    added = json.loads((like / "tokenizer.json").read_text())["added_tokens"]
    specials = [t["content"] for t in sorted(added, key=lambda t: t["id"])]
    assert [t["id"] for t in added] == list(range(len(added)))  # they keep their ids: the first ones
    texts = [TINY_WORDS] * 100
    for data in sorted((Path(__file__).resolve().parent.parent / "demo" / "data").glob("*.jsonl")):
        for line in data.read_text().splitlines():
            texts.extend(strings(json.loads(line)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder, tok.post_processor = real.pre_tokenizer, real.decoder, real.post_processor
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tok.get_vocab_size() == vocab_size
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (like / name).is_file():
            shutil.copy(like / name, folder / name)


def tiny_lm_zoo(root: Path, like: Path):
    """The small-vocabulary tokenizer (:func:`small_vocab_tokenizer`, shaped like the tokenizer folder ``like``)
    saved at ``root/tok`` and a tiny random Llama of its vocabulary (TINY_LM, seed 0) saved at ``root/hf`` and
    converted to a zoo checkpoint at ``root/zoo``: the model the training tests share (built once per session by
    conftest.py's ``tiny_lm``; see :func:`copy_tiny_lm`). Returns the tokenizer."""
    from transformers import AutoTokenizer

    from zoo.cli import main as zoo_main

    small_vocab_tokenizer(root / "tok", like)
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    make_llama(root / "hf", vocab_size=len(tok), **TINY_LM)
    assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    return tok


def copy_tiny_lm(shared: Path, root: Path, names=("tok", "hf", "zoo")):
    """Copy the session's :func:`tiny_lm_zoo` folders (conftest.py's ``tiny_lm``) into a module's own ``root``
    (a few hundred KB: the module may write beside them and into them). Returns the tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(shared / name, root / name)
    return AutoTokenizer.from_pretrained(str(root / "tok"))


def tiny_run_folder(tmp_path_factory, shared: Path, name: str, words=TEN_WORDS, rows: int = 100) -> Path:
    """A module's own folder (``name``) with the session's tiny model (:func:`copy_tiny_lm`) and ``data.jsonl``:
    ``rows`` pretraining texts of ``words`` (tests/run_files.py: write_word_texts)."""
    root = tmp_path_factory.mktemp(name)
    copy_tiny_lm(shared, root)
    write_word_texts(root / "data.jsonl", list(words), rows)
    return root
