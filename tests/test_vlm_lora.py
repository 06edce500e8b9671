"""LoRA on a vision-language model's image tower and connector, on a tiny SmolVLM (tests/vlm_models.py): the targets
that name them, the adapters beside the tower's projections equal to peft's on transformers' model (image+text
logits, 1e-4) and to the merged export, the PEFT export that tells the tower's q_proj from the language model's,
``remat`` on the tower's layer scan, and the one-line errors of targets a model cannot take."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import hf_tensors, mean_kl
from tests.lora_fixtures import write_adapter_checkpoint
from tests.program_checks import saved_residuals
from tests.run_files import one_line_error, write_jsonl
from tests.vlm_models import TOKENS_PER_IMAGE, hf_vlm_logits, image, make_vlm
from tests.vlm_processors import smolvlm_folder, write_images
from zoo.checkpoints.adapter import load_adapters
from zoo.checkpoints.format import read_meta
from zoo.cli import main as zoo_main
from zoo.data.vision_layout import image_patches, layout_rows
from zoo.errors import UserError
from zoo.lora.params import BASE_TARGETS, LoraConfig, lora_scale, lora_specs, target_modules
from zoo.lora.weights import Weights
from zoo.model.decoder import forward
from zoo.model.vision import VisionInputs, encode_images

# Every language-model projection, and the tower's and the connector's, the tower's in transformers' spelling too.
TARGETS = ["all", "vision.q_proj", "vision.k_proj", "vision.v_proj", "vision.out_proj", "vision.fc1", "vision.fc2",
           "projector.proj"]
VISION_NAMES = ("vision.q_proj", "vision.k_proj", "vision.v_proj", "vision.o_proj", "vision.up_proj",
                "vision.down_proj")
TOL = 1e-4
PEFT = "base_model.model."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny random SmolVLM of the tiny SmolVLM tokenizer (tests/vlm_processors.py), converted (``zoo``, its image
    processor beside its tokenizer); an adapter checkpoint on TARGETS with random A and B, exported as PEFT
    (``peft``) and merged (``merged``); two rows of one image each (``tokens``, ``images``)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vlm_lora")
    proc = smolvlm_folder(root / "proc", splitting=False)
    tok = AutoTokenizer.from_pretrained(str(proc))
    image_id = tok.convert_tokens_to_ids("<image>")
    make_vlm(root / "hf", vocab_size=len(tok), image_token_id=image_id)
    assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    for f in proc.iterdir():
        shutil.copy(f, root / "zoo" / "tokenizer" / f.name)
    lora_cfg = LoraConfig(rank=4, alpha=8.0, targets=TARGETS)
    adapter = _adapter_checkpoint(root / "zoo", root / "adapter", lora_cfg)
    assert zoo_main(["export", str(adapter), "--adapter", "--out", str(root / "peft")]) == 0
    assert zoo_main(["export", str(adapter), "--out", str(root / "merged")]) == 0
    rng = np.random.RandomState(3)
    tokens = rng.randint(0, min(image_id, 300), (2, 16)).astype(np.int32)  # text ids, never the image token
    for row, at in ((0, 3), (1, 9)):
        tokens[row, at:at + TOKENS_PER_IMAGE] = image_id
    return SimpleNamespace(root=root, tok=tok, hf=root / "hf", base=root / "zoo", adapter=adapter,
                           lora_cfg=lora_cfg, tokens=tokens, images=[image(1), image(2, rows=13, cols=20)])


def _adapter_checkpoint(base, out, lora_cfg: LoraConfig, seed: int = 0):
    """An adapter checkpoint with random A and B (tests/lora_fixtures.py), with the base's Hugging Face config as a
    run's final keeps it (pretrain/final.py): a vision-language model's export needs it."""
    write_adapter_checkpoint(base, out, lora_cfg, seed)
    shutil.copy(base / "hf_config.json", out / "hf_config.json")
    return out


def _inputs(cfg, images) -> VisionInputs:
    """One image per row: the batch's VisionInputs (16 patches a row)."""
    rows = [[image_patches(cfg.vision, pixels, mask)] for pixels, mask in images]
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(cfg.vision, rows, 16).items()})


def _load_hf(folder):
    """transformers' float32 SmolVLM from ``folder`` (eager attention, as tests/vlm_models.py's)."""
    from transformers import SmolVLMForConditionalGeneration

    return SmolVLMForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32,
                                                           attn_implementation="eager").eval()


