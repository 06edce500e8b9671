"""The vision side of a vision-language model: its image tower, the connector into the language model, and the
token the language model's image positions hold. Nested in :class:`zoo.model.config.ModelConfig` as ``vision``.

The SigLIP tower of SmolVLM/Idefics3 and Gemma 3: a pre-norm transformer over the patches of each image
(LayerNorm with biases, q/k/v/o with biases, fc1 -> gelu_tanh -> fc2 with biases, bidirectional within one
image), a conv patch embedding with a bias, a learned position table (read at SmolVLM's bucketized index, or at
each patch's own index: ``bucketize``), a final ``post_layernorm``, then the connector named by ``connector``:
``shuffle_linear`` (SmolVLM/Idefics3: each ``scale_factor`` x ``scale_factor`` block of patches concatenated into
one token and projected, no bias, to the LM's width) or ``avg_pool`` (Gemma 3: each such block averaged, then
Gemma's ``(1 + w)`` RMSNorm and a projection). ``image_blocks`` makes each run of image tokens one bidirectional
block in the language model's attention (Gemma 3).

Qwen2.5-VL (``tower: qwen2_5``, :mod:`zoo.model.vision_qwen`) has no fixed image size: each image is its own grid
of patches (dynamic resolution), each patch ``temporal_patch_size`` frames deep, rotated by 2-D RoPE
(``rope_theta``), windowed attention (``window_size`` pixels a side) in every layer but ``fullatt_layers``, and the
``patch_merger`` connector (each ``scale_factor`` x ``scale_factor`` block concatenated, then an MLP). Its
``image_size`` is nominal (one merged token's patches: nothing reads it as an image's size). Qwen3-VL (``tower:
qwen3``, :mod:`zoo.model.vision_qwen3`) lays its images out alike, without windows, with a learned position table
(``pos_table`` rows, a square grid resampled to each image) and DeepStack: the states after each of
``deepstack_layers`` merged on their own and added to the language model's first layers. Qwen3.5's tower is
Qwen3-VL's without DeepStack (no ``deepstack_layers``). Other towers add
fields here as the design notes sketch; a name nothing reads yet is not one of them.

Llama 4 (``tower: llama4``, the SigLIP-like layers of :mod:`zoo.model.vision` with :mod:`zoo.model.vision_llama4`'s
pieces): fixed ``image_size`` tiles (the image processor's), a bias-free unfold patch embedding, a class token after
each tile's patches (position row ``patches_per_image``; dropped before the connector), a LayerNorm before the
layers, 2-D RoPE (``rope_theta``) on q and k, exact GELU, and the ``pixel_shuffle_mlp`` connector: SmolVLM's pixel
shuffle, an MLP of ``adapter_dim`` (fc1, GELU, fc2, GELU, no biases), then the projection to the language model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zoo.errors import UserError

CONNECTORS = ("shuffle_linear", "avg_pool", "gemma4", "patch_merger", "pixel_shuffle_mlp")
TOWERS = ("siglip", "gemma4", "qwen2_5", "qwen3", "llama4")


@dataclass(frozen=True)
class VisionConfig:
    """Architecture of an image tower and its connector (frozen and hashable: part of the jit key)."""

    arch: str  # the Hugging Face *ForConditionalGeneration class the model came from
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int  # a fixed-size tower: images (or tiles) are image_size square, padded where smaller
    image_token_id: int
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    norm_eps: float = 1e-6
    connector: str = "shuffle_linear"
    scale_factor: int = 2  # patches per output token along each side (shuffled, or pooled by avg_pool)
    bucketize: bool = True  # SmolVLM's bucketized position rows; False: each patch's own row (Gemma 3)
    image_blocks: bool = False  # each run of image tokens attends within itself both ways (Gemma 3)
    # The tower's tensor-name prefix as the source spelled it, where a family has two (Gemma 3: transformers'
    # save_pretrained writes `vision_tower.`, the Hub's files `vision_tower.vision_model.`); None: the family's
    # default. Names, not architecture: left out of equality and the jit key, read by convert.vision_tables only.
    hf_tower_prefix: str | None = field(default=None, compare=False)
    # Gemma 4's tower (``tower: gemma4``, zoo.model.vision_gemma4): RMSNorms before and after attention and MLP,
    # GQA with q/k/v norms and 2-D RoPE (``rope_theta``), a gated MLP, a (2, pos_table, D) position table read at
    # each patch's column and row; images of any shape up to ``max_soft_tokens`` tokens of scale_factor^2
    # patches each; optionally clipped linears and standardized features. ``blocks_on_full``: whether the image
    # blocks are bidirectional on full-attention layers too (Gemma 3) or on sliding ones alone (Gemma 4).
    tower: str = "siglip"
    num_kv_heads: int = 0  # 0: num_heads
    head_width: int = 0  # 0: hidden_size / num_heads
    pos_table: int = 0  # Gemma 4: a side of its 2-axis table; Qwen3-VL: rows of its square table
    rope_theta: float = 100.0
    max_soft_tokens: int = 0
    clipped: bool = False
    standardize: bool = False
    blocks_on_full: bool = True
    # Qwen2.5-VL's tower (``tower: qwen2_5``, zoo.model.vision_qwen; rope_theta above is its 2-D RoPE's too)
    temporal_patch_size: int = 1  # frames a patch spans (a still image is repeated to fill them)
    window_size: int = 0  # pixels along a side of an attention window (0: no windows)
    fullatt_layers: tuple[int, ...] = ()  # the layers that attend over the whole image, not a window
    # Qwen3-VL's tower (``tower: qwen3``, zoo.model.vision_qwen3): the layers whose states feed DeepStack's mergers,
    # in increasing order; level j's features are added to the language model's states after its layer j.
    deepstack_layers: tuple[int, ...] = ()
    # Llama 4's connector (``pixel_shuffle_mlp``): the width of its adapter MLP (projector_input_dim = _output_dim,
    # the projection's input: vision_output_dim)
    adapter_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("fullatt_layers", "deepstack_layers"):  # JSON gives lists; the config must stay hashable
            object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
        if list(self.deepstack_layers) != sorted(set(self.deepstack_layers)) or any(
                not 0 <= i < self.num_layers for i in self.deepstack_layers):
            raise UserError(f"model config: vision deepstack_layers={list(self.deepstack_layers)} must be increasing "
                            f"tower layers (0 .. {self.num_layers - 1})")
        if self.connector not in CONNECTORS:
            raise UserError(f"model config: vision connector {self.connector!r} is not one of {', '.join(CONNECTORS)}")
        if self.tower not in TOWERS:
            raise UserError(f"model config: vision tower {self.tower!r} is not one of {', '.join(TOWERS)}")
        if self.tower == "gemma4":
            return  # images of any shape: no fixed image_size to check
        if self.hidden_size % self.num_heads:
            raise UserError(f"model config: vision hidden_size={self.hidden_size} is not a multiple of "
                            f"num_heads={self.num_heads}")
        # The conv drops an image's last image_size % patch_size pixels (SmolVLM-Instruct's 384 in 14s): fine;
        # the connector's token groups must tile the patch grid, as transformers' pixel shuffle requires.
        if self.side % self.scale_factor:
            raise UserError(f"model config: vision image_size={self.image_size} // patch_size={self.patch_size} = "
                            f"{self.side} patches a side must be a multiple of scale_factor={self.scale_factor}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head of the tower."""
        return self.head_width or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """The tower's key/value heads (GQA in Gemma 4's tower; every head its own in SigLIP)."""
        return self.num_kv_heads or self.num_heads

    @property
    def side(self) -> int:
        """Patches along each side of a full image (the conv drops the remainder pixels)."""
        return self.image_size // self.patch_size

    @property
    def patches_per_image(self) -> int:
        """Patches of one (padded) image: rows of the position table too (Gemma 4: the most an image may have)."""
        if self.tower == "gemma4":
            return self.max_soft_tokens * self.group
        return self.side**2

    @property
    def group(self) -> int:
        """Patches that make one output token."""
        return self.scale_factor**2

    @property
    def tokens_per_image(self) -> int:
        """Language-model tokens (and features) of one image."""
        return self.patches_per_image // self.group

    @property
    def patch_dim(self) -> int:
        """Width of one flattened patch: channels x frames x patch_size x patch_size."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_patches(self) -> int:
        """Patches along a side of one attention window (Qwen2.5-VL: whole merged tokens; 0: no windows)."""
        return self.window_size // self.scale_factor // self.patch_size * self.scale_factor
