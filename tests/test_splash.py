"""Splash attention (model.attention: splash, zoo.kernels.splash): the Pallas TPU kernel in interpret mode against the
blockwise path (outputs and gradients, float32), a whole model's loss and gradients, what it cannot run, and a
TPU program compiled on this CPU machine that holds the kernel."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.lora_fixtures import lora_base_params
from zoo.errors import UserError
from zoo.kernels.blockwise import blockwise_attention, query_block
from zoo.kernels.choice import check_platform, kernel_for, uses_splash
from zoo.kernels.splash import block_sizes
from zoo.layers.attention import splash_heads
from zoo.model.config import ModelConfig
from zoo.model.decoder import forward
from zoo.model.masks import attention_mask
from zoo.model.params import init_params


def _packed(t: int) -> np.ndarray:
    """Row 0: three documents (lengths not multiples of 128) and trailing padding (id 0); row 1: one document."""
    a, b = t // 3 + 5, t // 4 + 7
    row = np.r_[np.full(a, 1), np.full(b, 2), np.full(t - a - b - 9, 3), np.zeros(9, int)]
    return np.stack([row, np.ones(t, int)]).astype(np.int32)


def _positions(seg: np.ndarray) -> np.ndarray:
    """Positions restarting at each change of segment id."""
    pos = np.zeros_like(seg)
    for i in range(1, seg.shape[1]):
        pos[:, i] = np.where(seg[:, i] == seg[:, i - 1], pos[:, i - 1] + 1, 0)
    return pos


# "one document" and "packed with padding" differ in their segment ids alone, an argument of the programs below: the
# second compiles nothing (JAX's compilation cache holds the first's programs).
CASES = {  # t, kv heads, query heads per kv head, head dim, segment ids, window, soft-cap
    "one document": (384, 1, 2, 16, lambda t: np.ones((2, t), np.int32), None, None),
    "packed with padding": (384, 1, 2, 16, _packed, None, None),
    "sliding window": (384, 1, 2, 16, _packed, 100, None),
    "soft-cap": (128, 2, 1, 32, _packed, None, 5.0),
    "GQA, 4 query heads per kv head": (128, 2, 4, 16, _packed, None, None),
}


@pytest.mark.parametrize("case", CASES)
def test_splash_equals_blockwise_with_gradients(case):
    """Interpret-mode splash against zoo.kernels.blockwise (itself checked against plain softmax and transformers): the
    outputs and dq, dk, dv in float32. Sequences of 384 take three 128-token blocks, so the kernel's skipping of
    the blocks above the diagonal and left of the window is exercised."""
    t, hk, g, d, segments, window, cap = CASES[case]
    rng = np.random.RandomState(0)
    b = 2
    # NumPy arguments (jnp.asarray would compile a conversion per shape)
    q, k, v, dout = (rng.randn(*s).astype(np.float32)
                     for s in [(b, hk, g, t, d), (b, hk, t, d), (b, hk, t, d), (b, t, hk * g * d)])
    seg = segments(t)
    cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                      num_heads=hk * g, num_kv_heads=hk, head_dim=d, attn_softcap=cap)

    def splash(q, k, v, seg):
        return splash_heads(q, k, v, seg, cfg, window, cap)

    def blockwise(q, k, v, seg):
        return blockwise_attention(q, k, v, attention_mask(seg, window), cfg.attn_scale, cap, window, query_block(t))

    @jax.jit
    def splash_and_grads(q, k, v, seg, dout):  # one program each: the output and dq, dk, dv for the cotangent dout
        out, vjp = jax.vjp(lambda q, k, v: splash(q, k, v, seg), q, k, v)
        return out, vjp(dout)

    @jax.jit
    def blockwise_and_grads(q, k, v, seg, dout):
        out, vjp = jax.vjp(lambda q, k, v: blockwise(q, k, v, seg), q, k, v)
        return out, vjp(dout)

    (out, got), (ref, want) = splash_and_grads(q, k, v, seg, dout), blockwise_and_grads(q, k, v, seg, dout)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    for name, x, y in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


GEMMA2ISH = ModelConfig(family="gemma2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, norm_offset=1.0, embed_scale=True, post_norms=True,
                        hidden_act="gelu_pytorch_tanh", attn_softcap=20.0, final_softcap=30.0, sliding_window=70,
                        layer_types=("sliding", "full"))
MLA = ModelConfig(family="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                  num_heads=2, num_kv_heads=2, head_dim=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16)


@pytest.mark.parametrize("cfg", [pytest.param(GEMMA2ISH, marks=pytest.mark.slow), MLA],  # slow lane: 7 s
                         ids=["gemma2-like: window, soft-cap, GQA", "latent attention"])
def test_a_models_loss_and_gradients_with_splash_equal_blockwise(cfg):
    """A whole tiny model's next-token loss over packed rows, and its gradients for every parameter, with
    attention splash against the blockwise path (DeepSeek's latent attention: against its full-softmax path)."""
    t = 128
    # init_params' N(0, 0.02), norms and biases drawn with NumPy (no initialization program to compile), x 4
    params = jax.tree.map(lambda x: np.asarray(x) * np.float32(4) if x.ndim > 1 else x, lora_base_params(cfg))
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, t + 1)), jnp.int32)
    seg = jnp.asarray(_packed(t + 1))
    pos = jnp.asarray(_positions(np.asarray(seg)))

    def loss(params, attention):
        c = dataclasses.replace(cfg, attention=attention)
        logits = forward(c, params, tokens[:, :-1], seg[:, :-1], pos[:, :-1])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
        keep = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
        return jnp.sum(nll * keep) / jnp.sum(keep)

    got, g_got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, "splash")
    want, g_want = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, "blockwise")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-5)
    for path, x in jax.tree_util.tree_leaves_with_path(g_got):
        y = g_want
        for key in path:
            y = y[key.key]
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_no_seq_by_seq_mask_on_the_splash_or_blockwise_path():
    """Neither the splash nor the blockwise forward builds a [t, t] array (the jaxpr of the model's forward,
    t = 384: 128-token blocks): splash reads the segment ids, blockwise builds each block's mask in the block."""
    cfg = dataclasses.replace(GEMMA2ISH, attention="splash")
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                          jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.float32)))
    tokens = jax.ShapeDtypeStruct((2, 384), jnp.int32)

    def squares(f, *args):
        return re.findall(r"\[[\d,]*384,384\]", str(jax.make_jaxpr(f)(*args)))

    assert squares(lambda x: attention_mask(x, 7), tokens)  # a whole mask: the check sees such arrays
    for attention in ("blockwise", "splash"):
        c = dataclasses.replace(cfg, attention=attention)
        assert squares(lambda p, x: forward(c, p, x, x), params, tokens) == [], attention


