"""Every converted checkpoint reads back, whatever its values: all-zero (fill-value) slices included.

TensorStore skips writing a chunk equal to the array's fill value (0), and Orbax reads a missing chunk as an
error, so before the fix a stacked parameter with an all-zero layer slice converted ("wrote") and then
failed to load: a Gemma fresh from ``from_config`` (its norm weights are zeros: Gemma stores ``w - 1``),
and DeepSeek-V3's ``e_score_correction_bias``, which starts at zero.
"""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import zoo
import zoo.checkpoints.format
import zoo.checkpoints.readers
import zoo.checkpoints.verify
from tests.hf_models import make_hf
from zoo.cli import main


def test_fresh_gemma_with_zero_norms_converts_and_loads(tmp_path):
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    hf = GemmaForCausalLM(cfg)
    assert not hf.model.layers[0].input_layernorm.weight.detach().any()  # the case: zero norm weights
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    params = zoo.load(tmp_path / "zoo").param_dict()
    norms = np.asarray(params["layers"]["attn_norm"])
    assert norms.shape[0] == 3 and not norms.any()
    np.testing.assert_array_equal(np.asarray(params["embed"]), hf.model.embed_tokens.weight.detach().numpy())


def test_deepseek_v3_with_zero_correction_bias_converts_and_loads(tmp_path):
    make_hf(tmp_path / "hf", "deepseek_v3")
    f = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(f)
    names = [k for k in tensors if k.endswith("e_score_correction_bias")]
    assert names
    for k in names:
        tensors[k] = np.zeros_like(tensors[k])
    save_file(tensors, f, metadata={"format": "pt"})
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    params = zoo.load(tmp_path / "zoo").param_dict()
    flat = {f"{a}.{b}": v for a, d in params.items() if isinstance(d, dict) for b, v in d.items()}
    bias = [v for k, v in flat.items() if "bias" in k and "router" in k]
    assert bias and all(not np.asarray(b).any() for b in bias)


# Writers' own check (zoo.checkpoints.verify.verify_complete) and the other writers: `zoo init`, training runs.

def _tiny_gemma_config(path):
    from transformers import GemmaConfig

    cfg = GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    path.write_text(json.dumps(cfg.to_dict()))
    return path


@pytest.mark.slow
def test_zoo_init_of_a_gemma_with_zero_norms_loads(tmp_path):
    # `zoo init` starts a Gemma's norms at zero (it scales by 1 + w).
    src = _tiny_gemma_config(tmp_path / "gemma.json")
    assert main(["init", str(src), "--out", str(tmp_path / "gemma")]) == 0
    params = zoo.load(tmp_path / "gemma").param_dict()
    assert not np.asarray(params["layers"]["attn_norm"]).any() and not np.asarray(params["final_norm"]).any()


def _word_tokenizer(folder):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *WORDS])}
    t = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>").save_pretrained(str(folder))
    return len(vocab)


WORDS = "the a cat dog sat ran on under mat log".split()


@pytest.mark.slow
def test_lora_run_with_zero_adapters_checkpoints_and_loads(tmp_path):
    # Fresh adapters have B = 0; with learning rate 0 they stay zero, in the run's Orbax checkpoints and in
    # `final` (written by save_params). Both must read back: the checkpoint restores as the resume does,
    # and `final` loads as base + adapters.
    import orbax.checkpoint as ocp

    from pretrain.config import load_config
    from pretrain.loop import train
    from zoo.model.params import flatten

    vocab = _word_tokenizer(tmp_path / "tok")
    make_hf(tmp_path / "hf", "llama", vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    rng = np.random.RandomState(0)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choice(WORDS, rng.randint(5, 20)))}) + "\n" for _ in range(64)))
    final = train(load_config(None, [
        f"model.path={tmp_path / 'zoo'}", f"model.tokenizer={tmp_path / 'tok'}", f"data.path={tmp_path / 'data.jsonl'}",
        "data.seq_len=16", "batch_size=4", "optimizer.learning_rate=0.0", "schedule.name=constant", "log_every=1",
        "checkpoint.every=1", "lora.rank=4", "max_steps=2", f"output_dir={tmp_path / 'run'}"]), progress=False)
    meta = zoo.checkpoints.format.read_meta(final)
    b = [p for p in meta["lora"]["params"] if p.endswith(".b")]
    assert b and all(not zoo.checkpoints.readers.load_param_numpy(final, p, meta["lora"]["params"][p]).any() for p in b)
    merged, base = zoo.load(final).param_dict(), zoo.load(tmp_path / "zoo").param_dict()
    np.testing.assert_array_equal(np.asarray(merged["layers"]["q"]), np.asarray(base["layers"]["q"]))
    with ocp.CheckpointManager(tmp_path / "run" / "checkpoints") as manager:
        state = manager.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    saved = flatten(state["params"])
    assert set(b) <= set(saved) and all(not np.asarray(saved[p]).any() for p in b)


