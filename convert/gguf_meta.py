"""A GGUF file's model config and tokenizer, rebuilt from its metadata without torch.

transformers reads GGUF metadata through code that imports torch, which is only a
test dependency here. The same result is rebuilt from the file's header (read here,
:func:`read_header`: the one GGUF metadata reader, the model card's too) and
transformers' tokenizer classes (which need only ``tokenizers``), driven by
tables: llama.cpp metadata keys -> Hugging Face config fields, and
``tokenizer.ggml.model`` / ``tokenizer.ggml.pre`` -> how the tokenizer is built.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from convert.gguf_rope import ROPE_FREQS, ROPE_FREQS_ARCHS, llama3_scaling
from zoo.errors import UserError

# "<architecture>.<key>" metadata -> HF config field, for each GGUF architecture whose
# tensor names convert/tables.py knows (the same keys transformers' GGUF reader maps).
_LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# The other architectures' keys, less llama's rope.dimension_count (transformers ignores it for them).
_BASE_KEYS = {k: v for k, v in _LLAMA_KEYS.items() if k != "rope.dimension_count"}
# Gemma's head_dim is not hidden_size / heads: llama.cpp writes it as the key length.
_GEMMA_KEYS = {**_BASE_KEYS, "attention.key_length": "head_dim"}
CONFIG_KEYS: dict[str, dict[str, str]] = {
    "llama": _LLAMA_KEYS,
    "qwen2": _BASE_KEYS,
    # transformers drops key_length for qwen3 (its default head_dim, 128, is every released Qwen3's),
    # but llama.cpp writes it, and a file of another width could not load otherwise.
    "qwen3": {**_BASE_KEYS, "attention.key_length": "head_dim"},
    # Gemma 1 has no GGUF support in transformers: these are what llama.cpp writes for it.
    "gemma": _GEMMA_KEYS,
    # llama.cpp writes Gemma 2's soft-caps; transformers ignores them (falling back to 50 / 30, the
    # released models' values), which breaks any other file.
    "gemma2": {**_GEMMA_KEYS, "attention.sliding_window": "sliding_window",
               "attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    # Gemma 3 files give only the global RoPE base; the local base and the sliding pattern are the
    # config class's defaults. A dotted field is a key of a nested dict: llama.cpp writes the linear
    # RoPE scaling of Gemma 3 4B and up (global layers only, as transformers applies rope_scaling);
    # transformers' GGUF reader drops it.
    "gemma3": {**_GEMMA_KEYS, "attention.sliding_window": "sliding_window",
               "rope.scaling.type": "rope_scaling.rope_type", "rope.scaling.factor": "rope_scaling.factor"},
    # Qwen3-MoE: every layer MoE. transformers' GGUF reader drops expert_feed_forward_length (falling back to
    # 768, Qwen3-30B-A3B's), which llama.cpp writes.
    "qwen3moe": {**_BASE_KEYS, "attention.key_length": "head_dim", "expert_count": "num_experts",
                 "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size"},
}
# gpt-oss, as llama.cpp's convert_hf_to_gguf.py writes it: experts, window and YaRN (its scaling type, factor
# and original context; the betas are GptOssConfig's defaults).
CONFIG_KEYS["gpt-oss"] = {**_BASE_KEYS, "attention.key_length": "head_dim",
                          "attention.sliding_window": "sliding_window", "expert_count": "num_local_experts",
                          "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "intermediate_size",
                          "rope.scaling.type": "rope_scaling.rope_type", "rope.scaling.factor": "rope_scaling.factor",
                          "rope.scaling.original_context_length": "rope_scaling.original_max_position_embeddings"}
# MiniMax-M2, as llama.cpp's MiniMaxM2Model writes it: the experts' width as expert_feed_forward_length (its
# intermediate_size, also written as feed_forward_length), partial RoPE as rope.dimension_count (rotary_dim).
CONFIG_KEYS["minimax-m2"] = {**_BASE_KEYS, "attention.key_length": "head_dim", "expert_count": "num_local_experts",
                             "expert_used_count": "num_experts_per_tok",
                             "expert_feed_forward_length": "intermediate_size", "rope.dimension_count": "rotary_dim"}
# Llama 4's text model, as llama.cpp's Llama4Model writes it: feed_forward_length is the dense layers' MLP
# (intermediate_size_mlp), expert_feed_forward_length the experts' (intermediate_size), the MoE layers every
# interleave_moe_layer_step-th.
CONFIG_KEYS["llama4"] = {**_LLAMA_KEYS, "feed_forward_length": "intermediate_size_mlp",
                         "attention.key_length": "head_dim", "expert_count": "num_local_experts",
                         "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "intermediate_size",
                         "interleave_moe_layer_step": "interleave_moe_layer_step"}
# Qwen3-Next, as llama.cpp's Qwen3NextModel writes it: Qwen2-MoE's keys (the shared expert's width too), the linear
# layers' dims as its ssm.* keys (state_size: k_dim, group_count: key heads, time_step_rank: value heads; the value
# heads' width and the partial rotary are derived: CONFIG_DERIVED), the full layers' interval.
CONFIG_KEYS["qwen3next"] = {**_BASE_KEYS, "attention.key_length": "head_dim", "expert_count": "num_experts",
                            "expert_used_count": "num_experts_per_tok",
                            "expert_feed_forward_length": "moe_intermediate_size",
                            "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
                            "ssm.conv_kernel": "linear_conv_kernel_dim", "ssm.state_size": "linear_key_head_dim",
                            "ssm.group_count": "linear_num_key_heads", "ssm.time_step_rank": "linear_num_value_heads",
                            "full_attention_interval": "full_attention_interval"}
# Settings a file cannot state, as the architecture's released models have them (dotted: a key of a nested dict,
# set only where the file gives that dict): gpt-oss's YaRN does not round its correction range (its config.json's
# truncate: false), whatever llama.cpp's own RoPE does.
ARCH_SETTINGS: dict[str, dict[str, Any]] = {"gpt-oss": {"rope_scaling.truncate": False}}

# GGUF architecture -> HF model_type, where they differ (a Gemma 3 file holds only the text model).
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
               "llama4": "llama4_text", "qwen3next": "qwen3_next"}
# Config fields a GGUF file of the architecture implies without a key: llama.cpp's qwen3moe graph always
# renormalizes the top-k routing weights (as transformers' GGUF reader sets too).
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {"qwen3moe": {"norm_topk_prob": True},
                                              "qwen3next": {"norm_topk_prob": True}}
# llama.cpp's llama4 graph fixes what a file cannot say (src/llama-model.cpp): chunked attention of 8192 on three
# layers of four, the fourth NoPE with the attention temperature (floor 8192, scale 0.1).
CONFIG_DEFAULTS["llama4"] = {"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "attn_temperature_tuning": True,
                             "floor_scale": 8192, "attn_scale": 0.1}


def _qwen3_next_derived(meta: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's value heads' width (ssm.inner_size over the value heads) and partial rotary
    (rope.dimension_count over head_dim)."""
    out: dict[str, Any] = {}
    inner, heads = meta.get("qwen3next.ssm.inner_size"), raw.get("linear_num_value_heads")
    if inner is not None and heads:
        out["linear_value_head_dim"] = int(inner) // int(heads)
    rope, head_dim = meta.get("qwen3next.rope.dimension_count"), raw.get("head_dim")
    if rope is not None and head_dim:
        out["partial_rotary_factor"] = int(rope) / int(head_dim)
    return out


