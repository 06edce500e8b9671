"""The inference engine (eval/engine/): continuous batching, shared prompt pages, per-request settings and adapters.

The oracle of every greedy answer is the training forward (zoo.model.decoder.forward, no cache) teacher-forced over
the prompt and the answer: each new token must be the argmax of the logits before it, and its log-probability
their log-softmax's. One tiny model, one engine shape (pages of 8 tokens, 64-token rows): few compilations.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eval.engine.engine as engine_module
from eval.engine.api import SamplingParams
from eval.engine.engine import Engine
from zoo.errors import UserError
from zoo.lora.params import LoraConfig, init_lora, lora_scale
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.decoder import Decoder, forward

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
PAGE, ROOM = 8, 64


@pytest.fixture(scope="module")
def params():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    # Larger weights: continuations differ from prompt to prompt (a random tiny model's logits are near-flat).
    return jax.tree.map(lambda x: x * 6.0 if x.ndim > 1 else x, model.param_dict())


def _engine(params, **kw) -> Engine:
    return Engine(CFG, params, max_len=ROOM, page_size=PAGE, max_seqs=4, **kw)  # one decoding program for all


_forward = jax.jit(partial(forward, CFG))


def _teacher_forced(weights, prompts, answers) -> list[np.ndarray]:
    """Each answer's log-softmax rows [len(answer), vocab]: the training forward over prompt + answer (one batch,
    right-padded: padding after a position never reaches it)."""
    seqs = [p + a for p, a in zip(prompts, answers)]
    batch = np.zeros((len(seqs), ROOM), np.int32)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s
    logp = np.asarray(jax.nn.log_softmax(_forward(weights, jnp.asarray(batch)), axis=-1))
    return [logp[i, len(p) - 1:len(p) - 1 + len(a)] for i, (p, a) in enumerate(zip(prompts, answers))]


def _assert_greedy(weights, prompts, answers) -> None:
    for i, (lp, a) in enumerate(zip(_teacher_forced(weights, prompts, answers), answers)):
        assert lp.argmax(-1).tolist() == a, f"answer {i} is not the greedy continuation of its prompt"


def _run(engine: Engine, ids: list[int]) -> tuple[dict[int, list[int]], list[list]]:
    """Step to the end: each request's tokens, and each step's events."""
    out: dict[int, list[int]] = {i: [] for i in ids}
    steps = []
    while engine.busy:
        events = engine.step()
        steps.append(events)
        for e in events:
            out[e.request_id].extend(e.tokens)
    return out, steps


def test_rows_join_and_leave_and_every_answer_is_its_greedy_continuation(params, monkeypatch):
    """Six requests of different lengths and budgets on four rows: a queued request takes the row another one
    left while the others are mid-answer, and every answer is the greedy continuation of its own prompt (the
    training forward's argmax), its log-probabilities that forward's; EOS ends only its own request. Steps with
    at most two requests left decode two rows, not four (decoding batches of at least two rows here)."""
    monkeypatch.setattr(engine_module, "DECODE_ROWS", 2)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, 64, n).tolist() for n in (3, 11, 20, 1, 9, 6)]
    budgets = (3, 9, 5, 7, 4, 6)
    engine = _engine(params)
    ids = [engine.submit(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, budgets)]
    out, steps = _run(engine, ids)
    answers = [out[i] for i in ids]
    assert [len(a) for a in answers] == list(budgets)
    # The decoding steps ran the live rows in batches of 2 or 4: fewer rows than 4 a step, at least one a request.
    assert sum(budgets) - len(budgets) <= engine.stats["decode_rows"] < 4 * engine.stats["steps"]
    _assert_greedy(params, prompts, answers)
    # Request 4 starts (its first token) at a step where request 1 is running and not at its first token.
    first: dict[int, int] = {}
    for k, events in enumerate(steps):
        for e in events:
            first.setdefault(e.request_id, k)
    assert first[ids[4]] > first[ids[1]] and any(e.request_id == ids[1] and not e.finished for e in steps[first[ids[4]]])
    assert len({tuple(a) for a in answers}) == 6
    assert engine.free_pages() == engine.num_pages  # every page back (idle cached pages count as available)
    # Log-probabilities and EOS: a request stopped at an answer's third token; its neighbours run on.
    eos = answers[1][2]
    engine = _engine(params)
    ids = [engine.submit(p, SamplingParams(max_tokens=m, eos_ids=(eos,))) for p, m in zip(prompts[:3], budgets)]
    got, _ = _run(engine, ids)
    for a, i in zip(answers[:3], ids):
        assert got[i] == (a[:a.index(eos) + 1] if eos in a else a)


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(params, monkeypatch):
    """Under a prefill budget of 32 tokens a 40-token prompt goes in two chunks (steps 1 and 2, its first token
    at step 2, not at step 1 as a whole prompt would), a short request decoding beside it at every step and a
    queued one joining its last chunk; every answer is the greedy continuation of its prompt (the training
    forward's argmax)."""
    monkeypatch.setattr(engine_module, "PREFILL_TOKENS", 32)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(1, 64, n).tolist() for n in (5, 40, 7)]
    engine = _engine(params)
    ids = [engine.submit(p, SamplingParams(max_tokens=6)) for p in prompts]
    out, steps = _run(engine, ids)
    _assert_greedy(params, prompts, [out[i] for i in ids])
    starts = [next(k for k, events in enumerate(steps) if any(e.request_id == i for e in events)) for i in ids]
    assert starts == [0, 2, 2]
    assert all(any(e.request_id == ids[0] for e in steps[k]) for k in (0, 1, 2))


def test_a_group_reads_one_copy_of_its_prompt(params):
    """G = 3 completions of one 37-token prompt hold its 4 full pages once (the first computes them; the others
    wait one step and read them), each answer equal to the greedy continuation; after they end, a request
    repeating the prompt and an answer (a chat's next turn) computes only what no page holds."""
    rng = np.random.RandomState(1)
    prompt = rng.randint(1, 64, 37).tolist()
    engine = _engine(params)
    ids = [engine.submit(prompt, SamplingParams(max_tokens=6)) for _ in range(3)]
    held = []
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.busy:
        for e in engine.step():
            out[e.request_id].extend(e.tokens)
        held.append((engine.running, engine.pages.held()))
    # 4 shared pages + 2 own pages each (37 + 6 tokens = 6 pages) while all three run; unshared: 18.
    assert (3, 4 + 3 * 2) in held and max(h for _, h in held) == 10
    answers = [out[i] for i in ids]
    assert answers[0] == answers[1] == answers[2]
    _assert_greedy(params, [prompt], answers[:1])
    # The next turn: prompt + answer + 5 new tokens. Its first 5 pages (40 tokens: prompt and the answer's held
    # tokens) are cached; it computes the other 8.
    turn = prompt + answers[0] + rng.randint(1, 64, 5).tolist()
    before = engine.stats["cached_tokens"]
    nxt = engine.generate([turn], SamplingParams(max_tokens=4))[0]
    assert engine.stats["cached_tokens"] - before == 40
    _assert_greedy(params, [turn], [nxt])


def test_each_request_draws_with_its_own_settings(params):
    """In one batch: a greedy request, two sampled ones with their own seeds, and a top-k 1 one (greedy in
    effect). A seeded request draws the same tokens alone and beside others; another seed draws others; the
    greedy rows are the training forward's argmax, and every token's log-probability is under softmax(logits /
    its temperature), before the cut."""
    rng = np.random.RandomState(2)
    prompts = [rng.randint(1, 64, n).tolist() for n in (5, 9, 9, 14)]
    settings = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0, seed=7),
                SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=8),
                SamplingParams(max_tokens=8, temperature=1.3, top_k=1, seed=9)]
    engine = _engine(params)
    ids = [engine.submit(p, s) for p, s in zip(prompts, settings)]
    logprobs: dict[int, list[float]] = {i: [] for i in ids}
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.busy:
        for e in engine.step():
            out[e.request_id].extend(e.tokens)
            logprobs[e.request_id].extend(e.logprobs)
    answers = [out[i] for i in ids]
    _assert_greedy(params, [prompts[0], prompts[3]], [answers[0], answers[3]])
    alone = engine.generate([prompts[1]], settings[1])[0]
    assert alone == answers[1]
    other = engine.generate([prompts[1]], SamplingParams(max_tokens=8, temperature=1.0, seed=70))[0]
    assert other != answers[1]
    for s, lp, a, i in zip(settings, _teacher_forced(params, prompts, answers), answers, ids):
        t = s.temperature or 1.0
        # log-softmax of logits / t from the forward's log-softmax (a shift per row): logits = lp + const.
        want = np.asarray(jax.nn.log_softmax(jnp.asarray(lp) / t, axis=-1))[np.arange(len(a)), a]
        np.testing.assert_allclose(logprobs[i], want, atol=2e-4, rtol=0)


