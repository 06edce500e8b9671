"""KV-cache decoding (zoo.model.decode) and generation (eval.generate, `zoo generate`) against the full forward
pass and transformers' greedy choices."""

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from eval.generate import GenerationConfig, generate
from tests.hf_models import FAMILIES, random_tokens
from tests.processes import devices_env
from zoo.cli import main
from zoo.model.decode import forward_cached_jit, init_cache

SEQ = 20  # longer than every sliding window (7; Phi-3's 16) of the tiny families
# The length of each family's full-forward parity test against transformers (2 rows through zoo.load's model:
# tests/test_families.py, test_families_2026_dense.py and _moe.py, test_gpt_oss.py, test_gemma4.py's dense variant,
# test_moe.py): the reference logits of the first SEQ positions come from that program (causal attention: the
# later tokens change none of them), compiled once per run (the session's persistent compilation cache; in one
# process, the same jitted function). Not listed: SEQ.
REFERENCE_SEQS = {"mistral": 40, "gemma2": 40, "gemma3": 40, "gemma4": 40, "smollm3": 40, "olmo3": 40,
                  "glm4_moe": 24, "gpt_oss": 24, "deepseek_v2": 24, "deepseek_v3": 24, "llama4": 24}


@pytest.fixture(scope="module")
def tiny(tiny_family):
    """family -> (transformers model, zoo model): conftest.py's tiny_family, loaded once."""
    made = {}

    def get(family):
        if family not in made:
            hf, root = tiny_family(family)
            made[family] = (hf, zoo.load(root / "zoo"))
        return made[family]

    return get


# The families whose cached attention differs from every other's: windows (mistral, gemma2/3, olmo3), soft-capping,
# MLA (deepseek_v2; deepseek_v3's both ways in test_mla_expanded_and_absorbed_attention), KV-shared layers (gemma4),
# sinks (gpt_oss), partial rotary (glm4_moe), NoPE layers (smollm3), LongRoPE's switch (phi3), chunked layers and the
# NoPE layers' query temperature (llama4). The others (gemma,
# qwen2, qwen3, mixtral, qwen3_moe, olmo2) differ from llama only before the cache or after attention, and decode
# against transformers' greedy choices in test_greedy_equals_transformers_greedy like every family.
CACHE_FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "deepseek_v2", "gemma4", "glm4_moe", "gpt_oss", "smollm3",
                  "olmo3", "phi3", "llama4"]


@pytest.mark.slow
@pytest.mark.parametrize("family", CACHE_FAMILIES)
def test_cached_logits_equal_full_forward(tiny, family):
    """Prefill of prompts of different lengths, a multi-token chunk with padding, then one token at a
    time: every real token's logits equal the full forward pass's at its position."""
    assert set(CACHE_FAMILIES) <= set(FAMILIES)
    _check_cached_logits(tiny(family)[1], forward_cached_jit, family)


