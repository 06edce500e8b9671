"""`zoo quantize`: a checkpoint stored quantized holds exactly the fields QLoRA quantizes at load, at <= 4.13 bits
per projection parameter on disk and in memory (NF4, double quantization), and loads, exports and describes
itself dequantized; bad requests are one-line errors that write nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import zoo
from zoo.checkpoints import quantized as quant_checkpoint
from zoo.checkpoints.format import read_meta
from zoo.cli import main as zoo_main
from zoo.model import quant
from zoo.model.params import flatten

# Every projection of a model one size (q, k, v, o and the MLP's 256 x 256; the experts' 64 x 64): a stored
# projection is dequantized op by op (eagerly, as bitsandbytes computes it), and each op compiles once per shape.
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=256,
              intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
# Matrices of >= 256 x 256 values: with fewer than 256 blocks of 64 a matrix's double-quantization block and its
# offset are not amortized (4.14 bits at 64 x 64), as in bitsandbytes. On disk each stored array also carries its
# shard index (20 bytes): amortized by a model of 4.5M projection values.
WIDE = dict(CONFIG, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
MIXTRAL = dict(CONFIG, architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=64,
               intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three random-weight checkpoints as `zoo init` writes them (its weights drawn with NumPy)."""
    from tests.quant_fixtures import write_random_checkpoint

    root = tmp_path_factory.mktemp("quantize")
    for name, cfg in (("llama", CONFIG), ("mixtral", MIXTRAL), ("wide", WIDE)):
        write_random_checkpoint(cfg, root / name)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name, kind, double", [("llama", "nf4", True), ("llama", "int8", False),
                                                ("mixtral", "nf4", False)])
def test_quantized_checkpoint_holds_qloras_fields_and_loads_dequantized(models, tmp_path, capsys, name, kind, double):
    """Slow (about 120 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its
    step configuration."""
    src, out = models / name, tmp_path / "q"
    args = ["quantize", str(src), "--out", str(out), "--quant", kind] + (["--double-quant"] if double else [])
    assert zoo_main(args) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    meta = read_meta(out)
    assert quant_checkpoint.settings(meta) == (kind, double)
    cfg = zoo.read_config(out)
    assert cfg == zoo.read_config(src)
    float_params = flatten(zoo.load_params(src))
    loaded = flatten(zoo.load_params(out))
    proj = quant.quantized_paths(cfg)
    assert set(loaded) == set(float_params) and proj
    for path, w in float_params.items():
        if path not in proj:  # embeddings, head, norms, routers: stored as they were
            np.testing.assert_array_equal(np.asarray(loaded[path]), np.asarray(w))
            continue
        lead, contract = proj[path]
        expected = quant.quantize(np.asarray(w), lead, contract, kind, double)  # what QLoRA makes at load
        stored = quant_checkpoint.load_quantized(out, meta, path)
        assert stored.data.keys() == expected.data.keys()
        for field in expected.data:
            np.testing.assert_array_equal(stored.data[field], expected.data[field], err_msg=f"{path}.{field}")
        np.testing.assert_array_equal(np.asarray(loaded[path]), np.asarray(quant.dequantize(expected)))
        assert loaded[path].dtype == w.dtype
    # zoo export streams the dequantized weights, one layer at a time.
    assert zoo_main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0
    from safetensors.numpy import load_file

    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    key = "self_attn.q_proj" if name == "llama" else "self_attn.o_proj"
    w = np.asarray(loaded["layers.q" if name == "llama" else "layers.o"][1])
    np.testing.assert_array_equal(hf[f"model.layers.1.{key}.weight"], w.reshape(-1, w.shape[-1]).T
                                  if name == "mixtral" else w.reshape(w.shape[0], -1).T)
    capsys.readouterr()
    assert zoo_main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert f"quantized   {quant_checkpoint.describe(kind, double)}" in info