def test_cancelling_and_bad_requests(params):
    """A cancelled request (queued or running) ends with reason "cancelled" and gives its pages back; an empty
    prompt, one over the room, a budget under 1 and an unknown adapter are refused at submit."""
    engine = _engine(params)
    ids = [engine.submit([1 + i, 2, 3], SamplingParams(max_tokens=20)) for i in range(5)]
    engine.step()
    assert engine.running == 4 and engine.queued == 1
    a, b = ids[0], ids[4]  # running, queued
    engine.cancel(a)
    engine.cancel(b)
    events = engine.step()
    assert {(e.request_id, e.reason) for e in events if e.finished} == {(a, "cancelled"), (b, "cancelled")}
    assert engine.running == 3
    for i in ids[1:4]:
        engine.cancel(i)
    engine.step()
    assert not engine.busy and engine.pages.held() == 0
    for prompt, params_, match in [([], SamplingParams(), "at least one token"),
                                   ([1] * 60, SamplingParams(max_tokens=5), "exceed the context of 64"),
                                   ([1], SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
                                   ([1], SamplingParams(max_tokens=4, adapter="nope"), "no adapter named 'nope'")]:
        with pytest.raises(UserError, match=match):
            engine.submit(prompt, params_)


def _adapters(seed: int, lc: LoraConfig) -> tuple[dict, float]:
    rng = np.random.RandomState(seed)
    shapes = jax.eval_shape(lambda: init_lora(CFG, lc, jax.random.key(0)))
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.5, a.shape), jnp.float32), shapes), lora_scale(lc)


def test_requests_name_their_adapter(params):
    """Two fine-tunes over one base served at once: requests on adapter a1, the base and adapter a2 in one batch
    each get the greedy continuation under their own weights (the training forward with that adapter alone); the
    same prompt under two adapters shares no page (their keys and values differ)."""
    fine = {"a1": _adapters(1, LoraConfig(rank=4, alpha=8.0)),
            "a2": _adapters(2, LoraConfig(rank=2, alpha=4.0, targets=["q_proj", "v_proj", "down_proj"]))}
    engine = _engine(params, adapters=fine)
    assert engine.adapter_names == ("a1", "a2")
    prompt = np.random.RandomState(3).randint(1, 64, 20).tolist()
    names = ["a1", None, "a2"]
    answers = engine.generate([prompt] * 3, [SamplingParams(max_tokens=6, adapter=n) for n in names])
    assert len({tuple(a) for a in answers}) == 3
    for n, a in zip(names, answers):
        w = Weights(params) if n is None else Weights(params, *fine[n])
        _assert_greedy(w, [prompt], [a])
    assert engine.stats["cached_tokens"] == 0