def _load_peft(vlm, folder):
    """peft's model: the HF base with the exported adapter, unmerged; every key of the file loaded, none left
    over, none missing (load_adapter reports what from_pretrained only warns about)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(_load_hf(vlm.hf), str(folder)).eval()
    result = model.load_adapter(str(folder), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    model.delete_adapter("again")
    return model


def _hf_logits(model, vlm) -> np.ndarray:
    return hf_vlm_logits(model, vlm.tokens, np.stack([p for p, _ in vlm.images]),
                         np.stack([m for _, m in vlm.images]))


def test_targets_name_the_tower_and_the_connector_apart(vlm):
    """The bare names and ``all`` are the language model's (the default adapts nothing else); ``vision.*`` (the
    text names, or transformers' out_proj/fc1/fc2) the tower's and ``projector.proj`` the connector's; a regex
    picks the tower's where peft would (by module path: its q/k/v_proj, not its out_proj or fc2), on the model's own
    tower's paths."""
    assert target_modules(LoraConfig(targets="all")) == BASE_TARGETS
    assert target_modules(LoraConfig(targets=TARGETS)) == (*BASE_TARGETS, *VISION_NAMES, "projector.proj")
    assert target_modules(LoraConfig(targets="vision.fc1")) == ("vision.up_proj",)
    assert target_modules(LoraConfig(targets=r".*\.(q|v)_proj")) == ("q_proj", "v_proj", "vision.q_proj",
                                                                      "vision.v_proj")
    # without a model, a regex meets every family's language-model names: Qwen3-Next's linear layers' too
    assert target_modules(LoraConfig(targets=r".*text_model.*")) == (*BASE_TARGETS, "in_proj_qkvz", "in_proj_ba",
                                                                     "out_proj")
    with pytest.raises(UserError, match="unknown target modules"):
        LoraConfig(targets=["vision.qk_proj"])
    cfg = zoo.read_config(vlm.base)
    assert target_modules(LoraConfig(targets=".*vision_model.*"), cfg) == VISION_NAMES
    # without a model, every tower's paths: Llama 4's adapter MLP sits under its vision_model too
    assert target_modules(LoraConfig(targets=".*vision_model.*")) == (*VISION_NAMES, "projector.fc1", "projector.fc2")
    # On a model, a regex meets its own tower's paths (SmolVLM's fc2 is no down_proj); without one (a config checked
    # on its own), every tower's: Qwen2.5-VL's has an mlp.down_proj (and Llama 4's a self_attn.o_proj).
    assert target_modules(LoraConfig(targets=r".*\.(o|down)_proj"), cfg) == ("o_proj", "down_proj")
    assert target_modules(LoraConfig(targets=r".*\.(o|down)_proj")) == ("o_proj", "down_proj", "vision.o_proj",
                                                                        "vision.down_proj")  # Llama 4's o_proj
    assert not any(p.startswith(("vision.", "projector.")) for p in lora_specs(cfg, LoraConfig(rank=4)))
    specs = lora_specs(cfg, vlm.lora_cfg)
    # The tower's stacks keep their layers axis; o contracts heads and head_dim; the connector has no layers axis.
    assert specs["vision.layers.q.b"].shape == (2, 4, 2, 16)
    assert specs["vision.layers.o.a"].shape == (2, 2, 16, 4)
    assert specs["projector.proj.a"].shape == (128, 4) and specs["projector.proj.b"].shape == (4, 64)
    assert specs["projector.proj.b"].axes == (None, "embed")
    # A regex that reaches a tower picks nothing on a text model; lora_specs adapts its language model.
    text = zoo.ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, head_dim=8)
    assert {p.rpartition(".")[0] for p in lora_specs(text, LoraConfig(targets=".*"))} == {
        f"layers.{w}" for w in ("q", "k", "v", "o", "gate", "up", "down")}


