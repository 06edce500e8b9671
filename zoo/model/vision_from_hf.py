"""A Hugging Face vision-language config's vision side read as a :class:`zoo.model.vision_config.VisionConfig`.

Read from transformers' own config object (its defaults included), one reader per kind of tower, named by the
weight-name format (``zoo.model.hf_families.VISION_FORMATS``). The language model's side is :mod:`zoo.model.from_hf`'s.
"""

from __future__ import annotations

from typing import Any

from zoo.errors import UserError
from zoo.model.vision_config import VisionConfig


def _idefics3(top: Any, arch: str, where: str) -> VisionConfig:
    """SmolVLM / Idefics3: a SigLIP tower (``vision_config``), the pixel-shuffle connector (``scale_factor``)."""
    v = top.vision_config
    size, patch = v.image_size, v.patch_size
    if not isinstance(size, int) or not isinstance(patch, int):
        raise UserError(f"{where}: vision_config image_size={size!r} / patch_size={patch!r} must be single integers")
    return VisionConfig(arch=arch, hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
                        num_layers=int(v.num_hidden_layers), num_heads=int(v.num_attention_heads), patch_size=patch,
                        image_size=size, image_token_id=int(top.image_token_id), num_channels=int(v.num_channels),
                        hidden_act=str(v.hidden_act), norm_eps=float(v.layer_norm_eps), connector="shuffle_linear",
                        scale_factor=int(top.scale_factor))


