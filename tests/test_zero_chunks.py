"""Every converted checkpoint reads back, whatever its values: all-zero (fill-value) slices included.

TensorStore skips writing a chunk equal to the array's fill value (0), and Orbax reads a missing chunk as an
error, so before the fix a stacked parameter with an all-zero layer slice converted ("wrote") and then
failed to load: a Gemma fresh from ``from_config`` (its norm weights are zeros: Gemma stores ``w - 1``),
and DeepSeek-V3's ``e_score_correction_bias``, which starts at zero.
"""

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

import zoo
from tests.tiny import make_hf
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
