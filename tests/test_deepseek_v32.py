"""DeepSeek-V3.2 (deepseek_v32: V3 with DeepSeek Sparse Attention) in the one decoder, against transformers on the
tiny random config of tests/hf_models.py (index_topk 6, sequences of 24 and more): logits, the indexer's selection
mattering, greedy KV-cache decoding equal to transformers' generate past index_topk tokens, cached logits equal to
the full forward's, the HF -> zoo -> HF round trip, a generated config; the released config's parameter count."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import family_checks as checks
from tests.hf_models import hf_logits, hf_tensors, random_tokens
from zoo.cli import main

SEQ = 24  # four times index_topk (6)


@pytest.fixture(scope="module")
def tiny(tiny_family):
    """(transformers' model, its folder, the zoo model), shared read-only (conftest.py's tiny_family)."""
    hf, folder, _, model = checks.converted(tiny_family, "deepseek_v32")
    return hf, folder.parent, model


def test_logits_match_transformers_and_the_selection_matters(tiny):
    """Logits at 1e-4 and KL 1e-6 over 24 tokens; the same weights attending densely (index_topk past the
    sequence) differ from transformers by far more, so the sparse selection is what is being compared."""
    hf, _, model = tiny
    cfg = model.cfg
    assert (cfg.family, cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == ("deepseek_v32", 6, 8, 16)
    tokens, ref = checks.assert_logits_match(hf, model, SEQ)
    from zoo.model.decoder import forward

    dense = np.asarray(jax.jit(forward, static_argnums=0)(dataclasses.replace(cfg, index_topk=SEQ),
                                                         model.param_dict(), jnp.asarray(tokens)))
    np.testing.assert_allclose(dense[:, :6], ref[:, :6], atol=1e-4)  # the first 6 queries see at most 6 keys
    assert np.abs(dense - ref).max() > 0.1


@pytest.mark.slow  # its own forward program: 4 s
def test_packed_rows_equal_each_document_alone(tiny):
    """Two documents packed in one row (segment ids) give each document's transformers logits alone: the indexer
    picks among its own document's keys only."""
    hf, _, model = tiny
    a, b = random_tokens(hf.config.vocab_size, batch=2, seq=12, seed=3)
    row = jnp.asarray(np.concatenate([a, b])[None])
    seg = jnp.asarray([[1] * 12 + [2] * 12], jnp.int32)
    pos = jnp.asarray([list(range(12)) * 2], jnp.int32)
    got = np.asarray(model(row, seg, pos))[0]
    ref = np.concatenate([hf_logits(hf, a[None])[0], hf_logits(hf, b[None])[0]])
    assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.slow  # 2 programs of the cached forward and transformers' generate: about 6 s
def test_greedy_kv_cache_decoding_equals_transformers_generate(tiny):
    """Greedy decoding through the KV cache (the indexer's keys cached per layer) from a 5-token prompt to 25 tokens,
    four times index_topk: the tokens of transformers' generate (its own cache, indexer keys included)."""
    from eval.generate import GenerationConfig, generate

    hf, _, model = tiny
    prompt = random_tokens(hf.config.vocab_size, batch=1, seq=5, seed=2)[0].tolist()
    got = generate(model.cfg, model.param_dict(), [prompt], GenerationConfig(max_new_tokens=20))[0]
    with torch.no_grad():  # no eos: 20 tokens whatever they are (the tiny model's greedy choices include eos, 1)
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    assert len(got) == 20 and got == out[0, 5:].tolist()


@pytest.mark.slow  # 2 programs of the cached forward: about 8 s
def test_cached_logits_equal_the_full_forward(tiny):
    """A ragged prefill (5 and 9 tokens) then single tokens to 20: every real token's cached logits equal the full
    forward's at 1e-5, once past index_topk the cached index keys choose as the full sequence's do."""
    from zoo.model.decode import forward_cached_jit, init_cache

    _, _, model = tiny
    cfg, params = model.cfg, model.param_dict()
    rows = random_tokens(cfg.vocab_size, batch=2, seq=20, seed=1)
    ref = np.asarray(model(jnp.asarray(rows)))
    cache = init_cache(cfg, 2, 24)
    assert cache.layers["layers"]["full"]["index_k"].shape == (2, 2, 24, 16)
    done = np.zeros(2, int)
    for take in [(5, 9)] + [(1, 1)] * 11:
        t = max(take)
        toks, valid = np.zeros((2, t), np.int32), np.zeros((2, t), bool)
        for r, n in enumerate(take):
            toks[r, :n], valid[r, :n] = rows[r, done[r]:done[r] + n], True
        logits, cache = forward_cached_jit(cfg, params, jnp.asarray(toks), cache, jnp.asarray(valid))
        for r, n in enumerate(take):
            np.testing.assert_allclose(np.asarray(logits)[r, :n], ref[r, done[r]:done[r] + n], atol=1e-5, rtol=0)
        done += take
    assert done.min() == 16 and done.max() == 20


