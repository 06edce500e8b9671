"""`zoo export` writes the config.json that transformers' own `save_pretrained` writes, for every family
and whatever the checkpoint came from: a Hugging Face folder, a GGUF file, `zoo init`, or training
(`final/` keeps the source's hf_config.json when there was one, and has none after a random init).
That it does so without torch: tests/test_runtime_without_test_extras.py (in its subprocess of `zoo` commands)."""

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.hf_models import BASE, FAMILIES, OWN_TOKEN_IDS, make_hf
from zoo.cli import main

# Keys of the exported config.json allowed to differ from save_pretrained's, each with the reason.
# None is needed: the export serializes through the family's transformers config class (the
# installed transformers, so even `transformers_version` agrees), and sets `architectures` and
# `dtype` as PreTrainedModel.save_pretrained does. Keep this list short and justified.
ALLOWED_DIFFERENCES: dict[str, str] = {}


def _read(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def assert_same_config(ours: dict, ref: dict) -> None:
    """Key by key: the same keys, the same values (save_pretrained's config.json is ``ref``)."""
    keys = (set(ours) | set(ref)) - set(ALLOWED_DIFFERENCES)
    missing = sorted(k for k in keys if k not in ours)
    extra = sorted(k for k in keys if k not in ref)
    assert not missing and not extra, f"missing {missing}, not written by save_pretrained {extra}"
    differ = {k: (ours[k], ref[k]) for k in sorted(keys) if ours[k] != ref[k]}
    assert not differ, f"(ours, save_pretrained) differ: {differ}"


def _export(ckpt: Path, out: Path, *args: str) -> dict:
    assert main(["export", str(ckpt), "--out", str(out), *args]) == 0
    return _read(out)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_family):
    """family -> (save_pretrained's config.json, its `zoo convert`ed checkpoint, a scratch folder), made once
    (conftest.py's tiny_family)."""
    done = {}

    def get(family):
        if family not in done:
            _, shared = tiny_family(family)
            done[family] = _read(shared / "hf"), shared / "zoo", tmp_path_factory.mktemp(family)
        return done[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_source_export_matches_save_pretrained(converted, family):
    ref, ckpt, root = converted(family)
    ours = _export(ckpt, root / "back")
    assert ours["architectures"] == [FAMILIES[family][1]]
    assert_same_config(ours, ref)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generated_config_matches_save_pretrained(converted, family):
    """No source config kept (a model trained from a random init has none): the config written
    from the zoo config alone is still the complete one transformers writes."""
    ref, ckpt, root = converted(family)
    bare = root / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("hf_config.json"))
    ours = _export(bare, root / "bare_back")
    assert ours["architectures"] == [FAMILIES[family][1]]
    assert_same_config(ours, {**ref, **{k: ours[k] for k in OWN_TOKEN_IDS.get(family, {})}})


def test_export_dtype_is_written_as_save_pretrained_does(converted):
    ref, ckpt, root = converted("llama")
    ours = _export(ckpt, root / "bf16", "--dtype", "bfloat16")
    assert ours["dtype"] == "bfloat16" and "torch_dtype" not in ours
    assert_same_config({**ours, "dtype": ref["dtype"]}, ref)


def test_older_transformers_config_is_kept_as_written(converted):
    """A Hub config.json written by an older transformers (top-level rope_theta, torch_dtype) is
    already complete for the version that wrote it: it is kept as it is (only its dtype updated),
    not rewritten in this version's format, which older versions could not read."""
    from zoo.model.from_hf import model_config_from_hf

    ref, ckpt, root = converted("llama")
    legacy = {k: v for k, v in ref.items() if k not in ("rope_parameters", "dtype")}
    legacy.update(rope_theta=ref["rope_parameters"]["rope_theta"], rope_scaling=None, torch_dtype="float32",
                  transformers_version="4.45.0")
    assert model_config_from_hf(legacy) == model_config_from_hf(ref)
    ckpt2 = root / "legacy"
    shutil.copytree(ckpt, ckpt2, ignore=shutil.ignore_patterns("hf_config.json"))
    (ckpt2 / "hf_config.json").write_text(json.dumps(legacy))
    assert _export(ckpt2, root / "legacy_back", "--dtype", "bfloat16") == {**legacy, "torch_dtype": "bfloat16"}


def _minimal_config(family: str) -> dict:
    """A hand-written config.json: model_type and the dimensions only (no architectures, no defaults)."""
    import transformers

    cls, _, defaults = FAMILIES[family]
    return {"model_type": getattr(transformers, cls).model_type, **BASE, **defaults}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_minimal_source_config_is_completed(converted, family):
    """A checkpoint whose stored config is a minimal hand-written one, as `zoo init CONFIG.json` stores it
    (init keeps the given file as hf_config.json; the weights do not matter to the config)."""
    ref, ckpt, root = converted(family)
    ckpt2 = root / "minimal"
    shutil.copytree(ckpt, ckpt2, ignore=shutil.ignore_patterns("hf_config.json"))
    (ckpt2 / "hf_config.json").write_text(json.dumps(_minimal_config(family)))
    assert_same_config(_export(ckpt2, root / "minimal_back"), ref)