def test_block_sizes_are_the_largest_tile_dividing_the_sequence():
    assert [block_sizes(t).block_q for t in (128, 256, 384, 512, 640, 768, 4096)] == [128, 256, 128, 512, 128,
                                                                                       256, 512]
    bs = block_sizes(1024)
    assert bs.has_backward_blocks and {bs.block_kv, bs.block_q_dq, bs.block_kv_dkv_compute} == {512}


def test_what_splash_cannot_run_is_a_user_error_and_auto_keeps_it_on_blockwise(monkeypatch):
    cfg = dataclasses.replace(GEMMA2ISH, layer_types=("full", "full"), attention="splash")
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.float32))  # traced, never run
    tokens = jnp.zeros((1, 128), jnp.int32)
    seg = jnp.asarray(np.r_[np.full(60, 1), np.full(68, 2)][None], jnp.int32)
    with pytest.raises(UserError) as e:  # DPO's shared prompt: answer 2 reads prompt segment 1
        jax.eval_shape(lambda p: forward(cfg, p, tokens, seg, prefix_ids=jnp.where(seg == 2, 1, 0)), params)
    assert str(e.value) == ("model.attention splash: shared prefixes (prefix_ids, DPO's pairs) let a token read "
                            "another segment, and splash's segment ids only pair equal ids; use attention: auto or "
                            "blockwise")
    with pytest.raises(UserError) as e:
        jax.eval_shape(lambda p: forward(cfg, p, tokens[:, :100]), params)
    assert str(e.value) == ("model.attention splash: sequence length 100 is not a multiple of splash's 128-token "
                            "blocks; use attention: auto or blockwise")  # one line: the CLI prints str(e)
    assert kernel_for(cfg, jnp.float32, 128) == "splash"  # on the CPU: interpret mode

    auto = dataclasses.replace(cfg, attention="auto")
    assert uses_splash(auto, 128) == (jax.default_backend() == "tpu")  # here: a CPU program
    monkeypatch.setattr("zoo.kernels.choice.platform", lambda: "tpu")
    assert uses_splash(auto, 128) and kernel_for(auto, jnp.bfloat16, 128) == "splash"
    assert not uses_splash(auto, 128, prefix=True) and not uses_splash(auto, 100)
    assert kernel_for(auto, jnp.bfloat16, 128, prefix=True) == "blockwise"
    assert kernel_for(dataclasses.replace(cfg, attention="blockwise"), jnp.bfloat16, 128) == "blockwise"
    monkeypatch.setattr("zoo.kernels.choice.platform", lambda: "gpu")
    with pytest.raises(UserError, match="splash attention is a TPU kernel .interpreted on CPUs, for tests., not for "
                                        "GPUs; use attention: auto or blockwise"):
        check_platform("splash", "bfloat16")
    with pytest.raises(UserError, match="not for GPUs"):
        kernel_for(cfg, jnp.bfloat16, 128)


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "tie_word_embeddings": False}


