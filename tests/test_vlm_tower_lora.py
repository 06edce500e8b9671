"""LoRA on the image towers and connectors of Gemma 3, Gemma 4, Qwen2.5-VL and Qwen3-VL, one tiny random transformers
model each: the adapters beside the towers' projections (Gemma 4's clipped linears, the Qwen towers' fused qkv,
their mergers, Qwen3-VL's DeepStack mergers; Gemma 3's connector, a bare parameter) exported as PEFT, which peft
loads on transformers' model with the zoo's image+text logits (1e-4, KL 1e-6); and on Qwen3-VL the gradients of
every adapter, through the tower, against torch's autograd of the same loss on peft's model."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import mean_kl
from tests.lora_fixtures import write_adapter_checkpoint
from tests.vlm_gemma4_models import BOI as G4_BOI
from tests.vlm_gemma4_models import EOI as G4_EOI
from tests.vlm_gemma4_models import IMAGE as G4_IMAGE
from tests.vlm_gemma4_models import grid_images, make_gemma4_vlm
from tests.vlm_models import gemma3_row, hf_gemma3_logits, image, make_gemma3
from tests.vlm_qwen3_models import hf_qwen3_logits, image_row, make_qwen3
from tests.vlm_qwen_models import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    hf_qwen_logits,
    make_qwen,
    qwen_row,
    random_image,
)
from zoo.checkpoints.adapter import load_adapters
from zoo.checkpoints.format import read_meta
from zoo.cli import main
from zoo.data.gemma4_layout import gemma4_image_patches
from zoo.data.qwen_layout import qwen_image_patches
from zoo.data.vision_layout import image_patches, layout_rows
from zoo.lora.params import LoraConfig, lora_scale
from zoo.lora.vision_targets import VISION_PATHS, tower_kind
from zoo.lora.weights import Weights
from zoo.model.decoder import forward
from zoo.model.vision import VisionInputs

TOL = 1e-4
PEFT = "base_model.model."
QWEN_IDS = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                vision_end_token_id=VISION_END)
QWEN_IMAGES = [random_image(0, 6, 8), random_image(1, 4, 4)]  # 12 and 4 merged tokens; the first spans 2 windows


@dataclass(frozen=True)
class Case:
    """One family: its tiny transformers model, the targets adapted (the language model's beside the tower's and
    the connector's), the modules peft must wrap, two rows with their images, and transformers' logits of them."""

    make: Callable
    targets: tuple[str, ...]
    wrapped: tuple[str, ...]  # module paths (layer 1 where stacked) that must carry adapters in peft's model
    tokens: Callable[[], np.ndarray]
    inputs: Callable  # (zoo config) -> VisionInputs of the rows' images
    hf_logits: Callable  # (transformers model, tokens) -> logits
    hf_call: Callable | None = None  # (transformers model, tokens) -> the output, gradients on: checks the gradients


def _laid(cfg, rows: list[list], most: int) -> VisionInputs:
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(cfg.vision, rows, most).items()})


def _gemma4_tokens() -> np.ndarray:
    rows = np.random.RandomState(1).randint(1, 90, (2, 20))
    for row, at, count in ((0, 3, 8), (1, 9, 4)):
        rows[row, at], rows[row, at + 1: at + 1 + count], rows[row, at + 1 + count] = G4_BOI, G4_IMAGE, G4_EOI
    return rows


def _gemma4_logits(hf, tokens: np.ndarray) -> np.ndarray:
    images = grid_images()
    with torch.no_grad():
        return hf(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(images["pixel_values"]),
                  image_position_ids=torch.tensor(images["image_position_ids"]),
                  mm_token_type_ids=torch.tensor((tokens == G4_IMAGE).astype(np.int64))).logits.float().numpy()


def _gemma4_inputs(cfg) -> VisionInputs:
    images = grid_images()
    rows = [[gemma4_image_patches(cfg.vision, images["pixel_values"][k], images["image_position_ids"][k])] for k in (0, 1)]
    return _laid(cfg, rows, cfg.vision.patches_per_image)


def _qwen_tokens() -> np.ndarray:
    return np.stack([qwen_row(24, [(3, QWEN_IMAGES[0][1])], seed=3), qwen_row(24, [(10, QWEN_IMAGES[1][1])], seed=4)])


def _qwen_inputs(cfg) -> VisionInputs:
    return _laid(cfg, [[qwen_image_patches(cfg.vision, *QWEN_IMAGES[k])] for k in (0, 1)], 48)


def _qwen3_tokens() -> np.ndarray:
    ids = {**QWEN_IDS, "vocab_size": 96}
    return np.stack([image_row(24, [(3, QWEN_IMAGES[0][1])], 3, ids, (0, VISION_START)),
                     image_row(24, [(10, QWEN_IMAGES[1][1])], 4, ids, (0, VISION_START))])


# Gemma 4's language model cut to one (sliding, full) pair without shared key/value layers: the tower is the point,
# and a deeper model only compiles longer.
GEMMA4_TEXT = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0)
GEMMA3_PIXELS = np.stack([image(1)[0], image(2)[0]])
CASES = {
    # Gemma 3: the language model's q_proj beside the SigLIP tower's (told apart), fc2, and the connector's bare
    # projection parameter (peft's target_parameters).
    "gemma3": Case(make_gemma3, ("q_proj", "vision.q_proj", "vision.fc2", "projector.proj"),
                   ("model.language_model.layers.1.self_attn.q_proj", "model.vision_tower.encoder.layers.1.self_attn.q_proj",
                    "model.vision_tower.encoder.layers.1.mlp.fc2", "model.multi_modal_projector"),
                   lambda: np.stack([gemma3_row(16, [3], seed=3), gemma3_row(16, [8], seed=4)]),
                   lambda cfg: _laid(cfg, [[image_patches(cfg.vision, p)] for p in GEMMA3_PIXELS], 16),
                   lambda hf, tokens: hf_gemma3_logits(hf, tokens, GEMMA3_PIXELS)),
    # Gemma 4: every projection of the tower (clipped linears: peft wraps the Linear inside) and the embedder's.
    "gemma4": Case(lambda folder: make_gemma4_vlm(folder, **GEMMA4_TEXT), ("q_proj", "vision.q_proj", "vision.k_proj", "vision.v_proj", "vision.o_proj",
                                     "vision.gate_proj", "vision.up_proj", "vision.down_proj", "projector.proj"),
                   ("model.vision_tower.encoder.layers.1.self_attn.k_proj.linear",
                    "model.vision_tower.encoder.layers.1.mlp.gate_proj.linear", "model.embed_vision.embedding_projection"),
                   _gemma4_tokens, _gemma4_inputs, _gemma4_logits),
    # Qwen2.5-VL: the fused qkv whole, attn.proj, the SwiGLU MLP (down_proj beside the language model's) and the
    # merger's mlp.0 / mlp.2.
    "qwen2_5": Case(make_qwen, ("down_proj", "vision.qkv", "vision.proj", "vision.gate_proj", "vision.up_proj",
                                "vision.down_proj", "projector.fc1", "projector.fc2"),
                    ("model.language_model.layers.1.mlp.down_proj", "model.visual.blocks.1.attn.qkv",
                     "model.visual.blocks.1.mlp.down_proj", "model.visual.merger.mlp.0", "model.visual.merger.mlp.2"),
                    _qwen_tokens, _qwen_inputs, lambda hf, tokens: hf_qwen_logits(hf, tokens, QWEN_IMAGES)),
    # Qwen3-VL: the fused qkv, attn.proj, linear_fc1/2, the merger's and both DeepStack mergers'.
    "qwen3": Case(lambda folder: make_qwen3(folder, 96, **QWEN_IDS),
                  ("q_proj", "vision.qkv", "vision.o_proj", "vision.linear_fc1", "vision.linear_fc2", "projector.fc1",
                   "projector.fc2", "projector.deepstack.fc1", "projector.deepstack.fc2"),
                  ("model.visual.blocks.1.attn.qkv", "model.visual.blocks.1.mlp.linear_fc2",
                   "model.visual.merger.linear_fc1", "model.visual.deepstack_merger_list.1.linear_fc2"),
                  _qwen3_tokens, _qwen_inputs, lambda hf, tokens: hf_qwen3_logits(hf, tokens, QWEN_IMAGES),
                  lambda hf, ids: hf(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                                     pixel_values=torch.tensor(np.concatenate([p for p, _ in QWEN_IMAGES])),
                                     image_grid_thw=torch.tensor([g for _, g in QWEN_IMAGES]))),
}


# The fast lane keeps Qwen2.5-VL's case (about 4 s); the other three (peft oracle runs of 6 to 10 s on a quiet
# 2-core machine) run in the full suite.
@pytest.fixture(scope="module", params=[k if k == "qwen2_5" else pytest.param(k, marks=pytest.mark.slow) for k in CASES])
def family(request, tmp_path_factory):
    """A family's tiny model saved (``hf``, transformers' ``model``) and `zoo convert`ed (``base``); an adapter
    checkpoint on its targets with random A and B (``adapter``), exported as PEFT (``peft``) and merged
    (``merged``)."""
    case = CASES[request.param]
    root = tmp_path_factory.mktemp(f"tower_lora_{request.param}")
    model = case.make(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    lora_cfg = LoraConfig(rank=4, alpha=4.0, targets=case.targets)
    write_adapter_checkpoint(root / "zoo", root / "adapter", lora_cfg)
    shutil.copy(root / "zoo" / "hf_config.json", root / "adapter" / "hf_config.json")  # as a run's final keeps it
    assert main(["export", str(root / "adapter"), "--adapter", "--out", str(root / "peft")]) == 0
    assert main(["export", str(root / "adapter"), "--out", str(root / "merged")]) == 0
    return SimpleNamespace(name=request.param, case=case, root=root, model=model, base=root / "zoo",
                           adapter=root / "adapter", lora_cfg=lora_cfg)


def _peft_model(f):
    """peft's model: transformers' base with the exported adapter (trainable: its adapters take gradients), every
    key of the file loaded, none left over, none missing (load_adapter reports what from_pretrained only warns
    about)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(f.model, str(f.root / "peft"), is_trainable=True)
    result = model.load_adapter(str(f.root / "peft"), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    model.delete_adapter("again")
    return model.train(False)


def _loss(logits, tokens):
    """Mean next-token cross-entropy of logits [rows, seq, vocab] (jax or torch alike)."""
    xp = jnp if isinstance(logits, jax.Array) else torch
    logp = xp.log_softmax(logits[:, :-1], -1) if xp is torch else jax.nn.log_softmax(logits[:, :-1], -1)
    target = tokens[:, 1:, None]
    picked = jnp.take_along_axis(logp, target, -1) if xp is jnp else torch.gather(logp, -1, target)
    return -picked.mean()


def _zoo(f, grads: bool):
    """The zoo's logits of the case's rows with the adapters beside their weights; with ``grads`` also the loss's
    gradient of every adapter (one program)."""
    cfg, params = zoo.read_config(f.base), zoo.load_params(f.base)
    adapters = load_adapters(f.adapter, read_meta(f.adapter))
    tokens, vision = jnp.asarray(f.case.tokens()), f.case.inputs(cfg)
    scale = lora_scale(f.lora_cfg)

    def run(adapters):
        logits = forward(cfg, Weights(params, adapters, scale), tokens, vision=vision)
        return _loss(logits, tokens), logits

    if not grads:
        return np.asarray(jax.jit(run)(adapters)[1]), None
    (_, logits), g = jax.jit(jax.value_and_grad(run, has_aux=True))(adapters)
    return np.asarray(logits), g


def test_peft_loads_the_tower_adapters_with_the_zoo_models_image_text_logits(family):
    """The family's module paths that regex targets meet are transformers' Linears; peft's model with the exported
    adapter wraps the tower's and the connector's modules (and the language model's of the same names apart), and
    gives the zoo forward's image+text logits with the adapters beside their weights (1e-4, KL 1e-6); transformers
    on the merged export the same (1e-4); the adapters move the logits. Qwen3-VL's case also checks every
    adapter's gradient against torch's autograd (:func:`_assert_gradients_equal_torchs`)."""
    f = family
    cfg = zoo.read_config(f.base)
    # The module paths a regex target meets (zoo.lora.vision_targets) are transformers' model's Linears.
    modules = dict(f.model.named_modules())
    paths = VISION_PATHS[tower_kind(cfg.vision.tower, cfg.vision.connector)]
    assert all(isinstance(modules.get(p), torch.nn.Linear) for p in paths.values()), paths
    tokens = f.case.tokens()
    ours, grads = _zoo(f, grads=f.case.hf_call is not None)
    base = f.case.hf_logits(f.model, tokens)
    model = _peft_model(f)
    wrapped = {n.removeprefix(PEFT) for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert set(f.case.wrapped) <= wrapped, set(f.case.wrapped) - wrapped
    got = f.case.hf_logits(model, tokens)
    assert np.abs(got - base).max() > 0.1  # the adapters change the model: the comparisons have teeth
    assert np.abs(got - ours).max() <= TOL and mean_kl(got, ours) <= 1e-6
    with model.disable_adapter():  # every adapter off: the base model again
        np.testing.assert_allclose(f.case.hf_logits(model, tokens), base, atol=1e-6)
    from transformers import AutoModelForImageTextToText

    merged = AutoModelForImageTextToText.from_pretrained(str(f.root / "merged"), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    assert np.abs(f.case.hf_logits(merged, tokens) - ours).max() <= TOL
    if grads is not None:
        _assert_gradients_equal_torchs(f, model, grads)


def _assert_gradients_equal_torchs(f, model, grads) -> None:
    """Each adapter's gradient of the mean next-token loss (the language model's, the tower's through its layers,
    the mergers') is torch's autograd of the same loss on peft's model, tensor by tensor in peft's layout (each
    within 1e-4 of its largest entry), and the tower's are not zero."""
    from convert.peft_plan import LORA_LAYOUTS, plan_adapter
    from zoo.model.params import flatten

    ids = torch.tensor(f.case.tokens(), dtype=torch.long)
    model.zero_grad()
    _loss(f.case.hf_call(model, ids).logits.float(), ids).backward()
    theirs = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    ours = {p: np.asarray(g) for p, g in flatten(grads).items()}
    planned = plan_adapter(f.adapter, read_meta(f.adapter))
    assert len(theirs) == len(planned)  # every adapter tensor peft holds has its gradient checked
    for t in planned:
        layout = LORA_LAYOUTS[t.transform]
        g = ours[t.zoo] if t.index is None else ours[t.zoo][t.index]
        want = theirs[t.name.replace(".weight", ".default.weight")]
        got = (layout.a if t.zoo.endswith(".a") else layout.b)(g)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), t.name
        if t.zoo.startswith(("vision.", "projector.")):
            assert np.abs(want).max() > 1e-6, t.name