def test_round_trip_is_bit_identical(tiny, tmp_path):
    """HF -> zoo -> HF: every tensor (the indexer's included) and the config as they were."""
    _, root, _ = tiny
    assert any(".indexer.wq_b." in k for k in hf_tensors(root / "hf"))
    checks.assert_round_trip(root / "hf", root / "zoo", tmp_path / "back")


def test_generated_config_reproduces_the_model(tiny, tmp_path):
    """Without the source config.json, export writes one from the zoo config (index_topk, index_n_heads,
    index_head_dim among it); transformers builds the same model from it."""
    hf, root, _ = tiny
    back = checks.exported_from_generated_config(root / "zoo", tmp_path)
    assert type(back).__name__ == "DeepseekV32ForCausalLM" and back.config.index_topk == 6
    tokens = random_tokens(hf.config.vocab_size, seq=SEQ)
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(hf, tokens))


def test_released_config_counts_as_transformers():
    """deepseek-v3.2's registry config (V3's shape, index heads 64 of 128, top 2048) has transformers' count of the
    same config (its parameters, and the selection biases it keeps as buffers), counted on the meta device."""
    import transformers

    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import param_specs
    from zoo.registry.catalogue import get, hf_config_of

    hf = hf_config_of("deepseek-v3.2", "model")
    assert get("deepseek-v3.2").family == "deepseek_v32"
    cfg = model_config_from_hf(hf, "deepseek-v3.2")
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.dense_layers) == (64, 128, 2048, 3)
    sizes = {k: math.prod(s.shape) for k, s in param_specs(cfg).items()}
    with torch.device("meta"):  # shapes only: nothing allocated
        ref = transformers.DeepseekV32ForCausalLM(transformers.AutoConfig.for_model(**hf))
    biases = [b for name, b in ref.named_buffers() if name.endswith("e_score_correction_bias")]
    assert sum(sizes.values()) == sum(p.numel() for p in ref.parameters()) + sum(b.numel() for b in biases)
    indexer = sum(n for k, n in sizes.items() if ".idx_" in k)
    assert indexer == 61 * (1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64)


# LoRA on what DeepSeek-V3.2 adapts here: the dense MLP, the shared expert and the routed experts (MLA's attention
# and the indexer take none: zoo.lora.params; the indexer has no gradient at all, as transformers' no_grad).
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
               "shared_experts.down_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj"]


