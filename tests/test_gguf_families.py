"""GGUF files of the gemma, gemma2, gemma3, qwen2 and qwen3 architectures: config, tokenizer and weights.

Each file is written here, with the ``gguf`` package's writer, from a tiny random transformers model of
its family, following llama.cpp's convert_hf_to_gguf.py: its tensor names, Gemma's norms stored as
``w + 1``, Gemma 3's embedding cut to the tokenizer's length and only its global RoPE base, Gemma 2's
soft-caps and window, no ``output.weight`` for a tied model, and the MLP weights quantized to Q8_0
(the rest F32). That writer is independent of convert/tables.py and convert/transforms.py, so a wrong
table or transform cannot agree with it by construction.

The oracles: transformers' own GGUF loading of the same file (gemma2, gemma3, qwen2, qwen3), and the model
the file was written from with its Q8_0 weights replaced by their dequantized values (all five). transformers
has no GGUF support for Gemma 1 at all, so that model is gemma's only oracle; and its GGUF reader drops a
few keys llama.cpp writes (``TRANSFORMERS_DROPS``), which its loader is given back as overrides.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GemmaTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

import zoo
from convert.gguf_meta import hf_config
from convert.readers import GGUFFile
from convert.source import open_source
from tests.hf_models import hf_logits, make_hf, quick_gguf_loading, random_tokens
from tests.processes import REPO, TEST_ONLY
from tests.tokenizer_checks import CONVERSATION, MIXED, assert_same_tokenizer, spm_pieces
from zoo.checkpoints.format import TOKENIZER_DIR, read_meta
from zoo.checkpoints.readers import load_param_numpy
from zoo.cli import main
from zoo.model.from_hf import model_config_from_hf

FAMILIES = ["gemma", "gemma2", "gemma3", "qwen2", "qwen3"]
SEQ = 40  # longer than the sliding window (7)

# Settings a GGUF file cannot state are left at what the released models use (and transformers'
# defaults): Gemma's query_pre_attn_scalar 256, Gemma 3's RoPE per layer type and sliding pattern,
# no Qwen 2 sliding window. The MLP width is a multiple of Q8_0's 32-wide blocks.
HF_SETTINGS = {
    "gemma": dict(intermediate_size=128),
    "gemma2": dict(intermediate_size=128, query_pre_attn_scalar=256),
    "gemma3": dict(intermediate_size=128, query_pre_attn_scalar=256, final_logit_softcapping=None,
                   layer_types=None, rope_parameters=None),
    "qwen2": dict(intermediate_size=128, use_sliding_window=False, tie_word_embeddings=False),
    "qwen3": dict(intermediate_size=128, tie_word_embeddings=True),
}
# Gemma 3's config vocabulary is larger than its tokenizer: llama.cpp cuts the embedding to the tokenizer.
EXTRA_VOCAB = {"gemma3": 19}
# Keys llama.cpp writes that transformers' GGUF reader ignores (falling back to its config class's
# defaults: soft-caps 50 / 30, head_dim 128): its loader is given the file's values.
TRANSFORMERS_DROPS = {"gemma2": ("attn_logit_softcapping", "final_logit_softcapping"), "qwen3": ("head_dim",)}
QUANTIZED = {"ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q8_0}

# --- the vocabularies: a sentencepiece one for Gemma, a byte-level BPE one for Qwen

_WORDS = ("the quick brown fox jumps over lazy dog hello world tokenizer pieces merge merges byte fallback "
          "lower upper case numbers one two three système naïve").split()


def _gemma_vocab() -> tuple[list[str], list[float], list[int]]:
    """Gemma's layout: <pad> <eos> <bos> <unk>, turn markers, byte tokens, whitespace runs stored as real
    spaces (as Gemma files do), then pieces. Scores are shuffled: Gemma's do not follow its merge order."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]  # gguf.TokenType: CONTROL, UNKNOWN
    tokens += [f"<0x{b:02X}>" for b in range(256)] + ["  ", "   ", "    "]
    types += [6] * 256 + [1] * 3  # BYTE, NORMAL
    pieces = spm_pieces(_WORDS)
    scores = [0.0] * len(tokens) + [0.0] * len(pieces)
    for i, s in enumerate(np.random.RandomState(0).permutation(len(pieces) + 3)):
        scores[len(tokens) - 3 + i] = -float(s)
    return tokens + pieces, scores, types + [1] * len(pieces)