def _store(ckpt):
    import tensorstore as ts

    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ckpt / 'params' / 'state'}/"}).result()


def test_a_zero_chunk_left_unstored_fails_the_write_before_wrote(tmp_path, monkeypatch, capsys):
    # The bug this item fixed, put back: TensorStore told to skip chunks equal to the fill value. The
    # writer must now fail (an internal error) instead of printing "wrote", and leave no checkpoint.
    import tensorstore as ts
    from transformers import GemmaConfig, GemmaForCausalLM

    real_open = ts.open

    def skipping_open(spec, *args, **kwargs):
        if isinstance(spec, dict) and spec.get("store_data_equal_to_fill_value"):
            spec = {**spec, "store_data_equal_to_fill_value": False}
        return real_open(spec, *args, **kwargs)

    monkeypatch.setattr(ts, "open", skipping_open)
    torch.manual_seed(0)
    hf = GemmaForCausalLM(GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    hf.save_pretrained(tmp_path / "hf")
    missing = r"parameter 'layers\.attn_norm' is incomplete: chunk layers\.attn_norm/c/0/0 is not stored"
    with pytest.raises(RuntimeError, match=missing):
        main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")])
    assert "wrote" not in capsys.readouterr().out
    assert not (tmp_path / "zoo").exists() and not list(tmp_path.glob(".zoo.incomplete-*"))


@pytest.mark.parametrize("key", ["layers.q/c/1/0/0/0", "embed/c/0/0", "final_norm/zarr.json"])
def test_verifier_catches_a_deleted_chunk(tmp_path, key):
    # A stacked parameter's layer chunk (written by TensorStore), a whole parameter's shard (by Orbax), metadata.
    make_hf(tmp_path / "hf", "llama")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    ckpt = tmp_path / "zoo"
    zoo.checkpoints.verify.verify_complete(ckpt)
    kv = _store(ckpt)
    assert key.encode() in kv.list().result()
    kv.delete_range(ts_range(key)).result()
    param = key.split("/")[0]
    with pytest.raises(RuntimeError, match=rf"parameter '{param}'"):
        zoo.checkpoints.verify.verify_complete(ckpt)


def ts_range(key):
    import tensorstore as ts

    return ts.KvStore.KeyRange(key.encode(), key.encode() + b"\x00")


def test_verifier_catches_a_missing_inner_chunk_of_a_shard(tmp_path):
    # Orbax stores a parameter as zarr shards (sharding_indexed) whose index lists inner chunks; one
    # skipped as all-zero is marked missing in the index while the shard itself is present.
    import tensorstore as ts

    make_hf(tmp_path / "hf", "llama")
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "zoo")]) == 0
    ckpt = tmp_path / "zoo"
    data = np.ones(64, np.float32)
    data[:32] = 0

    def rewrite(store_zeros):
        spec = {"driver": "zarr3", "store_data_equal_to_fill_value": store_zeros,
                "kvstore": {"driver": "ocdbt", "base": f"file://{ckpt / 'params' / 'state'}/", "path": "final_norm"},
                "metadata": {"shape": [64], "data_type": "float32",
                             "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [64]}},
                             "codecs": [{"name": "sharding_indexed", "configuration": {
                                 "chunk_shape": [32],
                                 "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                                 "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                                  {"name": "crc32c"}]}}]}}
        ts.open(spec, create=True, delete_existing=True).result().write(data).result()

    rewrite(True)
    zoo.checkpoints.verify.verify_complete(ckpt)
    rewrite(False)
    with pytest.raises(RuntimeError, match=r"parameter 'final_norm' is incomplete: shard final_norm/c/0 lacks"):
        zoo.checkpoints.verify.verify_complete(ckpt)
