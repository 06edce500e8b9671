"""`zoo eval`: log-likelihoods, multiple choice, perplexity / bits per byte and generation scoring, task files, CLI.

Expected values come from plain `forward` passes and NumPy (float64 log-softmax),
never from eval's scorers themselves. The tokenizer is byte-level without merges, so
a text's ids are its UTF-8 bytes' ids and the tests can tokenize by hand.
"""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from eval import answers, generation_task, loglikelihood, multiple_choice, perplexity, rolling, scoring
from eval.task_files import load_task, resolve_tasks, shipped_tasks, task_from_dict
from zoo.model.config import ModelConfig
from zoo.model.decoder import Decoder, forward

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CFG = ModelConfig(family="llama", vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)


def byte_tokenizer(add_bos: bool = False):
    """A byte-level BPE tokenizer with no merges (id of byte b = its index in the ByteLevel alphabet), BOS/EOS/PAD.

    With ``add_bos`` its encodings with special tokens start with BOS, as Llama's do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<s>", "</s>", "<pad>"])
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module")
def model():
    m = Decoder(CFG, rngs=nnx.Rngs(0))
    # Larger weights: peaked distributions, so choices and argmaxes actually differ. One program, not one eager
    # multiply compiled per weight shape.
    params = jax.jit(lambda p: jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, p))(m.param_dict())
    return CFG, params


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def log_softmax(x):
    """float64 log-softmax over the last axis."""
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ids(tok, text):
    """Hand tokenization: a byte-level tokenizer without merges maps each UTF-8 byte to one id."""
    out = tok.encode(text, add_special_tokens=False)
    assert len(out) == len(text.encode("utf-8"))
    return out


_forward = jax.jit(forward, static_argnums=0)


def ref_logprobs(cfg, params, tokens):
    """float64 log p(tokens[i] | tokens[:i]) for i >= 1, from one plain forward pass.

    The row is right-padded to a multiple of 64 tokens as one document (no segment ids): attention is
    causal, so the real positions cannot see the padding, and the reference compiles a few times only.
    """
    width = -(-len(tokens) // 64) * 64
    row = np.zeros((1, width), np.int32)
    row[0, :len(tokens)] = tokens
    logits = np.asarray(_forward(cfg, params, row))[0, :len(tokens)]
    lp = log_softmax(logits)
    return np.asarray([lp[i - 1, tokens[i]] for i in range(1, len(tokens))])


def ref_continuation(cfg, params, ctx, cont):
    return float(ref_logprobs(cfg, params, ctx + cont)[len(ctx) - 1:].sum())


@pytest.mark.slow
def test_continuation_loglikelihood_equals_forward(model):
    """Slow (about 36 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    cfg, params = model
    rng = np.random.RandomState(0)
    requests = [(rng.randint(0, 256, n).tolist(), k) for n, k in ((5, 2), (19, 7), (3, 2), (40, 1), (12, 11))]
    got = [ll for ll, _ in loglikelihood.request_scores(cfg, params, requests, batch_size=2)]  # several batches
    want = [ref_logprobs(cfg, params, t)[-k:].sum() for t, k in requests]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_rows_read_in_chunks_through_the_cache_equal_forward(model):
    """A row read `chunk` tokens per pass through the KV cache scores as one plain forward pass of the whole row:
    rows of different lengths in one batch (padding), a chunk that does not divide the row, and a model with
    sliding-window layers whose ring is shorter than the row (it wraps).
    Slow (about 46 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    cfg, params = model
    sliding = dataclasses.replace(cfg, sliding_window=6, layer_types=("sliding", "full"))
    rng = np.random.RandomState(3)
    requests = [(rng.randint(0, 256, n).tolist(), k) for n, k in ((50, 49), (19, 7), (45, 44), (3, 1))]
    for c in (cfg, sliding):
        got = rolling.chunked_scores(c, params, requests, chunk=24, batch_size=2)
        want = [ref_logprobs(c, params, t)[-k:].sum() for t, k in requests]
        np.testing.assert_allclose([ll for ll, _ in got], want, rtol=1e-5, atol=1e-5)
    # The model's own greedy continuation is all-argmax across chunk boundaries; one changed token is not.
    row = [5]
    while len(row) < 40:
        row.append(int(np.argmax(np.asarray(_forward(cfg, params, np.asarray([row + [0] * (64 - len(row))],
                                                                              np.int32)))[0, len(row) - 1])))
    flags = [g for _, g in rolling.chunked_scores(cfg, params, [(row, 39), (row[:-1] + [(row[-1] + 1) % 256], 39)],
                                                  chunk=24, batch_size=2)]
    assert flags == [True, False]
    # window_scores: rows up to `chunk` inputs as plain rows, longer ones chunked, answers in the requests' order.
    mixed = rolling.window_scores(cfg, params, requests, batch_size=2, chunk=24)
    plain = loglikelihood.request_scores(cfg, params, requests, batch_size=2)
    np.testing.assert_allclose([ll for ll, _ in mixed], [ll for ll, _ in plain], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_shared_context_choices_equal_forward(model, monkeypatch):
    """Choices extending one prefilled context (KV cache) score as full forward passes of context + choice do:
    any number of choices per question, choices sharing all but their last token (one extension row), one-token
    choices, one pass over copies of the cache or batch_size rows at a time.
    Slow (about 35 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    cfg, params = model
    rng = np.random.RandomState(1)
    questions = [(rng.randint(0, 256, c).tolist(), [rng.randint(0, 256, k).tolist() for k in ks])
                 for c, ks in ((7, (1, 3, 2, 5)), (30, (4, 1)), (2, (6, 2, 2)), (1, (3, 1)), (5, (17, 2)))]
    questions.append(([9, 8, 7], [[5, 6, 1], [5, 6, 2], [5, 9], [5, 6, 1], [5, 6, 7, 3], [4]]))
    questions.append(([3, 1], [[t] for t in (10, 11, 12, 13, 14, 15, 16, 17)]))
    # The model's own greedy choice (two tokens, sharing its first with another choice), so is_greedy is True once.
    ctx = [9, 8, 7]
    first = int(np.argmax(np.asarray(_forward(cfg, params, np.asarray([ctx + [0] * 61], np.int32)))[0, 2]))
    second = int(np.argmax(np.asarray(_forward(cfg, params, np.asarray([ctx + [first] + [0] * 60], np.int32)))[0, 3]))
    questions.append((ctx, [[first, second], [first, (second + 1) % 256], [first]]))
    want = [[ref_continuation(cfg, params, ctx, c) for c in conts] for ctx, conts in questions]
    plain = multiple_choice.choice_scores(cfg, params, questions, batch_size=2, use_cache=False)
    assert any(g for row in plain for _, g in row)  # some choice is all-greedy: the flags are compared below
    for flat in (True, False):
        monkeypatch.setattr(multiple_choice, "FLAT", flat)
        got = multiple_choice.choice_scores(cfg, params, questions, batch_size=4)
        assert [len(g) for g in got] == [4, 2, 3, 2, 2, 6, 8, 3]
        for g, w, p in zip(got, want, plain):
            np.testing.assert_allclose([ll for ll, _ in g], w, rtol=1e-5, atol=1e-5)
            assert [gr for _, gr in g] == [gr for _, gr in p]
    for g, w in zip(plain, want):
        np.testing.assert_allclose([ll for ll, _ in g], w, rtol=1e-5, atol=1e-5)


def test_context_continuation_split(tok):
    bos_tok = byte_tokenizer(add_bos=True)
    bos = bos_tok.bos_token_id
    assert bos == 256 and bos_tok.encode("a") == [bos] + ids(tok, "a")
    # Trailing whitespace of the context moves to the continuation; BOS (when the tokenizer adds one) leads.
    assert (loglikelihood.context_continuation(bos_tok, "Q: x\nA: ", "yes")
            == ([bos] + ids(tok, "Q: x\nA:"), ids(tok, " yes")))
    assert loglikelihood.context_continuation(tok, "Q: x\nA:", " yes") == (ids(tok, "Q: x\nA:"), ids(tok, " yes"))
    # An empty context: the continuation is predicted from BOS.
    assert loglikelihood.context_continuation(tok, "", "yes") == ([tok.bos_token_id], ids(tok, "yes"))


def test_one_compilation_per_shape(model):
    cfg, params = model
    rng = np.random.RandomState(2)
    loglikelihood.request_scores(cfg, params, [(rng.randint(0, 256, 9).tolist(), 3)], batch_size=4)
    before = loglikelihood._row_scores._cache_size()
    # Other lengths in the same bucket, other parameter values: the compiled program is reused.
    params2 = jax.tree.map(lambda x: x * 1.01, params)
    loglikelihood.request_scores(cfg, params2, [(rng.randint(0, 256, n).tolist(), 2) for n in (4, 13, 17)],
                                 batch_size=4)
    assert loglikelihood._row_scores._cache_size() == before


def test_acc_norm_hand_computation():
    # Question 1: raw log-likelihood prefers "a"; per byte, "bbbbbb" (-2 per byte) beats "a" (-10 per byte).
    # Question 2: both metrics pick choice 0, the gold one.
    m = multiple_choice.mc_metrics([[-10.0, -12.0], [-1.0, -5.0, -9.0]], [["a", "bbbbbb"], ["xy", "z", "é"]], [1, 0])
    assert m["acc"] == 0.5 and m["acc_norm"] == 1.0
    assert m["acc_stderr"] == pytest.approx(math.sqrt(0.25))
    # acc_norm divides by characters, as lm-evaluation-harness: "é" is 1 character (-9 loses to "z"'s -5);
    # acc_bytes divides by UTF-8 bytes: "é" is 2 bytes, so -9 / 2 = -4.5 beats "z"'s -5.
    m = multiple_choice.mc_metrics([[-5.0, -9.0]], [["z", "é"]], [1])
    assert m["acc"] == 0.0 and m["acc_norm"] == 0.0 and m["acc_bytes"] == 1.0
    # Several gold answers: a prediction among them counts.
    m = multiple_choice.mc_metrics([[-1.0, -2.0, -3.0], [-3.0, -2.0, -1.0]], [["a", "b", "c"]] * 2, [[0, 2], [0, 1]])
    assert m["acc"] == 0.5


@pytest.mark.slow
def test_multiple_choice_task_matches_brute_force(model, tok, tmp_path):
    cfg, params = model
    rng = np.random.RandomState(3)
    words = ["red", "blue", "green", "a", "longer answer", "no", "yes"]
    rows = []
    for i in range(9):
        choices = list(rng.choice(words, size=rng.randint(2, 5), replace=False))
        rows.append({"q": f"item {i}?", "opts": [str(c) for c in choices], "label": int(rng.randint(len(choices)))})
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = task_from_dict({"kind": "multiple_choice", "data": "mc.jsonl", "context": "Q: {q}\nA:", "choices": "opts",
                           "gold": "label"}, tmp_path / "mc.yaml")
    # All 9 questions in one batch: one program (the batching itself is test_shared_context_choices_equal_forward's).
    got = multiple_choice.score_multiple_choice(cfg, params, tok, task, task.rows(), batch_size=16, progress=False)
    # Brute force: every (context, " " + choice) through a full forward pass, argmax in NumPy.
    hit, hit_norm = [], []
    for r in rows:
        ctx = ids(tok, f"Q: {r['q']}\nA:")
        ll = np.asarray([ref_continuation(cfg, params, ctx, ids(tok, " " + c)) for c in r["opts"]])
        chars = np.asarray([len(c) for c in r["opts"]])
        hit.append(np.argmax(ll) == r["label"])
        hit_norm.append(np.argmax(ll / chars) == r["label"])
    metrics, items = got
    assert metrics["acc"] == pytest.approx(np.mean(hit)) and metrics["acc_norm"] == pytest.approx(np.mean(hit_norm))
    assert [it["gold"] for it in items] == [[r["label"]] for r in rows] and len(items[0]["loglikelihoods"]) == len(
        rows[0]["opts"])
    assert 0 < np.mean(hit) < 1  # the check discriminates: some right, some wrong

    # Few-shot: the first other row, solved, goes before each question.
    fs = multiple_choice.mc_questions(tok, task, task.rows()[:2], num_fewshot=1)
    assert fs[0][0] == ids(tok, f"Q: item 1?\nA: {rows[1]['opts'][rows[1]['label']]}\n\nQ: item 0?\nA:")


def test_task_format_options(tok, tmp_path):
    """Fixed choice lists, gold as text or several indices, seeded few-shot draws, prompt_description, gen_prefix."""
    rows = [{"q": f"item {i}?", "label": "B" if i % 2 else 0} for i in range(6)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {"kind": "multiple_choice", "data": "mc.jsonl", "context": "Q: {q}\nA:", "choices": ["A", "B", "C"],
            "gold": "label"}
    task = task_from_dict(base, tmp_path / "fixed.yaml")
    qs = multiple_choice.mc_questions(tok, task, task.rows())
    assert [q[2] for q in qs] == [["A", "B", "C"]] * 6 and [q[3] for q in qs] == [[0], [1]] * 3
    # A seeded random draw: repeatable, per row, and not simply the first rows.
    rnd = task_from_dict({**base, "num_fewshot": 2, "fewshot_sampler": "random", "fewshot_seed": 7},
                         tmp_path / "rnd.yaml")
    first = task_from_dict({**base, "num_fewshot": 2}, tmp_path / "first.yaml")
    draws = [multiple_choice.mc_questions(tok, rnd, rnd.rows())[i][0] for i in range(6)]
    assert draws == [multiple_choice.mc_questions(tok, rnd, rnd.rows())[i][0] for i in range(6)]
    assert draws != [q[0] for q in multiple_choice.mc_questions(tok, first, first.rows())]
    # prompt_description before everything, gen_prefix after the question (a space where neither side has one).
    dp = task_from_dict({**base, "num_fewshot": 1, "prompt_description": "Answer well.\n\n",
                         "gen_prefix": "Choice:"}, tmp_path / "dp.yaml")
    ctx, conts, _, _ = multiple_choice.mc_questions(tok, dp, dp.rows()[:2])[0]
    assert ctx == ids(tok, "Answer well.\n\nQ: item 1?\nA: Choice: B\n\nQ: item 0?\nA: Choice:")
    assert conts[0] == ids(tok, " A")
    with pytest.raises(Exception, match="fewshot_sampler"):
        task_from_dict({**base, "fewshot_sampler": "best"}, tmp_path / "bad.yaml")


def test_document_windows_cover_each_token_once():
    doc = list(range(100, 111))  # 11 tokens
    for window, overlap in ((4, 0), (4, 2), (20, 0), (1, 0)):
        reqs = perplexity.document_requests(doc, 7, window, overlap)
        scored = [t for toks, n in reqs for t in toks[-n:]]
        assert scored == doc
        assert all(len(toks) - 1 <= window for toks, _ in reqs)
    # Window 4, overlap 0, by hand: [BOS d0 d1 d2 d3] scores d0..d3; [d3 d4 d5 d6 d7] scores d4..d7; ...
    assert perplexity.document_requests(doc, 7, 4, 0) == [([7] + doc[:4], 4), (doc[3:8], 4), (doc[7:11], 3)]
    # The default, lm-eval's rolling windows: the last one re-reads as much as fills the window.
    assert perplexity.document_requests(doc, 7, 4) == [([7] + doc[:4], 4), (doc[3:8], 4), (doc[6:11], 3)]


def test_rolling_windows_are_lm_evals():
    """The default windows are lm-evaluation-harness's own (its functions, the oracle), for many lengths."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n in (1, 2, 3, 4, 5, 8, 9, 17, 33, 40):
        doc = list(range(100, 100 + n))
        for window in (1, 2, 4, 8, 16):
            ours = perplexity.document_requests(doc, 7, window)
            theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(doc, 7, window, 1)]
            assert ours == [(ctx + cont, len(cont)) for ctx, cont in theirs], (n, window)


def test_perplexity_and_bits_per_byte(model, tok, tmp_path):
    cfg, params = model
    docs = ["The river runs slowly past the old mill.", "Bread: flour, water, salt, yeast — and time."]
    (tmp_path / "t.txt").write_text("\n".join(docs) + "\n\n")
    bos = tok.bos_token_id
    for window in (512, 16):
        task = task_from_dict({"kind": "perplexity", "data": "t.txt", "window": window}, tmp_path / "p.yaml")
        got, docs_log = perplexity.score_perplexity(cfg, params, tok, task, task.rows(), batch_size=3,
                                                    progress=False)
        nll, ntok, nbytes = 0.0, 0, 0
        for d in docs:
            toks = [bos] + ids(tok, d)
            if window == 512:  # the whole document in one pass
                nll -= ref_logprobs(cfg, params, toks).sum()
            else:  # by hand: rows of <= 16 inputs scoring 16 new tokens; the last one filled up with context
                for a in range(1, len(toks), 16):
                    b = min(len(toks), a + 16)
                    c = max(0, b - 17)
                    nll -= ref_logprobs(cfg, params, toks[c:b])[-(b - a):].sum()
            ntok += len(toks) - 1
            nbytes += len(d.encode("utf-8"))
        assert got["tokens"] == ntok and got["bytes"] == nbytes and got["documents"] == 2
        assert got["nll"] == pytest.approx(nll, rel=1e-5)
        assert got["ppl"] == pytest.approx(math.exp(nll / ntok), rel=1e-5)
        assert got["bpb"] == pytest.approx(nll / (math.log(2) * nbytes), rel=1e-5) == got["bits_per_byte"]
        nwords = sum(len(d.split()) for d in docs)
        assert got["words"] == nwords and got["word_perplexity"] == pytest.approx(math.exp(nll / nwords), rel=1e-5)
        assert got["byte_perplexity"] == pytest.approx(math.exp(nll / nbytes), rel=1e-5)
        assert sum(d["loglikelihood"] for d in docs_log) == pytest.approx(-nll, rel=1e-5)


def test_generation_exact_match_and_regex(tok, tmp_path):
    rows = [{"question": "2+2?", "answer": "4"}, {"question": "3+4?", "answer": "7"},
            {"question": "5+5?", "answer": "10"}, {"question": "1+1?", "answer": "2"}]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = {"2+2?": "4\nand more", "3+4?": "The answer is 7.", "5+5?": " 10 ", "1+1?": "3, no: 11 then 2"}

    def stub(prompts):  # known outputs, looked up by the prompt text
        return [ids(tok, outputs[tok.decode(p).split("Q: ")[-1].split("\n")[0]]) for p in prompts]

    base = {"kind": "generation", "data": "g.jsonl", "prompt": "Q: {question}\nA:", "target": "{answer}"}
    em = task_from_dict({**base, "stop": ["\n"], "strip_whitespace": True}, tmp_path / "em.yaml")
    metrics, samples = generation_task.score_generation(tok, em, em.rows(), stub, batch_size=3, progress=False)
    assert metrics["exact_match"] == 0.5  # "4" (cut at \n) and " 10 " (stripped) match
    assert [s["correct"] for s in samples] == [True, False, True, False]
    # Without strip_whitespace, exactly as lm-evaluation-harness compares: " 10 " is not "10".
    exact = task_from_dict({**base, "stop": ["\n"]}, tmp_path / "exact.yaml")
    metrics, _ = generation_task.score_generation(tok, exact, exact.rows(), stub, batch_size=3, progress=False)
    assert metrics["exact_match"] == 0.25

    rx = task_from_dict({**base, "scorer": "regex", "regex": r"(-?\d+)"}, tmp_path / "rx.yaml")
    metrics, _ = generation_task.score_generation(tok, rx, rx.rows(), stub, batch_size=2, progress=False)
    assert metrics["exact_match"] == 1.0  # the last number of each answer: 4, 7, 10, 2
    assert answers.extract("no digits", r"\d+") == "" and answers.extract("a1 b22", r"\d+") == "22"

    # Prompts: plain text (the tokenizer's own special tokens, none here), or the chat template.
    (p0, ref0), = generation_task.generation_examples(tok, em, rows[:1])
    assert p0 == ids(tok, "Q: 2+2?\nA:") and ref0 == "4"
    (p1, _), = generation_task.generation_examples(tok, em, rows[:1], chat_template=True)
    assert p1 == ids(tok, "<|user|>Q: 2+2?\nA:\n<|assistant|>")
    p2 = generation_task.generation_examples(tok, em, rows[:2], num_fewshot=1)[0][0]
    assert p2 == ids(tok, "Q: 3+4?\nA: 7\n\nQ: 2+2?\nA:")


def test_records_task_scores_like_the_demo():
    """The shipped records task judges answers as eval/exact_match.py (the demo's scorer) does."""
    from eval.exact_match import Scored

    task = load_task(shipped_tasks()["records"])
    ref = "name: Kenji | age: 30 | city: Riga"
    for answer in (ref, f"  {ref} \nmore", f"\n\n{ref}", f"{ref} extra", "", " \n ", f"x\n{ref}", ref.upper()):
        assert answers.is_correct(answer, ref, task) == Scored("", ref, answer).correct, answer


def test_shipped_tasks_load():
    tasks = shipped_tasks()
    assert {"records", "easy_mc", "prose"} <= set(tasks)
    records = load_task(tasks["records"])
    rows = records.rows()
    assert records.kind == "generation" and len(rows) == 48  # demo/data/records_eval.jsonl itself
    assert rows[0]["messages"][-1]["content"].startswith("name: ")
    mc = load_task(tasks["easy_mc"]).rows()
    assert len(mc) >= 30 and all(len(r["choices"]) == 4 and 0 <= r["answer"] < 4 for r in mc)
    assert len(load_task(tasks["prose"]).rows()) >= 3


@pytest.mark.parametrize("text, fix", [
    ("kind: essay\ndata: x.jsonl\n", "kind 'essay' is not one of"),
    ("kind: multiple_choice\ndata: x.jsonl\ncontxt: '{q}'\n", "unknown key(s) contxt"),
    ("kind: generation\ndata: x.jsonl\nprompt: '{q}'\n", "needs a target:"),
    ("kind: generation\ndata: x.jsonl\nmessages: m\nscorer: regex\nregex: '('\n", "does not compile"),
    ("kind: [unclosed\n", "not valid YAML"),
    ("- a list\n", "must be a YAML mapping"),
])
def test_bad_task_files(tmp_path, text, fix):
    from zoo.errors import UserError

    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(UserError, match="bad.yaml") as e:
        resolve_tasks(str(tmp_path / "bad.yaml"))
    assert fix in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_evaluate_in_memory(ckpt, tok, tmp_path):
    """The training loop's entry point: in-memory params, Task objects, every kind. The params are the module's
    model as zoo.load places them (as the CLI's): easy_mc's and prose's programs are test_cli_writes_results_json's,
    compiled once."""
    import zoo

    loaded = zoo.load(ckpt)
    cfg, params = loaded.cfg, loaded.param_dict()
    (tmp_path / "g.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}) + "\n")
    gen = task_from_dict({"kind": "generation", "data": "g.jsonl", "messages": "messages", "max_new_tokens": 3,
                          "stop": ["\n"]}, tmp_path / "gen.yaml")
    tasks = [gen] + resolve_tasks("easy_mc,prose")
    res = scoring.evaluate(cfg, params, tok, tasks, limit=2, batch_size=2, progress=False)["tasks"]
    assert set(res) == {"gen", "easy_mc", "prose"}
    assert res["gen"]["metrics"]["exact_match"] in (0.0, 1.0) and res["gen"]["settings"]["chat_template"] is True
    assert res["easy_mc"]["examples"] == 2 and 0 <= res["easy_mc"]["metrics"]["acc"] <= 1
    assert res["prose"]["metrics"]["ppl"] > 1


@pytest.fixture(scope="module")
def ckpt(model, tok, tmp_path_factory):
    from zoo.checkpoints.format import TOKENIZER_DIR
    from zoo.checkpoints.writer import CheckpointWriter, atomic_output
    from zoo.model.params import flatten, param_specs

    cfg, params = model
    out = tmp_path_factory.mktemp("eval") / "ckpt"
    specs = param_specs(cfg)
    with atomic_output(out) as folder:
        w = CheckpointWriter(folder)
        for path, a in sorted(flatten(params).items()):
            w.add(path, np.asarray(a), specs[path].axes)
        tok.save_pretrained(str(folder / TOKENIZER_DIR))
        w.finish(cfg, source="test", source_format="init")
    return out


@pytest.mark.slow
def test_cli_writes_results_json(ckpt, tmp_path, capsys):
    """Slow (about 31 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    from zoo.cli import main

    out = tmp_path / "sub" / "results.json"
    assert main(["eval", str(ckpt), "--tasks", "records,easy_mc,prose", "--limit", "2", "--batch-size", "2",
                 "--out", str(out), "--log-samples"]) == 0
    # --log-samples: one JSONL line per item of every task, with what it was scored on.
    logged = [json.loads(x) for x in (out.parent / "results.samples.jsonl").read_text().splitlines()]
    by_task = {name: [x for x in logged if x["task"] == name] for name in ("records", "easy_mc", "prose")}
    assert [len(v) for v in by_task.values()] == [2, 2, 2]
    assert {"prompt", "answer", "reference", "correct"} <= set(by_task["records"][0])
    assert {"context", "choices", "gold", "loglikelihoods", "pred", "pred_norm"} <= set(by_task["easy_mc"][0])
    assert {"loglikelihood", "tokens", "bytes", "words"} <= set(by_task["prose"][0])
    printed = capsys.readouterr().out
    assert "easy_mc" in printed and "acc_norm" in printed and "bits_per_byte" in printed and "exact_match" in printed
    r = json.loads(out.read_text())
    assert r["checkpoint"] == str(ckpt.absolute())
    assert r["settings"]["limit"] == 2 and r["settings"]["batch_size"] == 2
    assert {"load_s", "eval_s", "total_s"} <= set(r["timings"])
    assert set(r["tasks"]) == {"records", "easy_mc", "prose"}
    for name, kind, metrics, version in (
            ("records", "generation", {"exact_match"}, 1), ("easy_mc", "multiple_choice", {"acc", "acc_norm", "acc_bytes"}, 2),
            ("prose", "perplexity", {"word_perplexity", "byte_perplexity", "bits_per_byte", "ppl", "bpb"}, 2)):
        t = r["tasks"][name]
        assert t["name"] == name and t["version"] == version and t["kind"] == kind and t["examples"] == 2
        assert metrics <= set(t["metrics"]) and t["seconds"] >= 0 and t["settings"]["limit"] == 2
    assert r["tasks"]["easy_mc"]["settings"]["num_fewshot"] == 0
    assert r["tasks"]["records"]["settings"]["chat_template"] is True


def test_cli_bad_task_path_is_one_line(ckpt, tmp_path, capsys):
    from zoo.cli import main

    assert main(["eval", str(ckpt), "--tasks", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "missing.yaml" in err
    assert main(["eval", str(ckpt), "--tasks", "no_such_task"]) == 2
    err = capsys.readouterr().err
    assert "no_such_task" in err and "records" in err and err.count("\n") == 1


def test_cli_attention_kernel_reaches_the_scoring_forward(ckpt, tmp_path, capsys):
    """`zoo eval --attention cudnn` on this CPU machine: the perplexity forward asks for cuDNN's kernel and is refused
    in one line (it reached the model: the perplexity task runs the full forward), with nothing written."""
    from zoo.cli import main

    assert main(["eval", str(ckpt), "--tasks", "prose", "--limit", "1", "--attention", "cudnn",
                 "--out", str(tmp_path / "r.json")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the task's progress line
    assert last.startswith("error: model.attention cudnn: cuDNN attention runs on NVIDIA GPUs"), last
    assert not (tmp_path / "r.json").exists()


def test_fine_bucket_widths():
    """Multiple choice pads to three significant bits: exact below 8, then four widths per power of two."""
    assert [loglikelihood.fine_bucket(n) for n in (1, 5, 7, 8, 9, 14, 15, 17, 69, 100, 129)] == \
        [1, 5, 7, 8, 10, 14, 16, 20, 80, 112, 160]
    assert loglikelihood.fine_bucket(0, 4) == 4 and loglikelihood.fine_bucket(3, 4) == 4