def _empty_cache(cfg, params, batch=2, max_len=24):
    """init_cache's empty cache placed as forward_cached returns its caches (replicated on the parameters' mesh,
    as zoo.load places them): the first call's program is then the later ones' too, one compilation, not two."""
    sharding = jax.sharding.NamedSharding(params["embed"].sharding.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(init_cache(cfg, batch, max_len), sharding)


def _check_cached_logits(model, fwd, family):
    cfg, params = model.cfg, model.param_dict()
    rows = random_tokens(cfg.vocab_size, batch=2, seq=REFERENCE_SEQS.get(family, SEQ), seed=1)
    ref = np.asarray(model(jnp.asarray(rows)))  # zoo.model.decoder.forward, jitted as the model's call
    seqs = rows[:, :SEQ]
    cache = _empty_cache(cfg, params)
    done = np.zeros(2, int)
    # (tokens to take per row) per call: a ragged prefill, a padded chunk, then single tokens.
    plan = [(5, 9), (3, 2)] + [(1, 1)] * (SEQ - 11)
    for take in plan:
        t = 1 if max(take) == 1 else 9  # the prefill's width for the padded chunk too: two programs, not three
        toks = np.zeros((2, t), np.int32)
        valid = np.zeros((2, t), bool)
        for r, n in enumerate(take):
            toks[r, :n], valid[r, :n] = seqs[r, done[r]:done[r] + n], True
        logits, cache = fwd(cfg, params, jnp.asarray(toks), cache, jnp.asarray(valid))
        logits = np.asarray(logits)
        for r, n in enumerate(take):
            np.testing.assert_allclose(logits[r, :n], ref[r, done[r]:done[r] + n], atol=1e-5, rtol=0)
        done += take
        np.testing.assert_array_equal(np.asarray(cache.lengths), done)
    assert done.max() == SEQ and done.min() > 7  # both rows went past the window


def _hf_greedy_choices(hf, prompt, new):
    """transformers' greedy choice after the prompt and each prefix of ``new``: one forward over them all.
    ``new`` is transformers' greedy continuation exactly when it equals this (each token is the argmax given the
    tokens before it), without generate's token-at-a-time loop (on SmolLM2-135M, 20 s of a loaded machine)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + new])).logits[0]
    return logits[len(prompt) - 1:len(prompt) + len(new) - 1].argmax(-1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_greedy(tiny, family):
    hf, model = tiny(family)
    cfg, params = model.cfg, model.param_dict()
    prompt = random_tokens(cfg.vocab_size, batch=1, seq=5, seed=2)[0].tolist()
    got = generate(cfg, params, [prompt], GenerationConfig(max_new_tokens=12))[0]
    assert len(got) == 12 and got == _hf_greedy_choices(hf, prompt, got)  # 17 tokens: past the sliding window


@pytest.mark.slow
def test_batched_prompts_equal_one_by_one(tiny):
    model = tiny("gemma2")[1]
    cfg, params = model.cfg, model.param_dict()
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (3, 11, 6)]
    gen = GenerationConfig(max_new_tokens=10)
    one = [generate(cfg, params, [p], gen)[0] for p in prompts]
    assert len({tuple(x) for x in one}) > 1
    assert generate(cfg, params, prompts, gen) == one
    # EOS ends only its own row, right after the EOS token.
    eos = one[0][3]
    got = generate(cfg, params, prompts, GenerationConfig(max_new_tokens=10, eos_ids=(eos,)))
    assert got == [o[:o.index(eos) + 1] if eos in o else o for o in one]


@pytest.mark.slow
def test_sampling_is_reproducible(tiny):
    """The same seed draws the same tokens, another seed others; top-k 1 and a tiny top-p draw the greedy tokens.
    Slow: XLA compiles generation's two programs for each of its three samplers; the greedy ones are those of
    test_generation_on_an_8_device_mesh_equals_one_device's reference (4 prompts of at most 32 tokens into 64
    slots), compiled once."""
    model = tiny("llama")[1]
    cfg, params = model.cfg, model.param_dict()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16, 17]]

    def run(**kw):
        return generate(cfg, params, prompts, GenerationConfig(max_new_tokens=16, **kw))

    # The seed's properties on the nucleus sampler (top-k and top-p together), whose program the draws share: the
    # key handling is the sampler's whatever it cuts (tests/test_sampling.py checks each sampler's distribution).
    nucleus = run(temperature=1.0, top_p=0.9, top_k=20, seed=0)
    assert nucleus == run(temperature=1.0, top_p=0.9, top_k=20, seed=0) and all(len(r) == 16 for r in nucleus)
    assert nucleus != run(temperature=1.0, top_p=0.9, top_k=20, seed=1)
    assert run(temperature=1.0, top_k=1, seed=5) == run()
    assert run(temperature=0.7, top_p=1e-6, seed=5) == run()  # top-p that tiny keeps only the argmax


# --- the real SmolLM2-135M-Instruct (conftest.py's session fixture `smollm2`: converted once per run) ----------

CHATS = ["What is the capital of France?", "List three prime numbers."]  # 37 and 35 tokens: ragged rows


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers_greedy(smollm2):
    """Slow (slow lane): the real SmolLM2-135M generates (16 tokens a prompt) and transformers checks each token
    is its greedy choice (one teacher-forced forward a prompt). greedy_batch
    (eval.generate's greedy entry point) over chat prompts tokenized both ways (chat_ids, and the template's text
    tokenized without special tokens)."""
    from eval.generate import chat_ids, greedy_batch

    out, hf, tok = smollm2
    prompts = [chat_ids(tok, [{"role": "user", "content": c}]) for c in CHATS]
    text = tok.apply_chat_template([{"role": "user", "content": CHATS[0]}], add_generation_prompt=True,
                                   tokenize=False)
    assert tok(text, add_special_tokens=False)["input_ids"] == prompts[0]
    got = greedy_batch(zoo.load(out), prompts, 16)
    for prompt, g in zip(prompts, got):
        assert len(g) == 16 and g == _hf_greedy_choices(hf, prompt, g)


COUNT = ("Count: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen, fourteen, "
         "fifteen, sixteen,")


@pytest.mark.slow
def test_cli_generate(smollm2, tmp_path, capsys):
    """Slow (slow lane): `zoo generate` on the real SmolLM2-135M."""
    out, _, tok = smollm2
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "What is the capital of France?", "--chat",
                 "--max-new-tokens", "8"]) == 0
    assert "Paris" in capsys.readouterr().out
    # A plain prompt (no chat template) with a stop string: some text, cut before the first ",".
    # 34 tokens, so the programs are the chat prompt's (one row of 33-64 tokens into 96 slots), compiled once.
    assert main(["generate", str(out), "--prompt", COUNT, "--max-new-tokens", "16", "--stop", ","]) == 0
    plain = capsys.readouterr().out
    assert plain.strip() and "<|im_start|>" not in plain and "," not in plain.strip()

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}]}) + "\n")
    dst = tmp_path / "out.jsonl"
    assert main(["generate", str(out), "--prompts-file", str(src), "--out", str(dst), "--max-new-tokens", "8"]) == 0
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["prompt"] == "The capital of France is" and "Paris" in rows[1]["completion"]
    assert all(isinstance(r["completion"], str) and r["completion"] for r in rows)


@pytest.mark.parametrize("args", [[], ["--prompt", "x", "--prompts-file", "in.jsonl"],
                                  ["--prompts-file", "missing.jsonl", "--out", "o.jsonl"],
                                  ["--prompts-file", "bad.jsonl", "--out", "o.jsonl"]])
def test_cli_generate_user_errors(tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\nnot json\n')
    (tmp_path / "ckpt").mkdir()
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ckpt"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.slow
def test_cli_generate_on_adapter_checkpoint(smollm2, tmp_path, capsys):
    """A training run's final folder (LoRA adapters over a base) generates as the merged model.
    Slow (slow lane): an adapter of the real SmolLM2-135M generates."""
    import shutil

    from eval.generate import chat_ids
    from tests.lora_fixtures import write_adapter_checkpoint
    from zoo.lora.params import LoraConfig

    out, _, tok = smollm2
    adapter = write_adapter_checkpoint(out, tmp_path / "final", LoraConfig(rank=2, alpha=4.0, targets=["q_proj"]))
    shutil.copytree(out / "tokenizer", adapter / "tokenizer")  # as pretrain/final.py copies it
    capsys.readouterr()
    assert main(["generate", str(adapter), "--prompt", "Name a fruit.", "--chat", "--max-new-tokens", "6"]) == 0
    text = capsys.readouterr().out
    merged = zoo.load(adapter)
    ids = chat_ids(tok, [{"role": "user", "content": "Name a fruit."}])
    gen = GenerationConfig(max_new_tokens=6, eos_ids=(tok.eos_token_id,))
    new = generate(merged.cfg, merged.param_dict(), [ids], gen)
    assert text == tok.decode(new[0], skip_special_tokens=True) + "\n"
    base_q = zoo.load_params(out, paths=["layers.q"])["layers"]["q"]  # the base's q alone
    assert not np.allclose(merged.param_dict()["layers"]["q"], base_q)  # merged


@pytest.mark.slow
@pytest.mark.parametrize("absorb", [False, True])
def test_mla_expanded_and_absorbed_attention(tiny, absorb):
    """Both ways of attending over cached MLA latents (chosen by cost in practice) match the full forward.

    Slow (slow lane): compiles the MLA cached forward both ways (about 16 s)."""
    _check_cached_logits(tiny("deepseek_v3")[1], partial(forward_cached_jit, mla_absorb=absorb), "deepseek_v3")


_MESH_SCRIPT = """
import json, sys
import jax
import eval.generate as g
import eval.engine.engine as e
import zoo
seen = []
real = e.init_pool
def spy(*a, **k):
    pool = real(*a, **k)
    seen.extend(str(x.sharding.spec) for x in jax.tree.leaves(pool) if x.ndim >= 3)
    return pool
