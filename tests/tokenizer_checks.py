"""Tokenizer checks: a text and a conversation that exercise a tokenizer, the comparison of two tokenizers on
them, and a sentencepiece vocabulary that spells a few words."""

from __future__ import annotations

MIXED = (
    "Hello, world! The café's crème brûlée costs €12.50 — naïve façade.\n"
    "日本語のテキストと한국어 문장, Ελληνικά και русский текст. Emoji: 😀🚀👍🏽\n"
    "    indented code: def f(x): return x**2  # comment\n\ttabs\tand\r\nCRLF lines...\n"
    "Numbers 1234567 and 3.14159, URLs https://example.com/a?b=c&d=e, don't won't I'm we'll.\n"
    "<|im_start|>special tokens inline<|im_end|> and <|endoftext|> too; <repo_name> user tokens.\n"
    "   leading spaces, trailing spaces   \n\n\nmultiple blank lines"
)


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one word."},
    {"role": "user", "content": "What colour is the sky on a clear day?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass? Ünïcödé, please 😀"},
]


def assert_same_tokenizer(ours, ref, text: str, conversation=None):
    """``ours`` tokenizes, decodes and names its special tokens as ``ref`` does on ``text`` (200 characters at
    least), and renders and tokenizes ``conversation`` (if given) with its chat template the same."""
    assert len(text) >= 200
    assert ours(text)["input_ids"] == ref(text)["input_ids"]
    ids = ref(text)["input_ids"]
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert len(ours) == len(ref)
    if conversation is not None:
        for gen in (False, True):
            a = ours.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
            b = ref.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
            assert a == b
            assert ours(a, add_special_tokens=False)["input_ids"] == ref(b, add_special_tokens=False)["input_ids"]
            assert ours.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=True) == \
                ref.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=True)


SPM_WORDS = ("the quick brown fox jumps over lazy dog hello world tokenizer pieces merge merges byte fallback "
          "lower upper case numbers one two three système naïve").split()


def spm_pieces(words) -> list[str]:
    """Every substring of each "\u2581word", shortest first: a sentencepiece vocabulary that spells the words."""
    pieces: list[str] = []
    for word in words:
        w = "\u2581" + word
        for n in range(1, len(w) + 1):
            for i in range(len(w) - n + 1):
                if w[i:i + n] not in pieces:
                    pieces.append(w[i:i + n])
    return sorted(pieces, key=lambda p: (len(p), p))


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a sentencepiece vocabulary: unknown, control and byte tokens, the pieces
    of SPM_WORDS and one user-defined token."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, BYTE (gguf.TokenType)
    pieces = spm_pieces(SPM_WORDS)
    tokens += pieces + ["<|user|>"]
    types += [1] * len(pieces) + [4]  # NORMAL, USER_DEFINED
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]
    return tokens, scores, types
