"""Qwen3.5's whole VLM (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration) against transformers,
on tiny random models saved as the Hub's files (the MoE's experts fused, a multi-token-prediction layer under mtp.)
with the tiny Qwen tokenizer and the Hub's image processor type beside them, and `zoo convert`ed: the tower's image
features (Qwen3-VL's tower without DeepStack), image+text logits over several delta-rule chunks (the images' M-RoPE
positions on the full-attention layers, the linear layers position-free), the HF -> zoo -> HF round trip, the rows'
ids and pixels as Qwen3VLProcessor expands them, the registry's qwen3.5-35b-a3b counted as transformers counts it;
slow: the MoE's logits, a packed SFT step's loss, `zoo generate --image` against transformers' greedy `generate`,
and LoRA on the tower exported for peft.

The language models are tests/hf_models.py's tiny Qwen3.5s: Gated DeltaNet layers 0 and 2, gated full attention
with interleaved M-RoPE (sections 2, 1, 1 of 4 frequencies) on layers 1 and 3; the tower tests/vlm_qwen35_models.py's.
"""

import contextlib
import io
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
from tests.vlm_qwen3_models import hf_qwen3_logits, image_row
from tests.vlm_qwen35_models import MTP, hf_qwen35_features, make_qwen35_vlm
from tests.vlm_qwen_models import assert_rows_expand_as_processor, hf_image_reply, random_image
from zoo.cli import main
from zoo.data.qwen_layout import qwen_image_patches
from zoo.data.vision_layout import layout_rows
from zoo.model.vision import VisionInputs

# Three images of different sizes (rows x columns of 4-pixel patches): 6 x 8, 4 x 4 (the position table's own
# grid) and 10 x 6; 12, 4 and 15 image tokens.
IMAGES = [random_image(0, 6, 8), random_image(1, 4, 4), random_image(2, 10, 6)]
SEQ = 150  # three chunks of the delta rule's 64, the last one partial
QUESTION = "What is in this picture?"
TOL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> its tiny VLM (``hf``), saved with the tiny Qwen tokenizer and the Hub's processor files (its image
    processor named Qwen2VLImageProcessorFast, the processor Qwen3VLProcessor, as the Hub's Qwen3.5 files name
    them) and `zoo convert`ed (``ckpt``), its token ids and the conversion's notes; built once a family."""
    from transformers import AutoTokenizer

    from tests.vlm_processors import write_images
    from tests.vlm_qwen_models import qwen_folder, qwen_token_ids

    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            tok = AutoTokenizer.from_pretrained(str(qwen_folder(root / "hf")))
            pre = root / "hf" / "preprocessor_config.json"
            pre.write_text(json.dumps({**json.loads(pre.read_text()), "processor_class": "Qwen3VLProcessor",
                                       "image_processor_type": "Qwen2VLImageProcessorFast"}))
            ids = qwen_token_ids(tok)
            hf = make_qwen35_vlm(root / "hf", family, **ids)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
            write_images(root, [(30, 45), (20, 20)])  # 8 x 6 patches (12 tokens), 4 x 4 (4)
            made[family] = SimpleNamespace(root=root, ckpt=root / "zoo", tok=tok, hf=hf, ids=ids, notes=[
                line for line in err.getvalue().splitlines() if line.startswith("note:")])
        return made[family]

    return get


def _inputs(v, rows, max_patches: int = 72) -> VisionInputs:
    """The batch's VisionInputs of rows of images ((pixel_values, grid) each)."""
    laid = [[qwen_image_patches(v, pixels, grid) for pixels, grid in row] for row in rows]
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(v, laid, max_patches).items()})