def _qwen_vocab() -> tuple[list[str], list[str], list[int]]:
    """Byte-level BPE in the GPT-2 byte alphabet: the 256 bytes, words merged left to right, ChatML tokens."""
    spell = bytes_to_unicode()
    tokens, merges = [spell[b] for b in range(256)], []
    for word in _WORDS:
        for text in (" " + word, word):
            chars = [spell[b] for b in text.encode("utf-8")]
            cur = chars[0]
            for ch in chars[1:]:
                if f"{cur} {ch}" not in merges:
                    merges.append(f"{cur} {ch}")
                cur += ch
                if cur not in tokens:
                    tokens.append(cur)
    types = [1] * len(tokens) + [3, 3, 3]
    return tokens + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], merges, types


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# --- llama.cpp's writing of a Hugging Face model (convert_hf_to_gguf.py), by hand

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str, post_norms: bool) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    if module == "post_attention_layernorm":  # the pre-MLP norm, unless the family has post-norms
        return f"blk.{i}.{'post_attention_norm' if post_norms else 'ffn_norm'}.{leaf}"
    return f"blk.{i}.{_LAYER_NAMES[module]}.{leaf}"


@dataclasses.dataclass
class Written:
    """A GGUF file and the model it was written from."""

    family: str
    path: Path
    hf: torch.nn.Module  # with each quantized tensor replaced by its dequantized values
    tokens: int  # the tokenizer's length (the file's vocabulary)