# Config fields a file of the architecture gives only through others, from (the file's metadata, the config read so
# far): llama.cpp's llama4 graph normalizes q and k on every model but the 128-expert one (Maverick: use_qk_norm
# false); Qwen3-Next's derived widths.
CONFIG_DERIVED: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "llama4": lambda meta, raw: {"use_qk_norm": raw.get("num_local_experts") != 128},
    "qwen3next": _qwen3_next_derived,
}


# Special token ids: HF config field <- tokenizer metadata key.
TOKEN_ID_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "unk_token_id": "tokenizer.ggml.unknown_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
# Special tokens of the tokenizer: name <- id metadata key.
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
# Tokenizer settings: tokenizer_config field <- metadata key.
TOKENIZER_CONFIG_KEYS = {
    "chat_template": "tokenizer.chat_template",
    "add_bos_token": "tokenizer.ggml.add_bos_token",
    "add_eos_token": "tokenizer.ggml.add_eos_token",
}
# llama.cpp token types (gguf.TokenType) that are added tokens, matched whole in text.
CONTROL, USER_DEFINED = 3, 4

# How text is split before byte-level BPE, by `tokenizer.ggml.pre` (unlisted: GPT-2's own split).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's split (o200k): cased words with their contractions, digits in threes; Llama 4's tokenizer splits so
# (transformers' GGUF tokenizer mapping reads llama.cpp's "llama4" as this regex too).
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama4": _GPT4O_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "minimax-m2": _GPT4O_SPLIT,  # MiniMax-M2's tokenizer splits as GPT-4o's (transformers' GGUF mapping too)
}