@pytest.mark.parametrize("mesh,per_chip", [("fsdp: 2\n  tensor: 2", "f32[4,2,128,16]"),
                                           ("data: 1\n  fsdp: 1\n  tensor: 4", "f32[8,4,128,16]")])
def test_a_tpu_train_step_compiled_here_runs_the_splash_kernel_sharded(tmp_path, capsys, monkeypatch, mesh, per_chip):
    """`train --compile-only --topology v5e:2x2` with model.attention auto (a TPU program: splash) compiles a
    step whose HLO holds the Mosaic kernels (tpu_custom_call: forward, dq, dk/dv), each chip's on its own 4 of
    the 8 rows (fsdp = 2) and 2 of the 4 query heads (tensor = 2, one key/value head each): shard_map. Where
    nothing splits (2 key/value heads over tensor = 4) the kernel still runs in a shard_map, every row and head
    on each chip: Mosaic kernels cannot be partitioned automatically (a traceback before)."""
    from pretrain.cli import main
    from tests.program_checks import keep_compiled_text

    texts = keep_compiled_text(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    f = tmp_path / "run.yaml"
    f.write_text(f"model: {tmp_path / 'config.json'}\ndata:\n  path: {tmp_path / 'absent.jsonl'}\n  seq_len: 128\n"
                 f"batch_size: 8\nmax_steps: 1\noutput_dir: {tmp_path / 'run'}\nmesh:\n  {mesh}\n")
    assert main(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2"]) == 0, capsys.readouterr()
    kernels = [line.split(" = ")[0].strip() for line in texts[-1].splitlines()
               if 'custom_call_target="tpu_custom_call"' in line]
    assert {k.split("_segmented")[0].lstrip("%") for k in kernels} == {"splash_mha_fwd", "splash_mha_dq",
                                                                         "splash_mha_dkv"}
    # The forward kernels' outputs: one chip's rows x query heads x 128 tokens x head_dim 16.
    forward_lines = [line for line in texts[-1].splitlines() if "%splash_mha_fwd" in line.split(" = ")[0]]
    assert forward_lines and all(per_chip in line.split(" custom-call(")[0] for line in forward_lines)


def test_dpo_with_shared_prompts_and_splash_stops_before_compiling(tmp_path, capsys):
    """DPO lays a pair's answers after one shared prompt (prefix_ids) unless dpo.share_prompt is off: with
    model.attention splash that is said as one line naming the way out, before any program is built."""
    from dpo.cli import main

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    f = tmp_path / "run.yaml"
    f.write_text(f"model:\n  path: {tmp_path / 'config.json'}\n  attention: splash\ndata:\n  path: "
                 f"{tmp_path / 'absent.jsonl'}\n  seq_len: 128\nbatch_size: 8\nmax_steps: 1\n"
                 f"output_dir: {tmp_path / 'run'}\nlora:\n  rank: 4\n")
    assert main(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: model.attention splash cannot read DPO's shared prompts (an answer reads its prompt's segment; "
        "splash's segment ids only pair equal ids): set dpo.share_prompt: false, or attention: auto or blockwise"]


@pytest.mark.parametrize("command,extra", [("pretrain", []), ("grpo", ["grpo.rewards=[final_number]",
                                                                       "grpo.max_completion_length=28"])])
def test_rows_splash_cannot_run_are_refused_before_the_run_folder_is_written(tmp_path, command, extra):
    """model.attention splash with rows that are not whole 128-token blocks (GRPO's rows: the prompt and its
    completion, 128 + 28) is said with the other config checks, before anything is read or written."""
    import importlib

    from pretrain.config import load_config
    from pretrain.loop import train

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    config_class = getattr(importlib.import_module(f"{command}.config"), f"{command.upper()}Config", None)
    common = ["model.init=random", f"model.config={tmp_path / 'config.json'}", f"data.path={tmp_path / 'absent'}",
              "model.attention=splash", "max_steps=1", f"output_dir={tmp_path / 'run'}",
              f"model.tokenizer={tmp_path / 'absent-tokenizer'}"]
    task = None
    if command == "grpo":
        from grpo.task import GRPOTask

        cfg = load_config(None, common + extra + ["data.seq_len=128"], config_class)
        task = GRPOTask(cfg)
    else:
        cfg = load_config(None, common + ["data.seq_len=100"])
    with pytest.raises(UserError, match=r"^model.attention splash: sequence length (100|156) is not a multiple of "
                                        r"splash's 128-token blocks"):
        train(cfg, progress=False, task=task)
    assert not (tmp_path / "run").exists()