def test_peft_loads_the_adapters_with_the_zoo_models_image_text_logits(vlm):
    """peft's SmolVLM with the exported adapter (LM, tower and connector) gives the zoo forward's image+text logits
    with the adapters beside their weights (1e-4, KL 1e-6), and transformers' merged export the same."""
    cfg, params = zoo.read_config(vlm.base), zoo.load_params(vlm.base)
    adapters = load_adapters(vlm.adapter, read_meta(vlm.adapter))
    weights = Weights(params, adapters, lora_scale(vlm.lora_cfg))
    ours = np.asarray(jax.jit(forward, static_argnums=0)(cfg, weights, jnp.asarray(vlm.tokens),
                                                         vision=_inputs(cfg, vlm.images)))
    model = _load_peft(vlm, vlm.root / "peft")
    got = _hf_logits(model, vlm)
    base = _hf_logits(_load_hf(vlm.hf), vlm)
    assert np.abs(got - base).max() > 0.1  # the adapters change the model: the comparisons have teeth
    assert np.abs(got - ours).max() <= TOL and mean_kl(got, ours) <= 1e-6
    assert np.abs(_hf_logits(_load_hf(vlm.root / "merged"), vlm) - got).max() <= TOL
    # The tower's and the connector's adapters are there, and count: peft without them is another model.
    wrapped = {n for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert "base_model.model.model.vision_model.encoder.layers.1.self_attn.out_proj" in wrapped
    assert "base_model.model.model.connector.modality_projection.proj" in wrapped
    with model.disable_adapter():
        np.testing.assert_allclose(_hf_logits(model, vlm), base, atol=1e-6)


def test_the_export_tells_the_towers_q_proj_from_the_language_models(vlm):
    """adapter_config.json's target_modules is one regex of the adapted modules' paths; each tensor of the file is
    the zoo adapter's (lora_B @ lora_A is scale's delta of the merged export); an adapter of the language model
    alone adapts no module of the tower in peft (a list of names would wrap the tower's q/k/v_proj too)."""
    import re

    from safetensors.numpy import load_file

    config = json.loads((vlm.root / "peft" / "adapter_config.json").read_text())
    regex = config["target_modules"]
    assert isinstance(regex, str)
    assert re.fullmatch(regex, "model.text_model.layers.1.self_attn.q_proj")
    assert re.fullmatch(regex, "model.vision_model.encoder.layers.0.mlp.fc2")
    assert not re.fullmatch(regex, "model.vision_model.encoder.layers.0.layer_norm1")
    saved = load_file(str(vlm.root / "peft" / "adapter_model.safetensors"))
    assert len(saved) == 2 * (7 * 2 + 6 * 2 + 1)  # A and B: 7 LM projections and 6 tower ones a layer, 2 layers each
    # Untouched tensors of the merged export are the source's bit for bit; the adapted ones moved by B @ A.
    source, merged = hf_tensors(vlm.hf), hf_tensors(vlm.root / "merged")
    assert source.keys() == merged.keys()
    adapted = {k.removeprefix(PEFT).replace(".lora_A", "") for k in saved if ".lora_A." in k}
    assert {k for k in source if source[k] != merged[k]} == adapted
    name = "model.vision_model.encoder.layers.1.self_attn.out_proj"
    delta = lora_scale(vlm.lora_cfg) * saved[f"{PEFT}{name}.lora_B.weight"] @ saved[f"{PEFT}{name}.lora_A.weight"]
    w0, w1 = (np.frombuffer(t[name + ".weight"][1], np.float32).reshape(32, 32) for t in (source, merged))
    np.testing.assert_allclose(w1 - w0, delta, atol=1e-6)

    card = (vlm.root / "peft" / "README.md").read_text()
    assert "AutoModelForImageTextToText.from_pretrained(\"BASE\")" in card and "pipeline_tag: image-text-to-text" in card

    lm_only = _adapter_checkpoint(vlm.base, vlm.root / "lm_only", LoraConfig(rank=4, targets="all"), seed=1)
    out = vlm.root / "lm_only_peft"
    assert zoo_main(["export", str(lm_only), "--adapter", "--out", str(out)]) == 0
    model = _load_peft(vlm, out)
    wrapped = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert len(wrapped) == 7 * 2 and not any("vision_model" in n or "connector" in n for n in wrapped)


def _tower_case(vlm):
    cfg, params = zoo.read_config(vlm.base), zoo.load_params(vlm.base)
    return cfg, params, _inputs(cfg, vlm.images)


def test_remat_applies_to_the_towers_layer_scan(vlm):
    """``remat: full`` wraps the tower's layers in a checkpoint: the backward pass of the whole forward keeps no
    tower attention probabilities [layers, rows, heads, patches, patches], only each layer's input, and the
    tower's gradients equal those without remat."""
    cfg, params, vision = _tower_case(vlm)
    tokens = jnp.asarray(vlm.tokens)

    def loss(p, remat):
        return jax.nn.log_softmax(forward(cfg, p, tokens, remat=remat, vision=vision))[..., 0].mean()

    probs = (cfg.vision.num_layers, 2, cfg.vision.num_heads, 16, 16)

    def tower_residuals(remat):
        return [shape for shape, src in saved_residuals(lambda p: loss(p, remat), params)
                if "vision.py" in src and "(tower)" in src]

    assert probs in tower_residuals("none")
    kept = tower_residuals("full")
    assert probs not in kept and (cfg.vision.num_layers, 2, 16, cfg.vision.hidden_size) in kept
    assert "remat" in str(jax.make_jaxpr(jax.grad(lambda p: loss(p, "full")))(params))

    def tower_loss(p, remat):
        return (encode_images(cfg, p, vision, remat) ** 2).mean()

    # One program holds both gradients: one compilation.
    both = jax.jit(lambda p: (jax.grad(tower_loss)(p, "none"), jax.grad(tower_loss)(p, "full")))
    plain, remat = both(params)
    for a, b in zip(jax.tree.leaves(plain["vision"]), jax.tree.leaves(remat["vision"]), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(plain["vision"]["layers"])) > 0


def _one_line_error(capsys, args) -> str:
    from sft.cli import main as sft_main

    return one_line_error(capsys, sft_main, ["train", *args])


def _data(vlm) -> str:
    """Two rows of one image each (TRL's vision rows) beside the model; the file's path."""
    names = write_images(vlm.root, [(28, 28), (20, 28)])
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in "
                                                                              "this picture?"}]},
                          {"role": "assistant", "content": answer}], "images": [name]}
            for answer, name in zip(["It is a red square.", "It is a blue circle."], names)]
    write_jsonl(vlm.root / "data.jsonl", rows)
    return str(vlm.root / "data.jsonl")