def _tokens(ids) -> np.ndarray:
    """Two rows of SEQ tokens: the first with images 0 and 1 (the second in the second chunk), the second with
    image 2 in the second chunk; text ids past the special tokens."""
    grids, text = [g for _, g in IMAGES], (7, ids["vocab_size"])
    return np.stack([image_row(SEQ, [(3, grids[0]), (90, grids[1])], 3, ids, text),
                     image_row(SEQ, [(70, grids[2])], 4, ids, text)])


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_features_and_logits_equal_transformers(built, family):
    """One program: the image features of two rows (the first with two images), each image attending within
    itself, as transformers' tower (no DeepStack) run on the three images at once; and the logits of two rows of
    150 tokens (three delta-rule chunks) with those images, where the forward computes the images' M-RoPE positions
    for the full-attention layers. The MoE (slow): the same through its experts."""
    from zoo.model.decoder import forward
    from zoo.model.vision import encode_with_deepstack

    m = built(family)
    cfg, params = zoo.read_config(m.ckpt), zoo.load_params(m.ckpt)
    assert cfg.vision is not None and cfg.vision.deepstack_layers == () and set(cfg.kinds) == {"linear", "full"}
    tokens = _tokens(m.ids)

    def run(cfg, params, tokens, vision):
        return encode_with_deepstack(cfg, params, vision), forward(cfg, params, tokens, vision=vision)

    (feats, deep), logits = jax.jit(run, static_argnums=0)(cfg, params, jnp.asarray(tokens),
                                                           _inputs(cfg.vision, [IMAGES[:2], IMAGES[2:]]))
    assert deep is None and feats.shape == (2, 18, 64)
    ref, got = hf_qwen35_features(m.hf, IMAGES), np.asarray(feats)
    assert np.abs(got[0, :12] - ref[0]).max() <= TOL and np.abs(got[0, 12:16] - ref[1]).max() <= TOL
    assert np.abs(got[1, :15] - ref[2]).max() <= TOL and min(r.std() for r in ref) > 0.1
    ref_logits, got_logits = hf_qwen3_logits(m.hf, tokens, IMAGES), np.asarray(logits)
    assert np.abs(got_logits - ref_logits).max() <= TOL
    assert mean_kl(ref_logits, got_logits) <= 1e-6 and ref_logits.std() > 0.5


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_round_trip_is_bit_identical(built, family, tmp_path):
    """The conversion says in one line that it leaves the multi-token-prediction layer out; HF -> zoo -> HF gives
    back every other tensor (tower and merger included; the MoE's fused experts as the Hub's files hold them), bit
    for bit, and the config, which transformers loads as the same class."""
    from transformers import AutoModelForImageTextToText

    m = built(family)
    assert m.notes == [f"note: {m.root / 'hf'}: the multi-token-prediction layer (2 tensors under mtp.) is left "
                       "out: lmzoo's model does not run it"]
    assert main(["export", str(m.ckpt), "--out", str(tmp_path / "back")]) == 0
    source, back = hf_tensors(m.root / "hf"), hf_tensors(tmp_path / "back")
    assert set(source) - set(back) == set(MTP) and {k: source[k] for k in back} == back
    assert any(k.startswith("model.visual.blocks.2.") for k in back)
    a = json.loads((m.root / "hf" / "config.json").read_text())
    b = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in a.items() if "dtype" not in k} == {k: v for k, v in b.items() if "dtype" not in k}
    assert type(AutoModelForImageTextToText.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)) is type(m.hf)


def test_rows_expand_as_the_processor_does(built):
    """A conversation with two images: the ids are the tokenized text with each <|image_pad|> replaced as
    Qwen3VLProcessor (transformers' processor for qwen3_5) replaces it, the pixels and grids the image processor's
    (the checkpoint's own files, which name Qwen2VLImageProcessorFast: its PIL twin loads, no torchvision), and the
    image tokens untrained."""
    from transformers import AutoImageProcessor, Qwen3VLProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    m = built("qwen3_5")
    assert PROCESSOR_MAPPING_NAMES["qwen3_5"] == PROCESSOR_MAPPING_NAMES["qwen3_5_moe"] == "Qwen3VLProcessor"
    assert type(AutoImageProcessor.from_pretrained(str(m.ckpt / "tokenizer"), backend="pil")).__name__ == \
        "Qwen2VLImageProcessorPil"
    assert_rows_expand_as_processor(m.root, m.ckpt / "tokenizer", m.tok, Qwen3VLProcessor, QUESTION,
                                    "It is a red square.")