@pytest.mark.slow  # the export, then peft + transformers: about 10 s
def test_peft_loads_the_adapters_with_our_logits(tiny, tmp_path):
    """LoRA on the routed experts (peft's target_parameters on mlp.experts' gate_up_proj / down_proj; as for V3, peft
    rewrites gate_proj/up_proj/down_proj targets to the fused experts, so a dense or shared MLP adapter cannot load
    there), exported with `zoo export --adapter`: peft loads every key and gives our logits (1e-4), which the
    adapter moves by far more."""
    from tests.lora_fixtures import peft_logits_against_ours, write_adapter_checkpoint
    from zoo.lora.params import LoraConfig

    _, root, _ = tiny
    adapter = write_adapter_checkpoint(root / "zoo", tmp_path / "adapter", LoraConfig(rank=4, alpha=8.0,
                                                                                      targets=MLP_TARGETS[6:]))
    assert main(["export", str(adapter), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    diff, teeth = peft_logits_against_ours(root / "hf", adapter, tmp_path / "peft")
    assert teeth > 0.1 and diff <= 1e-4, (diff, teeth)


@pytest.mark.slow  # two compilations of the forward and its gradients: 20 s or more
def test_qlora_and_lora_gradients_with_the_indexer_untrained(tiny):
    """QLoRA (NF4, double quantization) of the MLP and experts: the loss and every adapter's gradient equal LoRA's on
    the dequantized weights (1e-6, 1e-5), every adapter gets a gradient; attention targets add no adapter (MLA), and
    the base model's gradient of every indexer weight is exactly zero (no gradient through the top-k selection)."""
    from tests.family_checks import assert_qlora_equals_lora
    from zoo.lora.params import LoraConfig, lora_specs
    from zoo.model.params import flatten

    cfg = tiny[2].cfg
    lc = LoraConfig(rank=4, alpha=8.0, targets=MLP_TARGETS + ["q_proj", "o_proj"])
    assert not [p for p in lora_specs(cfg, lc) if ".idx_" in p or p.rpartition(".")[0].endswith((".q_b", ".o"))]
    _, gbase = assert_qlora_equals_lora(cfg, lc, SEQ, {"expert_gate", "expert_up", "expert_down", "shared_gate",
                                                       "gate"}, base_grads=True)
    base = flatten(gbase)
    assert not any(np.any(np.asarray(g)) for k, g in base.items() if ".idx_" in k)
    assert np.abs(np.asarray(base["layers.q_b"])).max() > 0  # the attention's weights do learn


def test_flops_count_the_indexer_and_the_top_k_keys():
    """pretrain/flops.py on the released config at 4096 tokens: V3's count of the same model plus the indexer's
    projections forward only (2 x 61 x (1536 x 64 x 128 + 7168 x 128 + 7168 x 64)) and its scores over the causal
    prefix (2 x 61 x 64 x 129 a key, 2048 keys a query on average), with attention over the top 2048 keys a query
    (1536 on average: positions under 2048 see fewer) in place of the causal prefix (2048 on average)."""
    from pretrain.flops import flops_per_token
    from zoo.model.from_hf import model_config_from_hf
    from zoo.registry.catalogue import hf_config_of

    cfg = model_config_from_hf(hf_config_of("deepseek-v3.2", "model"), "deepseek-v3.2")
    dense = dataclasses.replace(cfg, index_topk=0, index_n_heads=0, index_head_dim=0)
    indexer = 61 * (1536 * 64 * 128 + 7168 * 128 + 7168 * 64)
    widths = 61 * 128 * 192  # MLA's q.k width over heads and layers
    extra = 2 * indexer + 2 * 61 * 64 * 129 * 2048 + 12 * widths * (1536 - 2048)
    assert flops_per_token(cfg, 4096) == pytest.approx(flops_per_token(dense, 4096) + extra, rel=1e-12)
    # up to index_topk tokens every query keeps every key: only the indexer's arithmetic is added
    assert flops_per_token(cfg, 2048) == pytest.approx(
        flops_per_token(dense, 2048) + 2 * indexer + 2 * 61 * 64 * 129 * 1024, rel=1e-12)


@pytest.mark.slow  # libtpu's topology, then the set-up: 5 s
def test_context_parallelism_is_a_one_line_error(tmp_path, capsys):
    """`train --compile-only` with mesh.context 2 on a DeepSeek-V3.2 model stops before compiling (exit 2) with one
    line naming the setting and the fix."""
    from pretrain.cli import main as train
    from tests.hf_models import BASE, FAMILIES

    hf = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", **BASE,
          **FAMILIES["deepseek_v32"][2]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    f = tmp_path / "run.yaml"
    f.write_text(f"model: {tmp_path / 'config.json'}\ndata:\n  path: {tmp_path / 'absent.jsonl'}\n  seq_len: 64\n"
                 f"batch_size: 8\nmax_steps: 1\noutput_dir: {tmp_path / 'run'}\nmesh:\n  context: 2\n")
    assert train(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: mesh.context 2: deepseek_v32's sparse attention (index_topk) has no context "
                       "parallelism; set mesh.context: 1 (split over fsdp or data instead)")


@pytest.mark.slow  # the engine's programs: about 20 s
def test_the_engine_answers_greedily_past_index_topk(tiny):
    """The inference engine (paged KV cache with the index keys in its pool, continuous batching): answers of up
    to 26 tokens, past index_topk (6) keys, are each the training forward's greedy continuation of its prompt."""
    from eval.engine.api import SamplingParams
    from eval.engine.engine import Engine

    _, _, model = tiny
    cfg, params = model.cfg, model.param_dict()
    engine = Engine(cfg, params, max_len=32, page_size=8, max_seqs=3)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(2, cfg.vocab_size, n).tolist() for n in (3, 11, 1, 9)]
    ids = [engine.submit(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, (13, 9, 17, 4))]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.busy:
        for e in engine.step():
            out[e.request_id].extend(e.tokens)
    # The training forward of every answer in one batch, right-padded (one program, not one a length): causal
    # attention and selection, dropless experts, so each row's real positions see only themselves.
    seqs = [p + out[i] for p, i in zip(prompts, ids, strict=True)]
    rows = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for r, seq in enumerate(seqs):
        rows[r, :len(seq)] = seq
    logits = np.asarray(model(jnp.asarray(rows)))
    for r, (p, i) in enumerate(zip(prompts, ids, strict=True)):
        assert logits[r, len(p) - 1:len(seqs[r]) - 1].argmax(-1).tolist() == out[i]
    assert len({tuple(a) for a in out.values()}) == len(ids) and max(len(p) + len(out[i]) for p, i in
                                                                    zip(prompts, ids)) > 3 * cfg.index_topk
