"""llama3 RoPE scaling in GGUF files: llama.cpp writes it as a ``rope_freqs`` tensor (each rotary frequency's
divisor) and no metadata key; the conversion reads the scaling's parameters back from it (convert/gguf_rope.py).
The files are written here as llama.cpp's converter writes them (tests/llama4_gguf.py), the factors computed as its
LlamaModel.generate_extra_tensors computes them, and the oracle is transformers' model of the same config."""

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import zoo
from convert.gguf_meta import hf_config
from tests.hf_models import hf_logits, make_hf, random_tokens
from tests.llama4_gguf import llama_cpp_rope_freqs, write_llama4_gguf
from zoo.cli import main
from zoo.errors import UserError

# Llama 4 Scout's scaling (its bands meet: no blended frequencies) on Llama 3's RoPE base: with head_dim 16 the
# three slowest of 8 frequencies (wavelengths past 8192) are divided by 16.
SCOUT = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
         "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
# Llama 3.1's bands (1, 4): one frequency blended (wavelength 4443, between 2048 and 8192).
LLAMA31 = {**SCOUT, "factor": 8.0, "high_freq_factor": 4.0}
SEQ = 160  # long enough that the scaled frequencies' angles move the logits well past the tolerance


@pytest.mark.slow
def test_scout_gguf_file_converts_with_its_rope_scaling(tmp_path):
    """Slow (a conversion and a 160-token forward, about 4 s): a tiny Llama 4 of llama.cpp's fixed layout with
    Scout's llama3 RoPE scaling, written as llama.cpp writes it (``rope_freqs`` and no scaling key), converts to a
    config with that scaling and logits equal to transformers' model of the same config (1e-4). Without the
    scaling the logits would be off by far more than the tolerance (checked: the test can fail)."""
    tokens = [chr(0x100 + i) for i in range(96)]
    hf = make_hf(tmp_path / "hf", "llama4", moe_layers=None, interleave_moe_layer_step=2, no_rope_layer_interval=4,
                 attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, rope_parameters=SCOUT)
    c = hf.config
    write_llama4_gguf(tmp_path / "scout.gguf", c, load_file(str(tmp_path / "hf" / "model.safetensors")), tokens, [],
                      rope_freqs=llama_cpp_rope_freqs(SCOUT, c.head_dim))
    assert main(["convert", str(tmp_path / "scout.gguf"), "--out", str(tmp_path / "zoo")]) == 0
    rope = zoo.read_config(tmp_path / "zoo").rope
    assert (rope.kind, rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) == (
        "llama3", 16.0, 1.0, 1.0, 8192)
    ids = random_tokens(c.vocab_size, batch=1, seq=SEQ)
    want = hf_logits(hf, ids)
    got = np.asarray(zoo.load(tmp_path / "zoo")(jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    unscaled = make_hf(tmp_path / "plain", "llama4", moe_layers=None, interleave_moe_layer_step=2,
                       no_rope_layer_interval=4, attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1,
                       rope_parameters={"rope_type": "default", "rope_theta": SCOUT["rope_theta"]})
    assert np.abs(hf_logits(unscaled, ids) - want).max() > 1e-2


def _meta(arch: str) -> dict:
    """A header of ``arch`` as llama.cpp writes one of the tiny test width: 16-wide heads, Llama 3's RoPE base."""
    return {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.block_count": 2,
            f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2, f"{arch}.rope.freq_base": 500000.0,
            f"{arch}.rope.dimension_count": 16, f"{arch}.context_length": 131072}


@pytest.mark.parametrize("arch, rope", [("llama", LLAMA31), ("llama4", LLAMA31), ("llama", SCOUT)])
def test_rope_freqs_give_back_the_scaling_they_were_written_from(arch, rope):
    """A llama (Llama 3.1) or llama4 file's ``rope_freqs``, as llama.cpp computes them from a scaling, gives back
    that scaling's parameters in the config (the blended band's edges read from the factors, or the released
    models' where no frequency is blended); the file's ``rope.scaling.*`` keys, where present, are read (a file
    stating an original context of 4096 and factor 8: the scaling read gives back the factors written)."""
    names = ["token_embd.weight", "rope_freqs.weight"]
    factors = llama_cpp_rope_freqs(rope, 16)
    got = hf_config(_meta(arch), names, "x.gguf", {"rope_freqs.weight": factors}.__getitem__)["rope_parameters"]
    assert {k: got[k] for k in rope} == rope
    keyed = {**_meta(arch), f"{arch}.rope.scaling.factor": 8.0, f"{arch}.rope.scaling.original_context_length": 4096}
    written = llama_cpp_rope_freqs({**rope, "factor": 8.0}, 16, original=4096)
    ours = hf_config(keyed, names, "x.gguf", {"rope_freqs.weight": written}.__getitem__)["rope_parameters"]
    assert (ours["factor"], ours["original_max_position_embeddings"]) == (8.0, 4096)
    # at 4096 no frequency is blended: any band edges in the same gaps are the same scaling
    np.testing.assert_allclose(llama_cpp_rope_freqs(ours, 16, original=4096), written, rtol=1e-6)


def test_factors_of_no_llama3_scaling_are_refused_naming_the_tensor():
    """Factors no llama3 scaling of the file's RoPE base and head width gives (not monotone here) are a one-line
    error naming the tensor, not a conversion without them."""
    bad = np.asarray([1, 2, 1, 2, 1, 2, 1, 2], np.float32)
    with pytest.raises(UserError, match=r"^x\.gguf: rope_freqs\.weight \(8 factors, largest 2\) is no llama3 RoPE "
                                        r"scaling of rope_theta 500000 and head_dim 16; convert the model's "
                                        r"safetensors checkpoint instead$"):
        hf_config(_meta("llama4"), ["rope_freqs.weight"], "x.gguf", {"rope_freqs.weight": bad}.__getitem__)
