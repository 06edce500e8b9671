"""`zoo export --adapter`: a LoRA adapter checkpoint as a PEFT folder that peft loads onto the base model.

The adapter checkpoints are written directly (random non-zero A and B on all seven
targets, as `sft train` with lora.rank > 0 would leave them), which is much faster
than training. Three forwards must agree in float32: peft's (base + adapter, unmerged),
transformers' on our merged export, and our own JAX forward of the adapter checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from convert.peft_card import adapter_card, base_model_ref
from convert.peft_plan import LORA_LAYOUTS
from convert.tables import export_format, table_for
from convert.transforms import TRANSFORMS
from tests.hf_models import hf_logits, make_hf, random_tokens
from tests.hub_runs import lay_out_hf_cache
from tests.lora_fixtures import write_adapter_checkpoint
from zoo.checkpoints.format import read_meta
from zoo.checkpoints.provenance import hub_repo_of
from zoo.cli import main
from zoo.lora.params import LoraConfig, adapter_lead, lora_delta, lora_specs
from zoo.model.config import ModelConfig
from zoo.model.vision_config import VisionConfig

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = 1e-4


@dataclass
class Setup:
    """One family's tiny base (HF folder + zoo checkpoint), an adapter checkpoint and its exports."""

    root: Path
    hf: Path
    base: Path
    adapter: Path
    peft_dir: Path
    merged: Path
    tokens: np.ndarray


def build(root: Path, family: str) -> Setup:
    """A tiny ``family`` model converted to a zoo base, a rank-8 adapter on all seven targets, both exports."""
    make_hf(root / "hf", family)
    assert main(["convert", str(root / "hf"), "--out", str(root / "base")]) == 0
    lora_cfg = LoraConfig(rank=8, alpha=16.0, targets=ALL_TARGETS)
    adapter = write_adapter_checkpoint(root / "base", root / "adapter", lora_cfg)
    assert main(["export", str(adapter), "--adapter", "--out", str(root / "peft")]) == 0
    assert main(["export", str(adapter), "--out", str(root / "merged")]) == 0
    tokens = random_tokens(96, batch=2, seq=24)
    return Setup(root, root / "hf", root / "base", adapter, root / "peft", root / "merged", tokens)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Setup]:
    """Family -> its Setup, each built on first use and shared by the module's tests."""

    class Lazy(dict):
        def __missing__(self, family: str) -> Setup:
            self[family] = build(tmp_path_factory.mktemp(f"peft_{family}"), family)
            return self[family]

    return Lazy()


@pytest.fixture(params=["llama", "gemma"])
def setup(request, built) -> Setup:
    """Each dense family's Setup in turn."""
    return built[request.param]


@pytest.fixture
def llama(built) -> Setup:
    """The Llama Setup, for checks that do not depend on the family."""
    return built["llama"]


def load_hf(folder: Path):
    """A float32 transformers model from ``folder``, eager attention (what tests/hf_models.py models use)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def load_peft(hf: Path, adapter_dir: Path):
    """peft's model: the HF base with the exported adapter, unmerged."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(hf), str(adapter_dir)).eval()


def adapter_file(adapter_dir: Path) -> dict[str, np.ndarray]:
    """The exported adapter tensors."""
    from safetensors.numpy import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def jax_logits(ckpt: Path, tokens: np.ndarray) -> np.ndarray:
    """Our merged forward: zoo.load merges an adapter checkpoint into its base."""
    return np.asarray(zoo.load(ckpt)(jnp.asarray(tokens)))


