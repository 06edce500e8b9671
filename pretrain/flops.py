"""FLOP counting for MFU: training FLOPs per token (and per image patch of a vision-language model) and the
devices' peak."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jax
import numpy as np

from pretrain.config import TrainConfig
from zoo.model.config import ModelConfig
from zoo.model.params import param_specs

KNOWN_PEAK_TFLOPS = {  # dense bf16 per device
    "H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
    "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0,
}


def peak_flops(cfg: TrainConfig) -> float | None:
    """Peak FLOP/s of all devices: from ``peak_tflops``, else detected for known accelerators, else None."""
    devices = jax.devices()
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12 * len(devices)
    kind = devices[0].device_kind
    for name, tflops in KNOWN_PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops * 1e12 * len(devices)
    return None


def flops_per_token(mcfg: ModelConfig, seq_len: int, frozen_base: bool = False) -> float:
    """Training FLOPs per token: 6 x (matmul parameters active per token) + causal attention scores.

    With ``frozen_base`` (LoRA, QLoRA) the base weights get no gradient: their matmuls cost 4 x (forward and the
    backward's input gradient), not 6 x; the attention scores' backward is the same either way, and the
    adapters' own few FLOPs are left out.

    DeepSeek-V3.2's sparse attention (``index_topk``): a query's attention scores cover its indexer's top k keys
    (all of them while it sees fewer), not the whole prefix; its indexer runs forward only (no gradient flows
    through the top-k selection), its projections at 2 x their parameters and its scores at 2 x (index heads x
    (index dim + 1)) a visible key. These are the model's FLOPs: the kernel (zoo.kernels.sparse_topk) scores a
    block's keys densely and masks them."""
    specs = param_specs(mcfg)
    active = indexer = 0
    for path, spec in specs.items():
        if path.startswith(_IMAGE_SIDE):
            continue  # a VLM's tower runs per patch and its connector per image token: vision_flops_per_patch
        if path == "embed" and not mcfg.tie_word_embeddings:
            continue  # a gather, not a matmul
        if path == "ple_embed":
            continue  # Gemma 4's per-layer input embedding: a gather too
        if spec.init != "normal":
            continue  # norms' scales and biases (initialized to ones and zeros): elementwise, not matmuls
        n = int(np.prod(spec.shape))
        if "expert_" in path:
            n = n * mcfg.experts_per_token // mcfg.num_experts
        if ".idx_" in path:  # DeepSeek-V3.2's indexer: forward only
            indexer += n
            continue
        active += n
    attn_width = mcfg.num_heads * (mcfg.head_dim if not mcfg.mla else mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim)
    softmax = [k for k in mcfg.kinds if k != "linear"]
    widths = len(softmax) * attn_width
    if mcfg.global_head_dim:  # Gemma 4: full layers' heads are global_head_dim wide
        widths = sum(mcfg.num_heads * (mcfg.global_head_dim if k == "full" else mcfg.head_dim) for k in softmax)
    base = (4.0 if frozen_base else 6.0) * active
    # the linear layers' delta rule (forward and backward: 3 x its 2 x MACs)
    linear = 6.0 * mcfg.kinds.count("linear") * linear_macs_per_token(mcfg)
    if mcfg.sparse:
        scores = mcfg.num_layers * mcfg.index_n_heads * (mcfg.index_head_dim + 1) * seq_len / 2  # causal prefix
        return base + linear + 2.0 * indexer + 2.0 * scores + 12.0 * widths * _sparse_keys(mcfg.index_topk, seq_len)
    return base + linear + 6.0 * widths * seq_len  # QK^T and PV, halved for causality


def linear_macs_per_token(mcfg: ModelConfig) -> float:
    """Multiply-adds per token of one linear layer's chunked delta rule (zoo.kernels.gated_delta, chunk C): per
    value head, k_beta k^T and q k^T (C x k_dim each), the state read by the rhs and by the queries and its update
    (k_dim x v_dim each), the unit-triangular solve (C / 2 x v_dim) and the chunk's attention onto it (C x v_dim);
    it grows with the chunk, not with the sequence."""
    from zoo.layers.linear_attention import CHUNK

    dk, dv = mcfg.linear_key_head_dim, mcfg.linear_value_head_dim
    return mcfg.linear_value_heads * (2 * CHUNK * dk + 3 * dk * dv + 1.5 * CHUNK * dv)


def _sparse_keys(topk: int, seq_len: int) -> float:
    """The mean number of keys a query of a ``seq_len`` row attends to under top-``topk`` selection, counted as the
    dense causal count is (seq_len / 2: position p sees p keys, the diagonal left out): min(p, topk) on average."""
    k = min(topk, seq_len)
    return (k * k / 2 + (seq_len - k) * k) / seq_len


_IMAGE_SIDE = ("vision.", "projector.")  # the parameter paths of a VLM's tower and connector


def vision_flops_per_patch(mcfg: ModelConfig, tower_trained: bool, connector_trained: bool) -> float:
    """A vision-language model's image-side FLOPs per patch slot of a row (padding slots run through the tower as
    queries, as padding tokens run through the decoder): the tower's matmuls and its bidirectional attention over
    an image's patches, plus the connector's projection, once a group of patches. A trained tower costs 3 x its
    forward (weight and input gradients); a frozen one (``model.freeze``, or LoRA, whose adapters sit on the
    language model) runs forward only, nothing before it needing a gradient; a trained connector after a frozen
    tower costs 2 x (its weight gradient, no input gradient)."""
    v = mcfg.vision
    if v is None:
        return 0.0
    specs = param_specs(mcfg)
    tower = sum(int(np.prod(spec.shape)) for path, spec in specs.items()
                if path.startswith("vision.") and spec.init == "normal"
                and path not in ("vision.pos_embed", "vision.class_embed"))  # a gather; Llama 4's one vector
    # once a group of patches (an image token): its matmuls (Qwen2.5-VL's merger: fc1 and fc2)
    connector = sum(int(np.prod(spec.shape)) for path, spec in specs.items()
                    if path.startswith("projector.") and spec.init == "normal") / v.group
    attention = 4.0 * v.num_layers * v.hidden_size * v.patches_per_image  # QK^T and PV, every patch a query
    connector_factor = 3.0 if tower_trained else 2.0 if connector_trained else 1.0
    return (3.0 if tower_trained else 1.0) * (2.0 * tower + attention) + connector_factor * 2.0 * connector


def image_flops_per_step(mcfg: ModelConfig, layout: Any, frozen_base: bool, freeze: Collection[str]) -> float:
    """The image side's FLOPs of a step whose batch is ``layout`` (a pretrain.batch.TokenBatch, its arrays or
    their ShapeDtypeStructs): every patch slot of its rows (0 without images)."""
    vision = getattr(layout, "vision", None)
    if vision is None or mcfg.vision is None:
        return 0.0
    patches = int(np.prod(vision.patch_image.shape))
    tower = not frozen_base and "vision" not in freeze
    return vision_flops_per_patch(mcfg, tower, not frozen_base and "projector" not in freeze) * patches