def bits_on_disk(ckpt, meta) -> tuple[int, int]:
    """(bytes the quantized projections' fields occupy in the checkpoint's store, parameters they stand for):
    the chunks' stored lengths, listed from the OCDBT store (not the arrays' nominal sizes)."""
    import tensorstore as ts

    from zoo.checkpoints.format import PARAMS_DIR, STATE_DIR

    state = ckpt.absolute() / PARAMS_DIR / STATE_DIR
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state}/"}).result()
    proj = quant.quantized_paths(zoo.read_config(ckpt))
    prefixes = tuple(f"{p}." for p in proj)
    nbytes = sum(len(kv.read(key).result().value) for key in kv.list().result()
                 if key.decode().startswith(prefixes) and not key.decode().endswith("zarr.json"))
    return nbytes, sum(int(np.prod(meta["params"][p]["shape"])) for p in proj)


@pytest.mark.slow
def test_nf4_double_quant_storage_is_at_most_4_13_bits(models, tmp_path):
    """Slow (slow lane): the module's three checkpoints, quantized on disk and read back."""
    out = tmp_path / "q"
    assert zoo_main(["quantize", str(models / "wide"), "--out", str(out), "--double-quant"]) == 0
    meta = read_meta(out)
    nbytes, params = bits_on_disk(out, meta)
    assert params == sum(int(np.prod(meta["params"][p]["shape"])) for p in quant.quantized_paths(zoo.read_config(out)))
    assert 4.12 <= 8 * nbytes / params <= 4.13, 8 * nbytes / params  # on disk: the stored chunks' bytes
    assert abs(meta["quantized"]["bits_per_param"] - 8 * nbytes / params) < 1e-3
    # In memory: the fields a QLoRA run holds for its frozen base.
    held = {p: quant_checkpoint.load_quantized(out, meta, p) for p in quant.quantized_paths(zoo.read_config(out))}
    nbytes, params = sum(q.nbytes for q in held.values()), sum(int(np.prod(q.lead + q.shape)) for q in held.values())
    assert 8 * nbytes / params <= 4.13
    # The float checkpoint's projections, for scale: 32 bits each.
    assert sum(int(np.prod(meta["params"][p]["shape"])) for p in held) == params


@pytest.mark.slow
@pytest.mark.parametrize("extra, words", [
    (["--quant", "int8", "--double-quant"], ["--double-quant", "nf4"]),
    ([], ["already stored quantized", "NF4"]),
])
def test_quantize_errors_are_one_line_and_write_nothing(models, tmp_path, capsys, extra, words):
    """Slow (slow lane): the module's three checkpoints, quantized on disk and read back."""
    src = models / "mixtral"
    if not extra:  # quantizing a quantized checkpoint
        assert zoo_main(["quantize", str(src), "--out", str(tmp_path / "once")]) == 0
        src = tmp_path / "once"
    capsys.readouterr()
    assert zoo_main(["quantize", str(src), "--out", str(tmp_path / "q"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not (tmp_path / "q").exists()
    assert not list(tmp_path.glob(".q.incomplete-*"))


@pytest.mark.slow
def test_dequantized_reader_slices_match_the_whole(models, tmp_path):
    """Slow (slow lane): the module's three checkpoints, quantized on disk and read back."""
    from zoo.checkpoints.loading import param_reader

    out = tmp_path / "q"
    assert zoo_main(["quantize", str(models / "mixtral"), "--out", str(out)]) == 0
    reader = param_reader(out, "layers.expert_up")
    whole = reader.read()
    np.testing.assert_array_equal(reader.read((1, 2)), whole[1, 2])
    np.testing.assert_array_equal(reader.read(1), whole[1])
    np.testing.assert_array_equal(reader.read_block(1, 1, 3), whole[:, 1:3])
    np.testing.assert_array_equal(reader.read_block(0, 1, 2, squeeze=True), whole[1])
    assert jax.numpy.asarray(whole).dtype == np.float32