# Only these array fields are needed whole; other arrays are skipped when reading.
_ARRAY_KEYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores"}


# GGUF metadata value types (the GGUF spec's gguf_metadata_value_type): the numpy type of each fixed-size one
# (without its byte order), 8 a string, 9 an array.
_GGUF_NUMBERS = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "b1", 10: "u8", 11: "i8", 12: "f8"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Header:
    """A GGUF file's header read in order: its key-value pairs, each value read or skipped unread."""

    def __init__(self, f: BinaryIO):
        self.f = f
        magic = f.read(4)
        (version,) = struct.unpack("<I", f.read(4))
        if magic != b"GGUF":
            raise ValueError("not a GGUF file")
        # A big-endian file's version reads byte-swapped (gguf's GGUFReader tells them apart the same way).
        self.order = ">" if version & 0xFFFF == 0 else "<"
        version = version if self.order == "<" else struct.unpack(">I", struct.pack("<I", version))[0]
        if version < 2:
            raise ValueError(f"GGUF version {version} (lmzoo reads 2 and later)")
        self.tensors, self.pairs = struct.unpack(self.order + "QQ", f.read(16))

    def _u(self, fmt: str) -> int:
        return struct.unpack(self.order + fmt, self.f.read(struct.calcsize(fmt)))[0]

    def key(self) -> tuple[str, int]:
        """The next pair's key and value type."""
        return self.string().decode("utf-8", "replace"), self._u("I")

    def string(self) -> bytes:
        return bytes(self.f.read(self._u("Q")))

    def value(self, kind: int) -> Any:
        """A value of type ``kind`` as gguf's ``ReaderField.contents()`` gives it (an array: a list); a string
        that is not UTF-8 is a UnicodeDecodeError, after the value is read."""
        if kind == _GGUF_STRING:
            return self.string().decode("utf-8")
        if kind == _GGUF_ARRAY:
            item, count = self._u("I"), self._u("Q")
            if item in _GGUF_NUMBERS:
                dtype = np.dtype(self.order + _GGUF_NUMBERS[item])
                return np.frombuffer(self.f.read(dtype.itemsize * count), dtype).tolist()
            items = [self.string() if item == _GGUF_STRING else self.value(item) for _ in range(count)]
            return [x.decode("utf-8") for x in items] if item == _GGUF_STRING else items
        dtype = np.dtype(self.order + _GGUF_NUMBERS[kind])
        return np.frombuffer(self.f.read(dtype.itemsize), dtype).tolist()[0]

    def skip(self, kind: int) -> None:
        """Pass a value of type ``kind`` unread."""
        if kind == _GGUF_STRING:
            self.f.seek(self._u("Q"), 1)
        elif kind == _GGUF_ARRAY:
            item, count = self._u("I"), self._u("Q")
            if item in _GGUF_NUMBERS:
                self.f.seek(np.dtype(_GGUF_NUMBERS[item]).itemsize * count, 1)
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            self.f.seek(np.dtype(_GGUF_NUMBERS[kind]).itemsize, 1)