def test_zoo_init_then_export_matches_save_pretrained(converted, tmp_path):
    ref, _, _ = converted("llama")
    (tmp_path / "minimal.json").write_text(json.dumps(_minimal_config("llama")))
    assert main(["init", str(tmp_path / "minimal.json"), "--out", str(tmp_path / "zoo")]) == 0
    assert_same_config(_export(tmp_path / "zoo", tmp_path / "back"), ref)


def test_registry_init_config_matches_save_pretrained(tmp_path):
    """`zoo init deepseek-v3-tiny` stores the registry's config; its export config (computed here
    from what init stores, without the slow random init of the weights) is save_pretrained's."""
    from convert.hf_config import export_hf_config
    from zoo.model.from_hf import model_config_from_hf
    from zoo.registry.catalogue import DEEPSEEK_V3_TINY

    make_hf(tmp_path / "hf", "deepseek_v3",
            **{k: v for k, v in DEEPSEEK_V3_TINY.items() if k not in ("architectures", "model_type")})
    stored = json.loads(json.dumps(DEEPSEEK_V3_TINY))
    assert_same_config(export_hf_config(model_config_from_hf(stored), stored, "float32"), _read(tmp_path / "hf"))


# --- GGUF sources. transformers cannot save_pretrained a model loaded from GGUF, so the reference is
# what that save_pretrained would write: transformers' own GGUF config (AutoConfig with gguf_file)
# with architectures and dtype set as PreTrainedModel.save_pretrained sets them, serialized with
# to_diff_dict (exactly what PreTrainedConfig.save_pretrained writes).

def _gguf_reference(path: Path, dtype: str) -> dict:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    c.architectures = ["LlamaForCausalLM"]
    c.dtype = dtype
    return c.to_diff_dict()


def _assert_llama_complete(ours: dict) -> None:
    from transformers import LlamaConfig

    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    # Every key save_pretrained writes for a LlamaConfig. (LlamaConfig().to_dict() has more: the
    # base-class defaults such as return_dict or id2label, which save_pretrained leaves out.)
    assert set(LlamaConfig().to_diff_dict()) <= set(ours)


def test_smollm2_gguf_config_is_complete(smollm2_source):
    """The real SmolLM2-135M GGUF: the config `zoo export` writes for its conversion, computed from
    exactly what `zoo convert` stores (hf_config.json and the model config), without converting the
    0.5 GB of weights. (test_gguf_meta shows the stored config is transformers' own GGUF config.)"""
    from transformers import LlamaConfig

    from convert.hf_config import export_hf_config
    from zoo.model.from_hf import model_config_from_hf

    # conftest.py's open_source of the file, read once per session.
    stored = json.loads(json.dumps(smollm2_source.hf_config, default=str))  # as convert writes it
    ours = export_hf_config(model_config_from_hf(stored), stored, "float32")
    _assert_llama_complete(ours)
    assert ours["architectures"] == ["LlamaForCausalLM"] and stored["architectures"] is None
    # The file's own values where it has them (dims, RoPE, eps, tying, special token ids), and only
    # the keys save_pretrained writes: LlamaConfig's, plus the two GGUF extras transformers keeps.
    assert set(ours) == set(LlamaConfig().to_diff_dict()) | {"architectures", "dtype", "_model_name_or_path",
                                                             "unk_token_id"}
    for k in set(ours) - {"architectures", "dtype", "transformers_version"}:
        assert ours[k] == stored[k], k
    assert ours["dtype"] == "float32" and (ours["bos_token_id"], ours["eos_token_id"]) == (1, 2)
    assert model_config_from_hf(ours) == model_config_from_hf(stored)


def _tiny_llama_gguf(path: Path) -> Path:
    """A complete tiny llama GGUF (every tensor convert needs; sentencepiece vocabulary)."""
    from tests.tokenizer_checks import spm_vocab

    tokens, scores, types = spm_vocab()
    hidden, inter, heads, kv, hd, layers = 32, 48, 4, 2, 8, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.RandomState(0)

    def add(name, *shape):
        w.add_tensor(name, rng.normal(0, 0.1, shape).astype(np.float32))

    add("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", hidden)
        add(b + "attn_q.weight", heads * hd, hidden)
        add(b + "attn_k.weight", kv * hd, hidden)
        add(b + "attn_v.weight", kv * hd, hidden)
        add(b + "attn_output.weight", hidden, heads * hd)
        add(b + "ffn_norm.weight", hidden)
        add(b + "ffn_gate.weight", inter, hidden)
        add(b + "ffn_up.weight", inter, hidden)
        add(b + "ffn_down.weight", hidden, inter)
    add("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_convert_then_export_matches_transformers(tmp_path):
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    assert main(["convert", str(path), "--out", str(tmp_path / "zoo")]) == 0
    ours = _export(tmp_path / "zoo", tmp_path / "back", "--dtype", "bfloat16")
    _assert_llama_complete(ours)
    assert_same_config(ours, _gguf_reference(path, "bfloat16"))
    gen = json.loads((tmp_path / "back" / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2