def test_registry_qwen35_is_whole_and_counts_as_transformers():
    """qwen3.5-35b-a3b is the whole Qwen3_5MoeForConditionalGeneration: its released config's model (tower and
    merger included) has transformers' count of the same config (35.11B: 34.66B the language model's, 0.45B the
    tower's), and the tower reads Qwen3-VL's 16-pixel patches merged 2 x 2 without DeepStack."""
    import transformers

    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import count_params
    from zoo.registry.catalogue import get

    hf = get("qwen3.5-35b-a3b").hf_config
    assert hf is not None and hf["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    cfg = model_config_from_hf(hf)
    v = cfg.vision
    assert v is not None and (v.num_layers, v.patch_dim, v.pos_table, v.deepstack_layers) == (27, 1536, 2304, ())
    ours = count_params(cfg)
    with torch.device("meta"):  # shapes only: nothing allocated
        model = transformers.Qwen3_5MoeForConditionalGeneration(transformers.AutoConfig.for_model(**hf))
    assert ours == sum(p.numel() for p in model.parameters())
    assert round(ours / 1e7) == 3511 and abs(get("qwen3.5-35b-a3b").params - ours) / ours < 0.001


@pytest.mark.slow  # a transformers generate oracle through the delta rule's torch reference (about 10 s)
def test_cli_generate_with_an_image_equals_transformers_generate(built, capsys):
    """`zoo generate --prompt TEXT --image A`: the text is transformers' greedy reply to the same prompt ids (the
    user turn with its image part, expanded from the checkpoint's processor files) and pixels: the prefill takes
    the images' M-RoPE positions, each cached step moves by the rope delta, and the linear layers carry their
    state."""
    from zoo.data.tokenizer import load_tokenizer

    m = built("qwen3_5")
    image = str(m.root / "img0.png")
    reply = hf_image_reply(m.hf, m.ckpt, m.root, QUESTION, image)
    want = load_tokenizer(m.ckpt).decode(reply, skip_special_tokens=True)
    assert want.strip() and len(set(reply)) > 1
    capsys.readouterr()
    assert main(["generate", str(m.ckpt), "--prompt", QUESTION, "--image", image, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == want + "\n"


# LoRA targets: Qwen3-VL's tower and merger names (no DeepStack mergers) beside the language model's q_proj; the MoE
# adds the linear layers' in_proj_qkv and the routed experts (peft's target_parameters on the fused experts).
TOWER_TARGETS = ("q_proj", "vision.qkv", "vision.o_proj", "vision.linear_fc1", "vision.linear_fc2", "projector.fc1",
                 "projector.fc2")
PEFT_TARGETS = {"qwen3_5": TOWER_TARGETS,
                "qwen3_5_moe": (*TOWER_TARGETS, "in_proj_qkv", "experts.gate_proj", "experts.up_proj",
                                "experts.down_proj")}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_peft_loads_the_tower_adapters_with_the_zoo_models_image_text_logits(built, family, tmp_path):
    """Slow (peft's model, the merged export and a compilation): LoRA on :data:`PEFT_TARGETS` (the tower's fused
    qkv, attn.proj, linear_fc1/2 and the merger's linear_fc1/2; the MoE's experts too, under the composite model's
    model.language_model.), exported as PEFT: peft loads every key, none left over, wraps those modules and gives
    the zoo forward's image+text logits with the adapters beside their weights (1e-4, KL 1e-6); transformers on
    the merged export the same."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from tests.lora_fixtures import write_adapter_checkpoint
    from zoo.checkpoints.adapter import load_adapters
    from zoo.checkpoints.format import read_meta
    from zoo.lora.params import LoraConfig, lora_scale
    from zoo.lora.weights import Weights
    from zoo.model.decoder import forward

    m = built(family)
    lora_cfg = LoraConfig(rank=4, alpha=4.0, targets=PEFT_TARGETS[family])
    write_adapter_checkpoint(m.ckpt, tmp_path / "adapter", lora_cfg)
    shutil.copy(m.ckpt / "hf_config.json", tmp_path / "adapter" / "hf_config.json")  # as a run's final keeps it
    assert main(["export", str(tmp_path / "adapter"), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    assert main(["export", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    cfg, params = zoo.read_config(m.ckpt), zoo.load_params(m.ckpt)
    adapters = load_adapters(tmp_path / "adapter", read_meta(tmp_path / "adapter"))
    tokens = _tokens(m.ids)
    vision = _inputs(cfg.vision, [IMAGES[:2], IMAGES[2:]])
    ours = np.asarray(jax.jit(lambda a: forward(cfg, Weights(params, a, lora_scale(lora_cfg)), jnp.asarray(tokens),
                                                vision=vision))(adapters))
    base = hf_qwen3_logits(m.hf, tokens, IMAGES)
    fresh = make_qwen35_vlm(tmp_path / "fresh", family, **m.ids)  # the same seed: the same model, unwrapped
    peft = PeftModel.from_pretrained(fresh, str(tmp_path / "peft")).eval()
    result = peft.load_adapter(str(tmp_path / "peft"), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    peft.delete_adapter("again")
    wrapped = {n.removeprefix("base_model.model.") for n, mod in peft.named_modules() if hasattr(mod, "lora_A")}
    assert {"model.language_model.layers.1.self_attn.q_proj", "model.visual.blocks.1.attn.qkv",
            "model.visual.blocks.2.attn.proj", "model.visual.blocks.0.mlp.linear_fc2",
            "model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"} <= wrapped
    if family == "qwen3_5_moe":
        assert {"model.language_model.layers.0.linear_attn.in_proj_qkv",
                "model.language_model.layers.3.mlp.experts"} <= wrapped
    got = hf_qwen3_logits(peft, tokens, IMAGES)
    assert np.abs(got - base).max() > 0.1  # the adapters change the model: the comparisons have teeth
    assert np.abs(got - ours).max() <= TOL and mean_kl(got, ours) <= 1e-6
    merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    assert np.abs(hf_qwen3_logits(merged, tokens, IMAGES) - ours).max() <= TOL

def _hf_sft_loss(m) -> float:
    """transformers' mean next-token cross-entropy over data.jsonl's rows: the zoo's ids and pixels (equal to the
    processor's: test_rows_expand_as_the_processor_does), labels -100 wherever the zoo trains nothing."""
    from chat.formats import normalize
    from chat.images import ImageExpander, tokenize_with_images

    expander = ImageExpander.from_folder(m.ckpt / "tokenizer", m.tok)
    total, count = 0.0, 0
    for line in (m.root / "data.jsonl").read_text().splitlines():
        t = tokenize_with_images(normalize(json.loads(line), "messages"), m.tok, expander, m.root)
        labels = np.where(t.mask, t.ids, -100)
        (image,) = t.images
        ids = torch.tensor(t.ids[None], dtype=torch.long)
        with torch.no_grad():
            out = m.hf(input_ids=ids, pixel_values=torch.tensor(image.pixel_values),
                       image_grid_thw=torch.tensor([image.grid_thw]),
                       mm_token_type_ids=(ids == m.hf.config.image_token_id).int(),
                       labels=torch.tensor(labels[None], dtype=torch.long))
        n = int((labels[1:] != -100).sum())
        total, count = total + float(out.loss) * n, count + n
    return total / count


@pytest.mark.slow
def test_packed_sft_step_loss_is_transformers(built, tmp_path):
    """Slow (a training run): two chat rows with images of different sizes packed into one row (their 48 + 16
    patches in data.max_patches; the tower and merger frozen, for time): step 1's loss is transformers' over the two
    rows apart, each document's M-RoPE positions its own and the linear layers' state restarting at each
    document."""
    from pretrain.config import load_config
    from pretrain.loop import train
    from sft.config import SFTConfig
    from sft.task import SFTTask
    from tests.run_files import read_metrics, write_jsonl

    m = built("qwen3_5")
    write_jsonl(m.root / "data.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                      {"role": "assistant", "content": answer}], "images": [name]}
        for answer, name in (("It is a red square.", "img0.png"), ("It is a blue circle.", "img1.png"))])
    cfg = load_config(None, [f"model.path={m.ckpt}", f"data.path={m.root / 'data.jsonl'}", "data.seq_len=144",
                             "data.packing=true", "data.max_patches=64", "batch_size=1", "max_steps=1",
                             "optimizer.learning_rate=0.01", "schedule.name=constant", "log_every=1",
                             "checkpoint.every=100", f"output_dir={tmp_path}", "model.freeze=[vision,projector]"],
                      SFTConfig)
    train(cfg, progress=False, task=SFTTask(cfg))
    assert abs(read_metrics(tmp_path)[0]["loss"] - _hf_sft_loss(m)) <= 1e-5