def read_header(path: str | Path, arrays: Container[str] = (), until: str | None = None) -> dict[str, Any]:
    """The metadata of GGUF file ``path`` as plain Python values, read from its header alone: arrays only those
    named in ``arrays`` (the others skipped unread: a tokenizer's vocabulary is most of a header), up to the key
    ``until`` when given. A value that is not valid UTF-8 is left out, as transformers leaves a malformed optional
    field out. A file that is not GGUF, or is cut short: ValueError, struct.error or OSError."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        header = _Header(f)
        for _ in range(header.pairs):
            key, kind = header.key()
            if kind == _GGUF_ARRAY and key not in arrays:
                header.skip(kind)
            else:
                try:
                    out[key] = header.value(kind)
                except UnicodeDecodeError:
                    pass
            if key == until:
                break
    return out


def header_string(path: Path, key: str) -> str | None:
    """A string key of a GGUF file's metadata (``general.license``), or None (no such file, key or string):
    the header read up to ``key`` only."""
    try:
        value = read_header(path, until=key).get(key)
    except (OSError, ValueError, KeyError, struct.error):  # unreadable or cut short: the card only loses a line
        return None
    return value if isinstance(value, str) and value else None


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of GGUF file ``path`` that a conversion reads: every key, the tokenizer's arrays whole."""
    try:
        return read_header(path, _ARRAY_KEYS)
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise UserError(f"{path}: cannot read its GGUF metadata ({e})") from None