def write_gguf(family: str, folder: Path) -> Written:
    """A tiny random ``family`` model saved to ``folder/hf`` and written as ``folder/FAMILY.gguf``."""
    gemma = family.startswith("gemma")
    if gemma:
        tokens, scores, types = _gemma_vocab()
    else:
        tokens, merges, types = _qwen_vocab()
    hf = make_hf(folder / "hf", family, vocab_size=len(tokens) + EXTRA_VOCAB.get(family, 0), **HF_SETTINGS[family])
    c = hf.config
    path = folder / f"{family}.gguf"
    w = gguf.GGUFWriter(str(path), family)
    w.add_name(f"tiny-{family}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if family != "qwen2":  # written when the HF config sets head_dim
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if family in ("gemma3", "qwen2", "qwen3"):  # Gemma 1/2 files leave llama.cpp's default base
        rope = c.rope_parameters
        w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # Gemma 3: the global base only
    if family == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if family in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
    if gemma:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)
        w.add_chat_template(GEMMA_TEMPLATE)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    state = hf.state_dict()
    for name, p in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = p.detach().float().numpy().copy()
        if gemma and name.endswith("norm.weight"):
            x = x + 1  # Gemma's RMSNorm scales by (1 + w): llama.cpp stores the factor
        if family == "gemma3" and name == "model.embed_tokens.weight":
            x = x[:len(tokens)]
        g = _gguf_name(name, post_norms=family in ("gemma2", "gemma3"))
        qtype = QUANTIZED.get(g.split(".")[-2], Q.F32) if g.startswith("blk.") else Q.F32
        if qtype == Q.F32:
            w.add_tensor(g, x.astype(np.float32))
        else:
            raw = gguf.quants.quantize(x, qtype)
            w.add_tensor(g, raw, raw_dtype=qtype)
            with torch.no_grad():
                p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(x.shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Written(family, path, hf, len(tokens))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Written]:
    root = tmp_path_factory.mktemp("gguf_families")
    return {f: write_gguf(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def converted(files) -> dict[str, Path]:
    """Each file converted once (`zoo convert`), shared by the tests below."""
    out = {}
    for f, w in files.items():
        out[f] = w.path.parent / "zoo"
        assert main(["convert", str(w.path), "--out", str(out[f])]) == 0
    return out


def _transformers_gguf(w: Written):
    """transformers' own loading of the file, given back the keys its GGUF reader drops."""
    fixes = {k: getattr(w.hf.config, k) for k in TRANSFORMERS_DROPS.get(w.family, ())}
    with quick_gguf_loading():
        model = AutoModelForCausalLM.from_pretrained(str(w.path.parent), gguf_file=w.path.name, dtype=torch.float32,
                                                     **fixes).eval()
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_config_matches_transformers_and_the_source_model(files, family):
    w = files[family]
    ours = open_source(str(w.path)).hf_config
    if family != "gemma":  # transformers reads no Gemma 1 GGUF config
        fixes = {k: getattr(w.hf.config, k) for k in TRANSFORMERS_DROPS.get(family, ())}
        assert ours == AutoConfig.from_pretrained(str(w.path.parent), gguf_file=w.path.name, **fixes).to_dict()
    # The model the converter derives is the source model's, with the file's vocabulary (and its float32 eps).
    source = model_config_from_hf(json.loads((w.path.parent / "hf" / "config.json").read_text()))
    want = dataclasses.replace(source, vocab_size=w.tokens, rms_norm_eps=float(np.float32(source.rms_norm_eps)))
    assert model_config_from_hf(ours) == want


def test_gemma3_linear_rope_scaling_is_read():
    """Gemma 3 4B and up: llama.cpp writes the global layers' linear RoPE scaling (transformers drops it)."""
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 64, "gemma3.block_count": 7,
            "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 2, "gemma3.attention.key_length": 16,
            "gemma3.feed_forward_length": 128, "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 7,
            "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0, "gemma3.vocab_size": 96}
    cfg = model_config_from_hf(hf_config(meta, ["token_embd.weight"], "x.gguf"))
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, 1e6)
    assert (cfg.rope_local.kind, cfg.rope_local.theta) == ("default", 10000.0)
    assert cfg.kinds == ("sliding",) * 5 + ("full", "sliding")
    meta["gemma3.rope.scaling.type"] = "none"
    assert model_config_from_hf(hf_config(meta, ["token_embd.weight"], "x.gguf")).rope.kind == "default"


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match(files, converted, family):
    w = files[family]
    tokens = random_tokens(w.tokens, seq=SEQ)
    got = np.asarray(zoo.load(converted[family])(jnp.asarray(tokens)))
    assert got.shape[-1] == w.tokens
    # Gemma 3's source model has the rows past the tokenizer that the file leaves out.
    source = hf_logits(w.hf, tokens)[..., :w.tokens]
    assert source.std() > 0.5  # peaked enough for the comparison to have teeth
    assert np.abs(got - source).max() <= 1e-4
    if family != "gemma":
        ref = hf_logits(_transformers_gguf(w), tokens)
        assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_matches_transformers(files, converted, family):
    w = files[family]
    ours = AutoTokenizer.from_pretrained(str(converted[family] / TOKENIZER_DIR))
    if family.startswith("gemma"):
        # transformers tokenizes a Gemma 1 file too, though it loads no Gemma 1 GGUF model.
        ref = GemmaTokenizer.from_pretrained(str(w.path.parent), gguf_file=w.path.name)
        text = ("the quick brown fox jumps over the lazy dog; hello world! système naïve Ünknown → 😀 "
                "numbers  one   two    three,\n<start_of_turn>user inline<end_of_turn> tokenizer pieces ") * 2
        assert_same_tokenizer(ours, ref, text, CONVERSATION[1:])
        assert ours("the fox")["input_ids"][0] == 2  # <bos>, from the file's add_bos_token
        assert "\u2581\u2581" in ours.tokenize("a  b")  # a stored whitespace run, found as Gemma spells it
    else:
        ref = AutoTokenizer.from_pretrained(str(w.path.parent), gguf_file=w.path.name)
        assert_same_tokenizer(ours, ref, MIXED, CONVERSATION)


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_weights_convert_to_the_dequantized_values(files, converted, family):
    reader = gguf.GGUFReader(str(files[family].path))
    stored = {t.name: t for t in reader.tensors}
    for zoo_name, gguf_name in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
        got = load_param_numpy(converted[family], f"layers.{zoo_name}")
        for i in range(got.shape[0]):
            t = stored[f"blk.{i}.{gguf_name}.weight"]
            assert t.tensor_type == Q.Q8_0
            want = gguf.quants.dequantize(t.data, Q.Q8_0).reshape(tuple(reversed([int(s) for s in t.shape])))
            np.testing.assert_array_equal(got[i], want.T)


def _random_blocks(qtype: Q, rows: int, cols: int, f16_fields: list[tuple[int, float]], seed: int) -> np.ndarray:
    """Random bytes of a quantized tensor whose f16 scale fields (byte offset, value) are finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.RandomState(seed).randint(0, 256, (rows, cols // block, size)).astype(np.uint8)
    for offset, value in f16_fields:
        raw[..., offset:offset + 2] = np.full(raw.shape[:2], value, np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def test_quantized_and_half_tensors_read_exactly(tmp_path):
    """Q8_0 (checked against its definition), Q4_K / Q6_K (which gguf.quants cannot quantize in numpy: random
    blocks, against gguf.quants.dequantize), F16 and BF16 (against numpy's and ml_dtypes' rounding)."""
    x = np.random.RandomState(0).randn(4, 512).astype(np.float32)
    q4k = _random_blocks(Q.Q4_K, 4, 512, [(0, 0.01), (2, 0.002)], seed=1)  # d, dmin lead the block
    q6k = _random_blocks(Q.Q6_K, 4, 512, [(208, 0.001)], seed=2)  # d ends it
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("q8", gguf.quants.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("q4k", q4k, raw_dtype=Q.Q4_K)
    w.add_tensor("q6k", q6k, raw_dtype=Q.Q6_K)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("bf16", gguf.quants.quantize(x, Q.BF16), raw_dtype=Q.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    blocks = gguf.quants.quantize(x, Q.Q8_0).reshape(-1, 34)  # an f16 scale, then 32 int8s
    q8 = (blocks[:, :2].view(np.float16).astype(np.float32) * blocks[:, 2:].view(np.int8).astype(np.float32))
    np.testing.assert_array_equal(f.get("q8"), q8.reshape(4, 512))
    assert np.abs(f.get("q8") - x).max() < 0.05  # and it is the tensor, not noise
    for name, raw, qtype in (("q4k", q4k, Q.Q4_K), ("q6k", q6k, Q.Q6_K)):
        got = f.get(name)
        assert got.dtype == np.float32 and got.shape == (4, 512) and np.isfinite(got).all() and got.std() > 0
        np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype))
    np.testing.assert_array_equal(f.get("f16"), x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(f.get("bf16"), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_embedding_shorter_than_the_vocabulary_is_padded_with_zero_rows(tmp_path):
    path = tmp_path / "short.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_token_list([f"t{i}" for i in range(10)])
    emb = np.arange(32, dtype=np.float32).reshape(8, 4)
    w.add_tensor("token_embd.weight", emb)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    assert f.shape("token_embd.weight") == (10, 4)
    np.testing.assert_array_equal(f.get("token_embd.weight"), np.concatenate([emb, np.zeros((2, 4), np.float32)]))


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_the_same_logits(files, converted, family, tmp_path):
    assert main(["export", str(converted[family]), "--out", str(tmp_path / "hf")]) == 0
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    tokens = random_tokens(files[family].tokens, seq=SEQ)
    got = np.asarray(zoo.load(converted[family])(jnp.asarray(tokens)))
    assert np.abs(hf_logits(back, tokens) - got).max() <= 1e-4
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = AutoTokenizer.from_pretrained(str(converted[family] / TOKENIZER_DIR))
    assert tok(MIXED)["input_ids"] == ours(MIXED)["input_ids"]


@pytest.mark.slow
def test_conversion_without_torch_is_bit_identical(files, converted, tmp_path):
    """Slow (slow lane): a subprocess converts every family's GGUF file again, without torch."""
    site = tmp_path / "blocked"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nfor name in {TEST_ONLY!r}:\n    sys.modules[name] = None\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]))
    outs = {f: tmp_path / f for f in FAMILIES}
    script = ("import sys\nimport importlib.util\nassert importlib.util.find_spec('torch') is None\n"
              "from zoo.cli import main\nargs = sys.argv[1:]\n"
              "for src, out in zip(args[::2], args[1::2]):\n    assert main(['convert', src, '--out', out]) == 0\n")
    args = [str(a) for f in FAMILIES for a in (files[f].path, outs[f])]
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    for f in FAMILIES:
        params = read_meta(converted[f])["params"]
        assert read_meta(outs[f])["params"] == params
        for p in params:
            a, b = load_param_numpy(converted[f], p), load_param_numpy(outs[f], p)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (f, p)
        for name in ("hf_config.json", f"{TOKENIZER_DIR}/tokenizer.json"):
            assert (outs[f] / name).read_text() == (converted[f] / name).read_text(), (f, name)


def _one_tensor_gguf(path: Path, arch: str, embedding: np.ndarray) -> Path:
    """A GGUF file of architecture ``arch`` holding only ``token_embd.weight``."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", embedding)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _one_line_error(capsys, path: Path, out: Path) -> str:
    assert main(["convert", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not out.exists()
    return err[0]


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    path = _one_tensor_gguf(tmp_path / "phi.gguf", "phi3", np.zeros((4, 4), np.float32))
    line = _one_line_error(capsys, path, tmp_path / "out")
    assert "'phi3'" in line
    for arch in ("llama", "gemma", "gemma2", "gemma3", "qwen2", "qwen3"):
        assert arch in line, arch


def test_unsupported_tensor_type_is_one_line(tmp_path, capsys):
    path = _one_tensor_gguf(tmp_path / "int8.gguf", "qwen2", np.ones((8, 4), np.int8))
    line = _one_line_error(capsys, path, tmp_path / "out")
    assert "'token_embd.weight'" in line and "I8" in line
    for qtype in ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K"):
        assert qtype in line, qtype