e.init_pool = spy
model = zoo.load(sys.argv[1])
prompts = json.loads(sys.argv[2])
out = g.generate(model.cfg, model.param_dict(), prompts, g.GenerationConfig(max_new_tokens=3))
print(json.dumps({"devices": jax.device_count(), "tokens": out, "specs": seen}))
"""


@pytest.mark.slow
def test_generation_on_an_8_device_mesh_equals_one_device(tiny_family):
    """zoo.load shards the parameters over 8 (simulated) devices; the engine's paged cache is sharded like them
    (split over the kv heads), and the tokens are those of one device (three: the prefill's and two steps').
    Slow (slow lane): a subprocess on 8 simulated devices compiles the generation loop."""
    import subprocess
    import sys

    ckpt = tiny_family("llama")[1] / "zoo"  # 4 query heads, 2 KV heads (tests/hf_models.py BASE)
    model = zoo.load(ckpt)
    assert (model.cfg.num_heads, model.cfg.num_kv_heads) == (4, 2)
    rng = np.random.RandomState(5)
    # 4 prompts into 64 slots: the reference's programs are test_sampling_is_reproducible's greedy ones.
    prompts = [rng.randint(0, model.cfg.vocab_size, n).tolist() for n in (4, 9, 6, 13)]
    want = generate(model.cfg, model.param_dict(), prompts, GenerationConfig(max_new_tokens=3))
    env = devices_env(8)
    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(ckpt), json.dumps(prompts)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["devices"] == 8 and got["tokens"] == want
    assert got["specs"] and all(s != "PartitionSpec()" for s in got["specs"])  # sharded, not replicated


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2", "deepseek_v3"])
def test_generation_shortcuts_equal_forward_cached(tiny, family):
    """forward_step's fresh prefill (prompts attend to themselves only), last-position logits and a view of
    the first slots give forward_cached's logits and cache.
    Slow (about 44 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""

    from zoo.model.decode import forward_step

    model = tiny(family)[1]
    cfg, params = model.cfg, model.param_dict()
    # The shapes of _check_cached_logits (a 9-wide prefill, then single tokens, into 24 slots): the reference
    # forward_cached programs are test_cached_logits_equal_full_forward's (llama, gemma2) and deepseek_v3's expanded
    # MLA ones of test_mla_expanded_and_absorbed_attention[False] (both ways equal the full forward there), compiled
    # once; forward_step decides the MLA way as generation does.
    cached = partial(forward_cached_jit, mla_absorb=False) if family == "deepseek_v3" else forward_cached_jit
    seqs = random_tokens(cfg.vocab_size, batch=2, seq=9, seed=4)
    valid = np.ones((2, 9), bool)
    valid[0, 7:] = False  # a ragged prefill
    toks, valid = jnp.asarray(seqs), jnp.asarray(valid)
    want, want_cache = cached(cfg, params, toks, _empty_cache(cfg, params), valid)
    last = jnp.asarray([6, 8])
    got, cache = jax.jit(partial(forward_step, cfg, fresh=True))(params, toks, init_cache(cfg, 2, 24), valid,
                                                                  last=last)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[[0, 1], [6, 8]], atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    step = jnp.asarray(seqs[:, :1])
    want, _ = cached(cfg, params, step, cache, jnp.ones((2, 1), bool))
    for view in (9, 16):  # exactly the filled slots; more (a bucket) but fewer than the cache's
        got, _ = jax.jit(partial(forward_step, cfg, view=view))(params, step, cache)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_view_buckets_keep_the_tokens(tiny, monkeypatch):
    """Steps reading only the pages their rows can have filled (small buckets: several per generation) give the
    same tokens, and EOS still cuts each row right after it."""
    import eval.engine.engine as e

    model = tiny("gemma2")[1]
    cfg, params = model.cfg, model.param_dict()
    rng = np.random.RandomState(6)
    prompts = [rng.randint(0, cfg.vocab_size, n).tolist() for n in (3, 14, 6)]
    gen = GenerationConfig(max_new_tokens=20)
    want = generate(cfg, params, prompts, gen)
    # Views of 16 tokens (one page): the steps read 1 page (14 to 16 filled: the last exactly full), then 2 (17 to
    # 32, the last exactly full) of the 4: two step programs.
    monkeypatch.setattr(e, "VIEW_TOKENS", 16)
    assert generate(cfg, params, prompts, gen) == want
    eos = want[1][4]
    got = generate(cfg, params, prompts, GenerationConfig(max_new_tokens=20, eos_ids=(eos,)))
    assert got == [w[:w.index(eos) + 1] if eos in w else w for w in want]