def _gemma3(top: Any, arch: str, where: str) -> VisionConfig:
    """Gemma 3: a SigLIP tower (``vision_config``, read at each patch's own position row), the average-pool
    connector down to ``mm_tokens_per_image`` tokens, and bidirectional attention within each image's tokens."""
    v = top.vision_config
    side, per_side = int(v.image_size) // int(v.patch_size), round(int(top.mm_tokens_per_image) ** 0.5)
    if per_side * per_side != int(top.mm_tokens_per_image) or side % per_side:
        raise UserError(f"{where}: mm_tokens_per_image={top.mm_tokens_per_image} must be a square whose side divides "
                        f"the {side} patches along each side of an image")
    return VisionConfig(arch=arch, hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
                        num_layers=int(v.num_hidden_layers), num_heads=int(v.num_attention_heads),
                        patch_size=int(v.patch_size), image_size=int(v.image_size),
                        image_token_id=int(top.image_token_id), num_channels=int(v.num_channels),
                        hidden_act=str(v.hidden_act), norm_eps=float(v.layer_norm_eps), connector="avg_pool",
                        scale_factor=side // per_side, bucketize=False, image_blocks=True)


def _gemma4(top: Any, arch: str, where: str) -> VisionConfig:
    """Gemma 4: its own tower (``vision_config``: GQA, 2-D RoPE, a 2-D position table, ``pooling_kernel_size``),
    the embedder's normalized projection, and bidirectional image blocks on the sliding layers alone when the
    text config says ``use_bidirectional_attention: vision``. Images may have up to 280 tokens each, the image
    processor's default (``max_soft_tokens``), of which the tower's layout makes room for."""
    v, text = top.vision_config, top.text_config
    bidir = getattr(text, "use_bidirectional_attention", None)
    if bidir not in (None, "vision"):
        raise UserError(f"{where}: use_bidirectional_attention={bidir!r} (every token attending both ways) is not "
                        "supported; only 'vision' (image tokens, on sliding layers) or none")
    rope = dict(getattr(v, "rope_parameters", None) or {})
    if rope.get("rope_type", "axial") != "axial":
        raise UserError(f"{where}: vision_config rope_type={rope.get('rope_type')!r}: only 'axial' is supported")
    return VisionConfig(arch=arch, hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
                        num_layers=int(v.num_hidden_layers), num_heads=int(v.num_attention_heads),
                        patch_size=int(v.patch_size), image_size=int(v.patch_size),
                        image_token_id=int(top.image_token_id), hidden_act=str(v.hidden_activation),
                        norm_eps=float(v.rms_norm_eps), connector="gemma4", scale_factor=int(v.pooling_kernel_size),
                        bucketize=False, image_blocks=bidir == "vision", tower="gemma4",
                        num_kv_heads=int(v.num_key_value_heads), head_width=int(v.head_dim),
                        pos_table=int(v.position_embedding_size), rope_theta=float(rope.get("rope_theta", 100.0)),
                        max_soft_tokens=280, clipped=bool(v.use_clipped_linears), standardize=bool(v.standardize),
                        blocks_on_full=False)


def _qwen_patches(top: Any, where: str) -> tuple[int, int, int]:
    """A Qwen tower's (patch size, merge size, frames a patch), each checked: single integers, the merger's
    width the language model's."""
    v = top.vision_config
    patch, merge, frames = v.patch_size, int(v.spatial_merge_size), v.temporal_patch_size
    if not isinstance(patch, int) or not isinstance(frames, int):
        raise UserError(f"{where}: vision_config patch_size={patch!r} / temporal_patch_size={frames!r} must be "
                        "single integers")
    if int(v.out_hidden_size) != int(top.text_config.hidden_size):
        raise UserError(f"{where}: vision_config out_hidden_size={v.out_hidden_size} must equal the language "
                        f"model's hidden_size={top.text_config.hidden_size}")
    return patch, merge, frames


def _qwen2_5(top: Any, arch: str, where: str) -> VisionConfig:
    """Qwen2.5-VL: its windowed RoPE tower (``vision_config``: ``depth`` layers, ``fullatt_block_indexes``) and the
    patch merger (``spatial_merge_size``) to the language model's width (``out_hidden_size``)."""
    v = top.vision_config
    patch, merge, frames = _qwen_patches(top, where)
    rope = getattr(v, "rope_parameters", None) or {}
    return VisionConfig(arch=arch, hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
                        num_layers=int(v.depth), num_heads=int(v.num_heads), patch_size=patch,
                        image_size=patch * merge, image_token_id=int(top.image_token_id),
                        num_channels=int(v.in_channels), hidden_act=str(v.hidden_act), norm_eps=1e-6,
                        connector="patch_merger", scale_factor=merge, bucketize=False, tower="qwen2_5",
                        temporal_patch_size=frames, window_size=int(v.window_size),
                        fullatt_layers=tuple(int(i) for i in v.fullatt_block_indexes),
                        rope_theta=float(rope.get("rope_theta", 10000.0)))


def _qwen3(top: Any, arch: str, where: str) -> VisionConfig:
    """Qwen3-VL: its tower (``vision_config``: ``depth`` layers, a ``num_position_embeddings``-row square position
    table, no windows), the patch merger (``spatial_merge_size``) to the language model's width
    (``out_hidden_size``), and a merger of its own for each of ``deepstack_visual_indexes``. Qwen3.5's tower is
    this one without DeepStack (its vision config has no ``deepstack_visual_indexes``: no levels)."""
    v = top.vision_config
    patch, merge, frames = _qwen_patches(top, where)
    table, rope = int(v.num_position_embeddings), dict(getattr(v, "rope_parameters", None) or {})
    if round(table**0.5) ** 2 != table:
        raise UserError(f"{where}: vision_config num_position_embeddings={table} must be a square (a grid of "
                        "positions)")
    if rope.get("rope_type", "axial") != "axial":
        raise UserError(f"{where}: vision_config rope_type={rope.get('rope_type')!r}: only 'axial' is supported")
    return VisionConfig(arch=arch, hidden_size=int(v.hidden_size), intermediate_size=int(v.intermediate_size),
                        num_layers=int(v.depth), num_heads=int(v.num_heads), patch_size=patch,
                        image_size=patch * merge, image_token_id=int(top.image_token_id),
                        num_channels=int(v.in_channels), hidden_act=str(v.hidden_act), norm_eps=1e-6,
                        connector="patch_merger", scale_factor=merge, bucketize=False, tower="qwen3",
                        temporal_patch_size=frames, pos_table=table, rope_theta=float(rope.get("rope_theta", 10000.0)),
                        deepstack_layers=tuple(int(i) for i in getattr(v, "deepstack_visual_indexes", ())))


def _llama4(top: Any, arch: str, where: str) -> VisionConfig:
    """Llama 4: its tower (``vision_config``: tiles of ``image_size``, a class token, 2-D RoPE), the pixel-shuffle
    adapter MLP (``projector_input_dim`` wide) and the projector to the language model. The adapter's widths must
    chain as transformers' modules do: the shuffled patches (hidden_size / pixel_shuffle_ratio²) into its fc1
    (``intermediate_size`` wide), fc1's output into fc2 (``projector_output_dim``) and fc2's into the projector
    (``vision_output_dim``)."""
    v = top.vision_config
    size, patch, ratio = v.image_size, v.patch_size, float(v.pixel_shuffle_ratio)
    if not isinstance(size, int) or not isinstance(patch, int):
        raise UserError(f"{where}: vision_config image_size={size!r} / patch_size={patch!r} must be single integers")
    scale = round(1 / ratio)
    if scale * ratio != 1:
        raise UserError(f"{where}: vision_config pixel_shuffle_ratio={ratio} must be 1 / an integer (0.5 in Llama 4)")
    hidden, adapter = int(v.hidden_size), int(v.projector_input_dim)
    widths = (int(v.intermediate_size), hidden * scale * scale), (adapter, int(v.projector_output_dim)), \
        (adapter, int(v.vision_output_dim))
    if any(a != b for a, b in widths):
        raise UserError(f"{where}: vision_config widths do not chain: intermediate_size={v.intermediate_size} must "
                        f"be hidden_size / pixel_shuffle_ratio² = {hidden * scale * scale}, and projector_input_dim="
                        f"{adapter}, projector_output_dim={v.projector_output_dim} and vision_output_dim="
                        f"{v.vision_output_dim} equal")
    rope = dict(getattr(v, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"{where}: vision_config rope_type={rope.get('rope_type')!r}: only 'default' is supported")
    # transformers' tower runs nn.GELU() (exact) and nn.LayerNorm's default eps whatever hidden_act / norm_eps say
    return VisionConfig(arch=arch, hidden_size=hidden, intermediate_size=int(v.intermediate_size),
                        num_layers=int(v.num_hidden_layers), num_heads=int(v.num_attention_heads), patch_size=patch,
                        image_size=size, image_token_id=int(top.image_token_id), num_channels=int(v.num_channels),
                        hidden_act="gelu", norm_eps=1e-5, connector="pixel_shuffle_mlp", scale_factor=scale,
                        bucketize=False, tower="llama4", rope_theta=float(rope.get("rope_theta", 10000.0)),
                        adapter_dim=adapter)


READERS = {"idefics3": _idefics3, "gemma3": _gemma3, "gemma4": _gemma4, "qwen2_5": _qwen2_5, "qwen3": _qwen3,
           "llama4": _llama4}


def vision_config_from_hf(kind: str, top: Any, arch: str, where: str) -> VisionConfig:
    """The :class:`VisionConfig` of transformers' composite config ``top`` through the reader ``kind``; ``arch``
    is the model class it names."""
    try:
        return READERS[kind](top, arch, where)
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{where}: cannot read the vision config ({e})") from None