def hf_config(meta: dict[str, Any], tensor_names: list[str], where: str,
              tensor: Callable[[str], np.ndarray] | None = None) -> dict[str, Any]:
    """The Hugging Face config dict that transformers derives from this GGUF metadata; ``tensor`` reads a tensor
    of the file (a llama or llama4 file's ``rope_freqs``: its llama3 RoPE scaling, convert/gguf_rope.py)."""
    from transformers import AutoConfig

    arch = meta.get("general.architecture")
    if arch not in CONFIG_KEYS:
        raise UserError(f"{where}: GGUF architecture {arch!r} is not supported (supported: {', '.join(CONFIG_KEYS)})")
    raw: dict[str, Any] = {
        "model_type": MODEL_TYPES.get(arch, arch),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if "general.name" in meta:
        raw["_model_name_or_path"] = meta["general.name"]
    for key, field in CONFIG_KEYS[arch].items():
        if f"{arch}.{key}" not in meta:
            continue
        outer, _, inner = field.partition(".")
        if inner:
            raw.setdefault(outer, {})[inner] = meta[f"{arch}.{key}"]
        else:
            raw[field] = meta[f"{arch}.{key}"]
    if arch == "llama4" and meta.get("llama4.attention.sliding_window") == 0:
        raise UserError(f"{where}: a llama4 GGUF file with attention.sliding_window 0 (every layer full attention, "
                        "RoPE on all) is not supported; convert the model's safetensors checkpoint instead")
    raw.update(CONFIG_DEFAULTS.get(arch, {}))
    if arch in CONFIG_DERIVED:
        raw.update(CONFIG_DERIVED[arch](meta, raw))
    for field, value in ARCH_SETTINGS.get(arch, {}).items():
        outer, _, inner = field.partition(".")
        if outer in raw:
            raw[outer][inner] = value
    scaling = raw.pop("rope_scaling", None)
    if scaling and scaling.get("rope_type", "none") != "none":  # llama.cpp's "none" is no scaling
        raw["rope_scaling"] = scaling
    for field, key in TOKEN_ID_KEYS.items():
        if key in meta:
            raw[field] = meta[key]
    if "vocab_size" not in raw and "tokenizer.ggml.tokens" in meta:
        raw["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    missing = [f for f in ("hidden_size", "num_hidden_layers", "num_attention_heads") if f not in raw]
    if missing:
        raise UserError(f"{where}: GGUF metadata lacks {', '.join(f'{arch}.*' + ' for ' + m for m in missing)}")
    # llama3 scaling: its parameters back from the tensor, which the conversion then leaves unread
    if arch in ROPE_FREQS_ARCHS and ROPE_FREQS in tensor_names:
        if tensor is None:
            raise ValueError(f"{where}: {ROPE_FREQS} needs the file's tensors to be read")
        raw["rope_scaling"] = llama3_scaling(tensor(ROPE_FREQS), raw, meta, arch, where)
    config = AutoConfig.for_model(**raw).to_dict()
    config["_name_or_path"] = str(Path(where).parent)
    return config


def _byte_level_bpe(meta: dict[str, Any]):
    """GPT-2-style byte-level BPE (tokenizer.ggml.model = gpt2)."""
    from transformers import GPT2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens are stored in the byte alphabet, except added ones written as plain text.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(meta["tokenizer.ggml.tokens"])
    }
    # transformers annotates merges as str | list[str], but hands them to tokenizers' BPE, which takes pairs
    return GPT2Tokenizer(vocab=vocab, merges=_merges(meta, vocab))  # type: ignore[arg-type]


def _sentencepiece_bpe(meta: dict[str, Any]):
    """Llama / Mistral sentencepiece BPE with byte fallback (tokenizer.ggml.model = llama)."""
    from transformers import LlamaTokenizer

    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    return LlamaTokenizer(vocab=vocab, merges=_merges(meta, vocab))


def _gemma_sentencepiece(meta: dict[str, Any]):
    """Gemma's sentencepiece BPE (tokenizer.ggml.model = llama in a gemma* file), as transformers rebuilds it.

    A token of two or more spaces is stored as real spaces, where GemmaTokenizer looks it up as
    ``\u2581\u2581``: such tokens are respelled. The merges are rebuilt best-first in the order the tokens
    appear in the file, since Gemma's scores do not follow its merge order.
    """
    from transformers import GemmaTokenizer

    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in meta["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    order = {t: -float(i) for i, t in enumerate(tokens)}
    merges = _merges({**meta, "tokenizer.ggml.tokens": tokens}, vocab, order)
    # transformers annotates merges as str | list[str], but hands them to tokenizers' BPE, which takes pairs
    return GemmaTokenizer(vocab=vocab, merges=merges)  # type: ignore[arg-type]


def _merges(meta: dict[str, Any], vocab: dict[str, int],
            scores: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """The file's merges, or (sentencepiece files list none) those its vocabulary and ``scores`` (default:
    the file's token scores) imply."""
    if "tokenizer.ggml.merges" in meta:
        return [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    from transformers.tokenization_utils_base import generate_merges

    if scores is None:
        scores = dict(zip(meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores") or [0.0] * len(vocab)))
    return generate_merges(vocab, scores)


TOKENIZER_BUILDERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece_bpe,
}
# (architecture, tokenizer.ggml.model) whose vocabulary needs its own builder, as transformers picks one.
ARCH_TOKENIZER_BUILDERS: dict[tuple[str, str], Callable[[dict[str, Any]], Any]] = {
    (arch, "llama"): _gemma_sentencepiece for arch in ("gemma", "gemma2", "gemma3")
}
# What llama.cpp assumes when a file does not say whether to add BOS.
ADD_BOS_DEFAULT = {"gpt2": False, "llama": True}


def build_tokenizer(meta: dict[str, Any], where: str):
    """A transformers fast tokenizer (with chat template) rebuilt from ``tokenizer.ggml.*``."""
    from tokenizers import AddedToken, Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_BUILDERS or "tokenizer.ggml.tokens" not in meta:
        raise UserError(f"{where}: GGUF tokenizer {kind!r} is not supported (supported: {', '.join(TOKENIZER_BUILDERS)})")
    builder = ARCH_TOKENIZER_BUILDERS.get((meta.get("general.architecture", ""), kind), TOKENIZER_BUILDERS[kind])
    tok = builder(meta)
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    # A control token outside the byte alphabet of a byte-level vocabulary is a llama.cpp mislabel;
    # adding it would grow the vocabulary past the embedding matrix.
    spelled = set(bytes_to_unicode().values()) if kind == "gpt2" else None
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == CONTROL and (spelled is None or set(t) <= spelled)]
    if control:
        tok.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    known = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
            if k == USER_DEFINED and t in known]
    if user:
        tok.add_tokens(user)
    backend = tok.backend_tokenizer
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    settings: dict[str, Any] = {"add_bos_token": ADD_BOS_DEFAULT[kind]}
    for name, key in TOKENIZER_CONFIG_KEYS.items():
        if key in meta:
            settings[name] = meta[key]
    for name, key in SPECIAL_TOKEN_KEYS.items():
        settings[name] = tokens[meta[key]] if key in meta else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings)