def assert_peft_loads_every_key(model, adapter_dir: Path) -> None:
    """Every adapter module peft made has its tensors in the file, none is left over, and the values arrived."""
    from peft.utils import get_peft_model_state_dict

    # load_adapter reports what from_pretrained only warns about: missing adapter keys, unused file keys.
    result = model.load_adapter(str(adapter_dir), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    model.delete_adapter("again")
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    state = {k: v.detach().numpy() for k, v in state.items()}
    saved = adapter_file(adapter_dir)
    assert sorted(state) == sorted(saved)
    for name, arr in saved.items():
        np.testing.assert_array_equal(state[name], arr, err_msg=name)


def test_layouts_turn_each_zoo_delta_into_peft_factors():
    """For every adapted weight of the dense table (and Gemma 4's, whose full layers' attention is stacked apart
    with wider heads, a SmolVLM's tower and connector, Qwen2.5-VL's fused qkv, Gemma 4's tower's key/value heads,
    Llama 4's q and k in RoPE pairs, Qwen3-Next's linear layers):
    lora_B @ lora_A is the export transform of A @ B."""
    llama = ModelConfig(family="llama", vocab_size=32, hidden_size=24, intermediate_size=40, num_layers=1,
                        num_heads=3, num_kv_heads=1, head_dim=8)
    gemma4 = ModelConfig(family="gemma4", vocab_size=32, hidden_size=24, intermediate_size=40, num_layers=2,
                         num_heads=3, num_kv_heads=3, head_dim=8, global_head_dim=16, global_kv_heads=1,
                         layer_types=("sliding", "full"), sliding_window=4)
    # A SmolVLM's language model, tower and connector (the tower's heads its own: convert.transforms._tower).
    vision = VisionConfig(arch="SmolVLMForConditionalGeneration", hidden_size=16, intermediate_size=24, num_layers=1,
                          num_heads=2, patch_size=2, image_size=4, image_token_id=31)
    vlm = dataclasses.replace(llama, family="smolvlm", vision=vision)
    vlm_targets = ["all", "vision.q_proj", "vision.k_proj", "vision.o_proj", "vision.up_proj", "projector.proj"]
    # Qwen2.5-VL's fused qkv (one adapter over q, k and v) and Gemma 4's tower (its own key/value heads).
    qwen = dataclasses.replace(llama, family="qwen2_5_vl", vision=VisionConfig(
        arch="Qwen2_5_VLForConditionalGeneration", hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
        patch_size=2, image_size=4, image_token_id=31, connector="patch_merger", tower="qwen2_5",
        temporal_patch_size=2))
    gemma4_vlm = dataclasses.replace(gemma4, vision=VisionConfig(
        arch="Gemma4ForConditionalGeneration", hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
        num_kv_heads=1, head_width=8, patch_size=2, image_size=4, image_token_id=31, connector="gemma4",
        tower="gemma4", pos_table=8, max_soft_tokens=4))
    # Llama 4: q and k rows in RoPE's interleaved pairs (convert.transforms' rope_pairs_*), B's rows permuted back.
    llama4 = dataclasses.replace(llama, family="llama4")
    # Qwen3-Next: its linear layers' projections (key heads for q/k, value heads for v/z, out_proj over value heads).
    qwen3_next = dataclasses.replace(llama, family="qwen3_next", num_layers=2, layer_types=("linear", "full"),
                                     linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=4,
                                     linear_value_head_dim=6, linear_conv_kernel=4, attn_output_gate=True)
    rng = np.random.RandomState(0)
    seen = set()
    for cfg, targets in ((llama, "all"), (gemma4, "all"), (vlm, vlm_targets), (qwen, ["vision.qkv", "projector.fc1"]),
                         (gemma4_vlm, ["vision.k_proj"]), (llama4, ["q_proj", "k_proj"]), (qwen3_next, "all")):
        specs = lora_specs(cfg, LoraConfig(rank=4, targets=targets))
        rules = {r.zoo: r for r in table_for(cfg.family, export_format(cfg), cfg)}
        for path in sorted({p.rpartition(".")[0] for p in specs}):
            rule = rules[path]
            lead = adapter_lead(cfg, path)  # one layer (the connector has no layers axis)
            a = rng.normal(size=specs[f"{path}.a"].shape[lead:]).astype(np.float32)
            b = rng.normal(size=specs[f"{path}.b"].shape[lead:]).astype(np.float32)
            want = TRANSFORMS[rule.transform].inverse(np.asarray(lora_delta(a, b, 1.0, 0)), cfg)
            layout = LORA_LAYOUTS[rule.transform]
            np.testing.assert_allclose(layout.b(b) @ layout.a(a), want, rtol=1e-5, atol=1e-5, err_msg=path)
            seen.add(rule.transform)
    assert seen == set(LORA_LAYOUTS)


@pytest.mark.slow
def test_peft_loads_every_adapter_key(setup):
    config = json.loads((setup.peft_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 16, False)
    assert config["target_modules"] == ALL_TARGETS
    assert config["base_model_name_or_path"] == "base"  # converted from a local folder: its name, no local path
    saved = adapter_file(setup.peft_dir)
    assert len(saved) == 2 * len(ALL_TARGETS) * 3  # A and B, seven modules, three layers
    assert saved["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (8, 64)
    assert saved["base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"].shape == (64, 8)
    assert_peft_loads_every_key(load_peft(setup.hf, setup.peft_dir), setup.peft_dir)


def test_peft_logits_equal_merged_export_and_jax(setup):
    peft_out = hf_logits(load_peft(setup.hf, setup.peft_dir), setup.tokens)
    base_out = hf_logits(load_hf(setup.hf), setup.tokens)
    assert np.abs(peft_out - base_out).max() > 0.1  # the adapter changes the model: the comparisons have teeth
    assert np.abs(peft_out - hf_logits(load_hf(setup.merged), setup.tokens)).max() <= TOL
    assert np.abs(peft_out - jax_logits(setup.adapter, setup.tokens)).max() <= TOL


def test_rslora_subset_adapter(setup):
    targets = ["q_proj", "o_proj", "down_proj"]
    ckpt = write_adapter_checkpoint(setup.base, setup.root / "rs", LoraConfig(rank=4, alpha=6.0, rslora=True,
                                                                              targets=targets), seed=1)
    out = setup.root / "rs_peft"
    assert main(["export", str(ckpt), "--adapter", "--out", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 6, True)
    assert config["target_modules"] == targets
    model = load_peft(setup.hf, out)
    assert_peft_loads_every_key(model, out)
    assert np.abs(hf_logits(model, setup.tokens) - jax_logits(ckpt, setup.tokens)).max() <= TOL


def test_adapters_over_an_adapter_checkpoint_export_merged_and_as_peft(llama):
    """DPO's adapters trained over an SFT run's adapter checkpoint (its model.path): the merged export carries
    both deltas, and the PEFT export loads in peft on the SFT model's merged export (as its card says)."""
    root = llama.root
    dpo = write_adapter_checkpoint(llama.adapter, root / "dpo", LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS),
                                   seed=1)
    assert main(["export", str(dpo), "--out", str(root / "dpo_merged")]) == 0
    assert main(["export", str(dpo), "--adapter", "--out", str(root / "dpo_peft")]) == 0
    want = jax_logits(dpo, llama.tokens)  # zoo.load merges the chain: base + SFT delta + DPO delta
    assert np.abs(want - jax_logits(llama.adapter, llama.tokens)).max() > 0.1  # the DPO adapter changes the model
    assert np.abs(hf_logits(load_hf(root / "dpo_merged"), llama.tokens) - want).max() <= TOL
    model = load_peft(llama.merged, root / "dpo_peft")
    assert_peft_loads_every_key(model, root / "dpo_peft")
    assert np.abs(hf_logits(model, llama.tokens) - want).max() <= TOL
    assert f"zoo export {llama.adapter.name} --out BASE" in (root / "dpo_peft" / "README.md").read_text()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_requests_are_one_line_errors(llama, tmp_path, capsys):
    assert main(["export", str(llama.base), "--adapter", "--out", str(tmp_path / "x")]) == 2
    line = _one_error_line(capsys)
    assert str(llama.base) in line and "not a LoRA adapter checkpoint" in line
    assert not (tmp_path / "x").exists()

    assert main(["export", str(llama.adapter), "--adapter", "--out", str(llama.peft_dir)]) == 2
    assert "not empty; choose a new folder or add --overwrite" in _one_error_line(capsys)
    before = adapter_file(llama.peft_dir)
    assert main(["export", str(llama.adapter), "--adapter", "--out", str(llama.peft_dir), "--overwrite"]) == 0
    capsys.readouterr()
    assert adapter_file(llama.peft_dir).keys() == before.keys()

    assert main(["export", str(llama.adapter), "--adapter", "--out", str(tmp_path / "y"),
                 "--max-shard-size", "1GB"]) == 2
    assert "--max-shard-size" in _one_error_line(capsys)

    assert main(["export", str(llama.base), "--out", str(tmp_path / "z"), "--base-out", str(tmp_path / "b")]) == 2
    assert "--base-out applies to --adapter only" in _one_error_line(capsys)
    assert main(["export", str(llama.adapter), "--adapter", "--out", str(tmp_path / "z"),
                 "--base-out", str(tmp_path / "z" / "base")]) == 2
    assert "overlap" in _one_error_line(capsys)
    assert main(["export", str(llama.adapter), "--adapter", "--out", str(tmp_path / "w"),
                 "--base-out", str(llama.peft_dir)]) == 2
    assert f"--base-out {llama.peft_dir} exists and is not empty" in _one_error_line(capsys)
    assert sorted(tmp_path.iterdir()) == []  # nothing written by any of them


def test_dry_run_lists_the_adapter_files(llama, tmp_path, capsys):
    assert main(["export", str(llama.adapter), "--adapter", "--push-to-hub", "me/tiny-lora", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "me/tiny-lora" in lines[0]
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    listed = {line.split()[0]: line.split()[1:] for line in lines[rule + 1:] if line.strip()}
    assert set(listed) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    size = (llama.peft_dir / "adapter_model.safetensors").stat().st_size
    assert listed["adapter_model.safetensors"] == [f"{size / 1024:.1f}", "KiB"]  # planned size is exact
    assert main(["export", str(llama.base), "--adapter", "--push-to-hub", "me/tiny-lora", "--dry-run"]) == 2
    assert "not a LoRA adapter checkpoint" in _one_error_line(capsys)


def test_push_adapter_to_fake_hub_without_torch_or_peft(llama, tmp_path, monkeypatch):
    from tests.fake_hub import FakeHub
    from tests.hub_runs import TOKEN, assert_token_not_leaked, zoo_export

    # Run-time code must not need the test-only packages: the subprocess sees them as not installed.
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(
        "import sys\nfor name in ('torch', 'peft'):\n    sys.modules[name] = None  # import raises ImportError\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(blocked), str(Path(__file__).resolve().parent.parent)]))
    with FakeHub(token=TOKEN) as hub:
        proc = zoo_export(tmp_path, hub.url, str(llama.adapter), "--adapter", "--push-to-hub", "me/tiny-lora")
    assert proc.returncode == 0, proc.stderr
    assert_token_not_leaked(proc)
    assert f"pushed: {hub.url}/me/tiny-lora/commit/" in proc.stdout
    assert hub.unexpected == []
    (commit,) = hub.commits
    assert sorted(commit.files) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert commit.files[name] == (llama.peft_dir / name).read_bytes(), name
    assert "me/tiny-lora" in commit.files["README.md"].decode()
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary export folder is gone


def test_hub_repo_of_source():
    assert hub_repo_of("smollm2-135m (HuggingFaceTB/SmolLM2-135M)") == "HuggingFaceTB/SmolLM2-135M"
    assert hub_repo_of("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert hub_repo_of("/data/models/llama") is None
    assert hub_repo_of("./hf/llama") is None
    assert hub_repo_of("/tmp/smol.gguf") is None


@pytest.mark.parametrize("source, fmt, want", [
    ("smollm2-135m (HuggingFaceTB/SmolLM2-135M)", "hf", "HuggingFaceTB/SmolLM2-135M"),
    ("gemma-3-4b-it (google/gemma-3-4b-it)", "hf-gemma3-multimodal", None),  # adapter names the text model
    ("/models/smol.gguf", "gguf", None),
    (None, None, None),  # the base is gone: its recorded path
])
def test_base_model_ref(tmp_path, source, fmt, want):
    base = tmp_path / "base"
    if source is not None:
        base.mkdir()
        (base / "model.json").write_text(json.dumps({"source": source, "source_format": fmt}))
    assert base_model_ref(tmp_path / "adapter", {"lora": {"base": str(base)}}) == (want or "base")


HUB_REPO = "lmzoo-tests/tiny-llama"


def test_adapter_of_a_hub_conversion_names_the_repo(llama, tmp_path, monkeypatch):
    """`zoo convert` records the Hub repo a checkpoint came from (a repo id through the Hub cache, or a folder of
    that cache), the adapter checkpoint keeps it, and the PEFT export names the repo: where the base is, and
    where the run is exported without its base."""
    import huggingface_hub.constants

    lay_out_hf_cache(tmp_path / "cache", HUB_REPO, llama.hf)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    snapshot = tmp_path / "cache" / ("models--" + HUB_REPO.replace("/", "--")) / "snapshots" / ("0" * 40)
    lora = LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    for source, name in ((HUB_REPO, "by_id"), (str(snapshot), "by_folder")):
        assert main(["convert", source, "--out", str(tmp_path / name / "base")]) == 0
        assert read_meta(tmp_path / name / "base")["hub_id"] == HUB_REPO
        write_adapter_checkpoint(tmp_path / name / "base", tmp_path / name / "run", lora)
    (tmp_path / "by_id" / "base").rename(tmp_path / "by_id" / "gone")  # the run alone, as if copied elsewhere
    for name in ("by_id", "by_folder"):
        out = tmp_path / name / "peft"
        assert main(["export", str(tmp_path / name / "run"), "--adapter", "--out", str(out)]) == 0
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == HUB_REPO, name
        card = (out / "README.md").read_text()
        assert f"base_model: {HUB_REPO}\n" in card and f"The base model is the Hub's `{HUB_REPO}`" in card
        assert "AutoPeftModelForCausalLM.from_pretrained" in card


def test_qlora_adapter_names_its_dequantized_export_which_autopeft_loads(llama, tmp_path, capsys, monkeypatch):
    """An adapter over a base stored quantized (`zoo quantize`) exports with the dequantized base beside it
    (OUT-base), names that folder as its base, and says so in its card: AutoPeftModelForCausalLM loads the
    adapter alone and gives the model the adapters were trained in (the merged export: the dequantized base
    plus the adapters). int8 rather than NF4: the export does not depend on the kind, and int8 compiles less.
    The folder is named by its path relative to where `zoo export` ran (no absolute path: --push-to-hub publishes
    the file), so peft finds it from there."""
    from peft import AutoPeftModelForCausalLM

    assert main(["quantize", str(llama.base), "--out", str(tmp_path / "q8"), "--quant", "int8"]) == 0
    run = write_adapter_checkpoint(tmp_path / "q8", tmp_path / "run", LoraConfig(rank=8, alpha=16.0,
                                                                                 targets=ALL_TARGETS))
    peft_dir, base_dir = tmp_path / "peft", tmp_path / "peft-base"
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(run), "--adapter", "--out", str(peft_dir), "--dry-run"]) == 0
    assert f"{base_dir}/model.safetensors" in capsys.readouterr().out  # the dry run lists the base's files too
    assert main(["export", str(run), "--adapter", "--out", str(peft_dir)]) == 0
    assert f"wrote {base_dir}" in capsys.readouterr().out
    assert json.loads((peft_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == "peft-base"
    card = (peft_dir / "README.md").read_text()
    assert "The base model is `peft-base`" in card and "dequantized" in card and "checkpoint `q8`" in card
    assert "(INT8, `zoo quantize`)" in card and "QLoRA" in card and "base_model:" not in card
    assert "AutoPeftModelForCausalLM.from_pretrained" in card

    model = AutoPeftModelForCausalLM.from_pretrained(str(peft_dir), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    assert main(["export", str(run), "--out", str(tmp_path / "merged")]) == 0
    want = hf_logits(load_hf(tmp_path / "merged"), llama.tokens)
    assert np.abs(want - hf_logits(load_hf(llama.hf), llama.tokens)).max() > 0.1  # adapters (and int8) count
    assert np.abs(hf_logits(model, llama.tokens) - want).max() <= TOL


def test_card_of_an_adapter_over_a_local_base_says_what_the_base_is(llama):
    """A base converted from a local folder has no Hub repo: the adapter names the lmzoo checkpoint, and its
    card says that transformers does not read it and how to export it."""
    card = (llama.peft_dir / "README.md").read_text()
    assert ("The base model is the lmzoo checkpoint `base`, which transformers does not read: export it "
            "with `zoo export base --out BASE`") in card
    assert "base_model:" not in card and "PeftModel.from_pretrained(base" in card


def test_card_of_qlora_adapters_over_a_float_hub_base(tmp_path):
    """Adapters trained with lora.base_quant on a float base converted from the Hub name the repo; the card says
    that training quantized the base, and which export is the exact model."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.json").write_text(json.dumps({"source": "owner/tiny", "source_format": "hf"}))
    meta = {"lora": {"base": str(base), "base_quant": {"kind": "nf4", "double": True}, "rank": 4, "alpha": 8.0,
                     "rslora": False}}
    ref = base_model_ref(tmp_path / "run", meta)
    card = adapter_card(tmp_path / "run", meta, ref, ["q_proj"], "me/qlora")
    assert ref == "owner/tiny" and "base_model: owner/tiny\n" in card
    assert "trained beside its projections quantized (NF4, double quantization, QLoRA)" in card
    assert "`zoo export run` writes that model exactly" in card
