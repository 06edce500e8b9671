"""LoRA fixtures: the LoRA tests' model configurations, random base weights and adapters, the loss with
adapters, an adapter checkpoint written as training writes one, and peft's logits with an exported adapter
against ours."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import zoo
from zoo.checkpoints.adapter import adapter_meta
from zoo.checkpoints.format import read_meta
from zoo.checkpoints.writer import CheckpointWriter, save_params
from zoo.lora.params import LoraConfig, init_lora, lora_scale, lora_specs
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward
from zoo.model.params import flatten, nest, param_specs

LORA_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                 head_dim=16)
LORA_CONFIGS = {
    "llama": ModelConfig(family="llama", **LORA_BASE),
    # Gemma 2: (1 + w) norms, post norms, soft-caps, tied embeddings, and (sliding, full) blocks, so the
    # adapters are sliced with period 2 like their weights.
    "gemma2": ModelConfig(family="gemma2", **{**LORA_BASE, "num_layers": 4}, norm_offset=1.0, embed_scale=True,
                          post_norms=True, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                          attn_softcap=4.0, final_softcap=6.0, sliding_window=7, tie_word_embeddings=True,
                          layer_types=("sliding", "full") * 2),
    "mixtral": ModelConfig(family="mixtral", **LORA_BASE, num_experts=4, experts_per_token=2,
                           moe_intermediate_size=48),
    # DeepSeek-V3-like: MLA attention (no adapters), a dense first layer, shared experts, sigmoid routing.
    "deepseek": ModelConfig(family="deepseek_v3", **{**LORA_BASE, "num_kv_heads": 4}, num_experts=8,
                            experts_per_token=2, moe_intermediate_size=16, shared_experts=1, dense_layers=1,
                            router_score="sigmoid", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=8),
}
LORA_TOKENS = jax.device_put(np.random.RandomState(0).randint(0, 96, (2, 12)).astype(np.int32))


@functools.cache
def lora_base_params(cfg: ModelConfig) -> dict:
    """Random base weights ~ N(0, 0.02) (drawn with NumPy: jax.random compiles a kernel per shape, slowly)."""
    rng = np.random.RandomState(0)
    # float32 in NumPy, then device_put: jnp.asarray compiles a program per shape (a conversion, or a stage)
    flat = {path: jax.device_put((rng.normal(0, 0.02, spec.shape) if spec.init == "normal" else
                                  np.full(spec.shape, 1.0 if spec.init == "ones" else 0.0)).astype(np.float32))
            for path, spec in sorted(param_specs(cfg).items())}
    return nest(flat)


# init_lora jitted: one compilation per configuration (then cached), not one per eager op and shape.
_init_lora = jax.jit(init_lora, static_argnums=(0, 1))


def random_lora(cfg: ModelConfig, lc: LoraConfig, random: bool = False) -> dict:
    """Fresh adapters (B = 0), or with ``random`` every A and B random non-zero (a zero B hides most mistakes),
    drawn with NumPy into init_lora's shapes (jax.eval_shape: nothing compiled)."""
    if not random:
        return _init_lora(cfg, lc, jax.random.key(1))
    rng = np.random.RandomState(2)
    shapes = jax.eval_shape(lambda: init_lora(cfg, lc, jax.random.key(1)))
    return jax.tree.map(lambda a: jax.device_put(rng.normal(0, 0.1, a.shape).astype(np.float32)), shapes)


def lora_lm_loss(cfg, params, lora, lcfg, tokens, remat="none"):
    """Next-token cross-entropy (mean) of the model with adapters ``lora`` on ``tokens`` (tests/test_quant_model.py)."""
    logits = forward(cfg, Weights(params, lora, lora_scale(lcfg)), tokens, remat=remat)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


def write_adapter_checkpoint(base: Path, out: Path, lora_cfg: LoraConfig, seed: int = 0) -> Path:
    """An adapter checkpoint of ``base`` laid out as pretrain/final.py writes one, with B random too."""
    cfg = zoo.read_config(base)
    flat = {p: np.asarray(v) for p, v in flatten(_init_lora(cfg, lora_cfg, jax.random.key(seed))).items()}
    rng = np.random.RandomState(seed)
    # init_lora's B is zero (the adapter would change nothing); a random B makes every delta count.
    flat = {p: v if p.endswith(".a") else rng.normal(0.0, 0.1, v.shape).astype(v.dtype) for p, v in flat.items()}
    specs = lora_specs(cfg, lora_cfg)
    out.mkdir()
    stored = save_params(out, nest(flat), {p: s.axes for p, s in specs.items()})
    writer = CheckpointWriter(out)
    writer.adopt(read_meta(base)["params"])
    writer.finish(cfg, source=str(base), source_format="train", training={"method": "sft", "steps": 3},
                  lora=adapter_meta(lora_cfg, base, stored))
    return out


def peft_logits_against_ours(hf: Path, adapter: Path, peft_dir: Path) -> tuple[float, float]:
    """(max |peft - ours|, max |base - ours|): peft's logits with the exported adapter (which must load every key,
    none left over) against our forward of the adapter checkpoint."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.hf_models import hf_logits, random_tokens  # torch: imported here, not by the 8-device subprocesses

    tokens = random_tokens(96, batch=2, seq=24)
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, attn_implementation="eager").eval()
    base = hf_logits(hf_model, tokens)
    model = PeftModel.from_pretrained(hf_model, str(peft_dir)).eval()
    result = model.load_adapter(str(peft_dir), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    model.delete_adapter("again")
    got = hf_logits(model, tokens)
    ours = np.asarray(zoo.load(adapter)(jnp.asarray(tokens)))
    return float(np.abs(got - ours).max()), float(np.abs(base - ours).max())