def _run_args(vlm, out, *overrides) -> list[str]:
    return [f"model.path={vlm.base}", f"data.path={_data(vlm)}", "data.seq_len=64", "data.packing=false",
            "batch_size=2", "optimizer.learning_rate=0.01", "schedule.name=constant", "log_every=1",
            "checkpoint.every=100", f"output_dir={out}", "lora.rank=4", "lora.alpha=8", *overrides]


def test_targets_a_model_cannot_take_are_one_line_errors(vlm, tmp_path, capsys):
    """Exit 2, one line, before step 1: adapters on a part model.freeze keeps as it is; and (the set-up's own
    check) a tower named on a model without one, where a regex reaching a tower is no request for one."""
    from pretrain.config import TrainConfig, load_config
    from pretrain.setup import check_vision_lora, lora_config

    err = _one_line_error(capsys, _run_args(vlm, tmp_path / "o", "max_steps=1", "lora.targets=[all,vision.q_proj]",
                                            "model.freeze=[vision,projector]"))
    assert err == ("lora.targets adapt vision.q_proj, and model.freeze keeps vision as it is; drop vision from "
                   "model.freeze to train adapters there, or those targets to keep it frozen")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").rglob("metrics.jsonl"))
    text = zoo.ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, head_dim=8)
    base = ["model.path=m", "data.path=d", "max_steps=1", "lora.rank=4"]
    cfg = load_config(None, [*base, "lora.targets=q_proj,projector.proj"], TrainConfig)
    with pytest.raises(UserError, match=r"name an image tower or connector \(projector.proj\), and the model "
                                        r"\(llama\) has none"):
        check_vision_lora(cfg, text, lora_config(cfg))
    cfg = load_config(None, [*base, "lora.targets=.*"], TrainConfig)
    check_vision_lora(cfg, text, lora_config(cfg))  # a regex: the text model's projections alone


@pytest.mark.slow
def test_lora_on_the_tower_trains_its_adapters(vlm, tmp_path):
    """Slow: a 2-step LoRA run of its own (its own compilation), with LoRA dropout and remat. Adapters on the
    tower and the connector beside the language model's all move from their zero start; the recorded targets
    name them, so the checkpoint loads (zoo.load merges the tower's too) with the base's tower moved."""
    from pretrain.config import load_config
    from pretrain.loop import train
    from sft.config import SFTConfig
    from sft.task import SFTTask

    cfg = load_config(None, _run_args(vlm, tmp_path / "run", "max_steps=2", "remat=full", "lora.dropout=0.1",
                                      "lora.targets=[all,vision.q_proj,vision.fc2,projector.proj]"), SFTConfig)
    final = train(cfg, progress=False, task=SFTTask(cfg))
    meta = read_meta(final)
    assert meta["lora"]["target_modules"] == [*BASE_TARGETS, "vision.q_proj", "vision.down_proj", "projector.proj"]
    adapters = jax.tree_util.tree_leaves_with_path(load_adapters(final, meta))
    b = {jax.tree_util.keystr(p): np.asarray(x) for p, x in adapters if getattr(p[-1], "key", None) == "b"}
    assert "['vision']['layers']['q']['b']" in b and "['projector']['proj']['b']" in b
    assert all(np.abs(x).max() > 0 for x in b.values()), [k for k, x in b.items() if not np.abs(x).any()]
    merged, base = zoo.load_params(final), zoo.load_params(vlm.base)
    assert not np.array_equal(merged["vision"]["layers"]["q"], base["vision"]["layers"]["q"])
    np.testing.assert_array_equal(merged["vision"]["layers"]["k"], base["vision"]["layers"]["k"])
