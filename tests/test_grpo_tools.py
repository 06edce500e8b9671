"""GRPO with tools and environments (issue 45): the call parsers against the real chat templates, the tools'
failures, episodes of a scripted policy checked token by token, the KV cache continued across turns against a
fresh forward pass, and `grpo train` with tools and with an environment."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from chat import tool_calls as tc
from grpo.episodes import EpisodeSettings, run_episodes, tool_suffix
from grpo.tools import run_call
from tests.grpo_tools_model import TOOLS, ending_model
from zoo.errors import UserError

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# Each family's template, its parser, and whether it renders more than one call per turn
FAMILIES = [("qwen2.5", "hermes", True), ("qwen3", "hermes", True), ("llama-3.1", "llama3_json", False),
            ("llama-3.2", "llama3_json", False), ("mistral-v0.3", "mistral", True), ("mistral-nemo", "mistral", True),
            ("mistral-small-3.2", "mistral_args", True)]
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>")  # the templates' end-of-turn texts


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def lookup(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer))


def _assistant_text(tok, source: str, calls: list[dict]) -> str:
    """What the template renders for an assistant turn with ``calls``, its end-of-turn text removed."""
    user = [{"role": "user", "content": "what is 2 + 3, and the weather in Paris?"}]
    kw = {"chat_template": source, "tokenize": False, "tools": [add, lookup]}
    before = tok.apply_chat_template(user, add_generation_prompt=True, **kw)
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": calls}], **kw)
    assert full.startswith(before)
    text = full[len(before):].rstrip("\n")
    for end in END_OF_TURN:
        text = text.removesuffix(end)
    return text


@pytest.mark.parametrize("template, parser, several", FAMILIES)
def test_each_family_parser_reads_its_real_templates_calls(tok, template, parser, several):
    """The template's own rendering of an assistant turn with tool calls parses back to those calls, and
    grpo.tool_parser auto picks the family's parser from the template's source."""
    source = (TEMPLATES / f"{template}.jinja").read_text()
    assert tc.detect(source) == parser
    calls = [{"type": "function", "id": "call00001", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
             {"type": "function", "id": "call00002", "function": {"name": "lookup", "arguments": {"city": "Paris"}}}]
    calls = calls if several else calls[:1]
    parsed = tc.parser_for("auto", source)(_assistant_text(tok, source, calls))
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                            for c in calls]


@pytest.mark.parametrize("parser, text, error", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>', "not valid JSON"),
    ("hermes", '<tool_call>\n{"arguments": {"a": 2}}\n</tool_call>', "needs a \"name\""),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "must be a JSON object"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 2', "not valid JSON"),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}]', "not valid JSON"),
    ("mistral_args", "[TOOL_CALLS]add{}", "without its name[ARGS]"),
])
def test_malformed_calls_are_errors_not_crashes(parser, text, error):
    parsed = tc.PARSERS[parser](text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and error in parsed.errors[0]


def test_plain_answers_have_no_calls():
    assert tc.hermes("The answer is 5.") == tc.ParsedTurn("The answer is 5.")
    assert tc.llama3_json('{"answer": 5}').calls == []  # JSON that names no function is an answer
    assert tc.mistral("5").calls == [] and tc.mistral_args("5").calls == []
    with pytest.raises(UserError, match="renders no tool calls"):
        tc.parser_for("auto", "{{ messages[0]['content'] }}")
    with pytest.raises(UserError, match="choose auto, one of hermes"):
        tc.parser_for("xml", "")


def test_a_tool_that_raises_times_out_or_is_unknown_is_answered_and_counted():
    def boom(x: int) -> int:
        raise ValueError("no such x")

    def slow() -> str:
        time.sleep(5)
        return "late"

    tools = {"add": add, "boom": boom, "slow": slow}
    ok = run_call(tc.ToolCall("add", {"a": 2, "b": 3}), tools, 1.0)
    assert (ok.content, ok.failed) == ("5", False)
    raised = run_call(tc.ToolCall("boom", {"x": 1}), tools, 1.0)
    assert raised.failed and raised.content == "{'error': 'no such x'}"
    started = time.perf_counter()
    late = run_call(tc.ToolCall("slow", {}), tools, 0.2)
    assert late.failed and "timed out after 0.2 s" in late.content and time.perf_counter() - started < 2
    missing = run_call(tc.ToolCall("mul", {}), tools, 1.0)
    assert missing.failed and "Tool mul not found." in missing.content
    bad_args = run_call(tc.ToolCall("add", {"c": 1}), tools, 1.0)
    assert bad_args.failed and "unexpected keyword argument 'c'" in bad_args.content
    malformed = run_call("the tool call is not valid JSON", tools, 1.0)
    assert malformed.failed and "not valid JSON" in malformed.content


class Scripted:
    """A policy whose turns are given: ``script[r][k]`` is row r's k-th turn (token ids). It records what it
    was fed, as the cached decoder would read it."""

    def __init__(self, script: list[list[list[int]]]):
        self.script, self.fed, self.rooms = script, {}, []

    def start(self, prompts, width):
        self.fed = {r: list(p) for r, p in enumerate(prompts)}

    def turn(self, active, room, index):
        self.rooms.append(room.copy())
        out = [self.script[r][index][:room[r]] if active[r] else [] for r in range(len(active))]
        for r, t in enumerate(out):
            self.fed[r] += t[:-1]  # a cached decoder reads every token it draws but the last
        return out, [[-0.5] * len(t) for t in out]

    def extend(self, rows):
        for r, ids in rows.items():
            self.fed[r] += ids


def _settings(tok, source, budget=200, max_turns=None):
    from chat.templates import ChatTemplate, render

    eos = (tok.convert_tokens_to_ids("<|im_end|>"),)
    template = ChatTemplate(source=source)
    suffix = tool_suffix(tok, lambda m, g: render(tok, m, template, source, g), eos)
    return EpisodeSettings(budget, max_turns, eos, 1.0, tc.parser_for("auto", source),
                           lambda t: tok.decode(t, skip_special_tokens=False), suffix), eos


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_scripted_episode_masks_and_messages_token_by_token(tok):
    """Two rows of a scripted policy with the Qwen 2.5 template: row 0 calls add, reads its answer and answers;
    row 1 answers at once. The episode's tokens are the turns and, between them, the template's own rendering
    of the tool's answer and the next generation prompt (found here from the real conversation rendered with
    and without it); only the model's tokens are marked trained; the decoder is fed exactly the conversation;
    row 1's episode ends after its turn and it is fed nothing more."""
    source = (TEMPLATES / "qwen2.5.jinja").read_text()
    s, (eos,) = _settings(tok, source)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    t1, t2, u1 = _ids(tok, call) + [eos], _ids(tok, "It is 5.") + [eos], _ids(tok, "Five.") + [eos]
    user = [{"role": "user", "content": "what is 2 + 3?"}]
    prompt = _ids(tok, tok.apply_chat_template(user, add_generation_prompt=True, tools=[add], chat_template=source,
                                               tokenize=False))
    policy = Scripted([[t1, t2], [u1]])
    e0, e1 = run_episodes(policy, [prompt, prompt], len(prompt), [{"add": add}, {"add": add}], s)

    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call00001", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    answer = {"role": "tool", "name": "add", "content": "5", "tool_call_id": "call00001"}
    kw = {"chat_template": source, "tools": [add], "tokenize": False}
    said = _ids(tok, tok.apply_chat_template(user + [assistant], **kw))
    heard = _ids(tok, tok.apply_chat_template(user + [assistant, answer], add_generation_prompt=True, **kw))
    cut = len(prompt) + len(t1)  # the conversation up to the end-of-turn token the policy drew
    assert said[:cut] == prompt + t1 and heard[:cut] == prompt + t1
    between = heard[cut:]
    assert tok.decode(between).startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>")

    assert e0.tokens == t1 + between + t2
    assert e0.model == [True] * len(t1) + [False] * len(between) + [True] * len(t2)
    assert e0.logps == [-0.5] * len(t1) + [0.0] * len(between) + [-0.5] * len(t2)
    assert e0.messages == [assistant, answer, {"role": "assistant", "content": "It is 5."}]
    assert (e0.tool_calls, e0.tool_failures, e0.ended, len(e0.turns)) == (1, 0, True, 2)
    assert e0.turns[0].results == [{"name": "add", "content": "5", "failed": False}]
    assert policy.fed[0] == prompt + t1 + between + t2[:-1]  # the last token drawn is never fed
    assert e1.tokens == u1 and e1.model == [True] * len(u1) and e1.messages == [
        {"role": "assistant", "content": "Five."}]
    assert policy.fed[1] == prompt + u1[:-1] and len(e1.turns) == 1
    assert list(policy.rooms[1]) == [200 - len(t1) - len(between), 200 - len(u1)]


def test_max_turns_budget_and_malformed_calls_end_episodes_as_trl_does(tok):
    """max_turns 1: a call in the last turn is not run. A budget the tool's answer would not fit: the answer is
    dropped and the episode ends. A malformed call and an unknown tool are answered with an error, counted as
    failures, and the episode goes on. A turn cut by the budget runs no calls."""
    source = (TEMPLATES / "qwen2.5.jinja").read_text()
    call = _ids(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    bad = _ids(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>')
    unknown = _ids(tok, '<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>')
    done = _ids(tok, "ok")
    prompt = _ids(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    s, (eos,) = _settings(tok, source, max_turns=1)
    policy = Scripted([[call + [eos]]])
    (e,) = run_episodes(policy, [prompt], len(prompt), [{"add": add}], s)
    assert (len(e.turns), e.tool_calls, e.turns[0].results) == (1, 0, []) and policy.fed[0] == prompt + call

    s, _ = _settings(tok, source, budget=len(call) + 5)
    (e,) = run_episodes(Scripted([[call + [eos]]]), [prompt], len(prompt), [{"add": add}], s)
    assert e.tool_calls == 1 and e.turns[0].results[0]["dropped"] and e.tokens == call + [eos]
    assert all(e.model) and len(e.messages) == 1

    s, _ = _settings(tok, source)
    (e,) = run_episodes(Scripted([[bad + [eos], unknown + [eos], done + [eos]]]), [prompt], len(prompt),
                        [{"add": add}], s)
    assert (e.tool_calls, e.tool_failures, len(e.turns)) == (2, 2, 3)
    assert "not valid JSON" in e.turns[0].results[0]["content"] and e.messages[1]["role"] == "tool"
    assert "Tool mul not found." in e.turns[1].results[0]["content"]

    s, _ = _settings(tok, source, budget=len(call) - 3)
    (e,) = run_episodes(Scripted([[call + [eos]]]), [prompt], len(prompt), [{"add": add}], s)
    assert e.turns[0].truncated and e.tool_calls == 0 and not e.ended and len(e.tokens) == len(call) - 3


def test_turns_on_one_cache_equal_a_fresh_forward_of_the_whole_conversation(tiny_lm):
    """CachedTurns (greedy): turn 1 from the prompt, the tool's tokens fed after it, turn 2; every drawn token is
    the argmax, and its log-probability the log-softmax, of a fresh forward pass over the whole conversation so
    far. A second row stops after turn 1: its cache is not extended, and its turn 2 is empty."""
    import jax
    import jax.numpy as jnp

    from eval.generate import Sampler
    from eval.turns import CachedTurns
    from zoo.checkpoints.format import read_config
    from zoo.checkpoints.loading import load_params
    from zoo.model.decoder import forward

    cfg, params = read_config(tiny_lm / "zoo"), load_params(tiny_lm / "zoo")
    prompts = [[5, 17, 33, 2, 9], [7, 8]]
    turns = CachedTurns(cfg, params, Sampler(0.0, 0, 1.0), (), 12, jax.random.key(0))
    turns.start(prompts, 6)
    first, lp1 = turns.turn(np.array([True, True]), np.array([4, 3]), 0)
    assert [len(t) for t in first] == [4, 3]
    tool = [40, 41, 42]
    turns.extend({0: [first[0][-1], *tool]})
    second, lp2 = turns.turn(np.array([True, False]), np.array([12 - 4 - 3, 9]), 1)
    assert second[1] == [] and len(second[0]) == 5

    # The three conversations in one fresh forward pass, each right-padded to the longest (causal attention: the
    # padding after a conversation changes none of its logits), read back as NumPy (indexing device arrays with
    # Python ints compiles a program per index).
    rows = [(prompts[0], first[0], lp1[0]), (prompts[1], first[1], lp1[1]),
            (prompts[0] + first[0] + tool, second[0], lp2[0])]
    n = max(len(c) + len(d) for c, d, _ in rows)
    ids = np.asarray([c + d + [0] * (n - len(c) - len(d)) for c, d, _ in rows], np.int32)

    @jax.jit  # one program: run eagerly, the forward compiles each of its ops on its own
    def fresh(params: dict, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = forward(cfg, params, ids, jnp.ones(ids.shape, jnp.int32), jnp.broadcast_to(jnp.arange(n), ids.shape))
        return logits, jax.nn.log_softmax(logits.astype(jnp.float32), -1)

    logits, lsm = (np.asarray(x) for x in fresh(params, ids))
    for r, (context, drawn, logps) in enumerate(rows):
        for k, (t, lp) in enumerate(zip(drawn, logps)):
            at = len(context) - 1 + k
            assert int(np.argmax(logits[r, at])) == t, (r, k)
            assert abs(float(lsm[r, at, t]) - lp) < 1e-5, (r, k)


def test_a_groups_completions_and_a_next_turn_read_cached_pages(tiny_lm):
    """On the engine (pages of 16 tokens): the G = 3 completions of each of two prompts (37 and 20 tokens, 8 new
    each) hold their prompt's full pages once: while all six decode, the pool holds 2 + 3 x 1 and 1 + 3 x 1 pages
    (9; 15 were each row to hold its own), and each group's second and third rows prefill only the tokens past
    those pages. A CachedTurns row's second turn prefills only the tokens past the full pages of its first turn's
    conversation (prompt + turn), which the engine cached when that turn ended."""
    import jax

    from eval.engine.engine import Engine
    from eval.generate import Sampler
    from eval.rollout import RolloutSpec, sample_group_completions
    from eval.turns import CachedTurns
    from zoo.checkpoints.format import read_config
    from zoo.checkpoints.loading import load_params

    cfg, params = read_config(tiny_lm / "zoo"), load_params(tiny_lm / "zoo")
    prompts = [list(range(3, 40)), list(range(50, 70))]
    g, p, t = 3, 40, 8
    tokens, valid = np.zeros((2 * g, p), np.int32), np.zeros((2 * g, p), bool)
    for i, pr in enumerate(prompts):
        tokens[i * g:(i + 1) * g, :len(pr)], valid[i * g:(i + 1) * g, :len(pr)] = pr, True

    def spy(engine: Engine) -> tuple[list[int], list[tuple[int, int]]]:
        held, prefilled = [], []
        step, prefill = engine.step, engine._prefill

        def counted_step():
            out = step()
            held.append(engine.pages.held())
            return out

        def counted_prefill(admitted):
            prefilled.extend((len(r.prompt), r.cached) for r in admitted)
            return prefill(admitted)

        engine.step, engine._prefill = counted_step, counted_prefill  # type: ignore[method-assign]
        return held, prefilled

    engine = Engine(cfg, params, max_seqs=2 * g, max_len=p + t)
    held, prefilled = spy(engine)
    spec = RolloutSpec(g, t, Sampler(1.0, 0, 1.0), ())
    comp, _, lengths = sample_group_completions(cfg, params, tokens, valid, spec, jax.random.key(0), engine=engine)
    assert np.asarray(lengths).tolist() == [t] * (2 * g)
    assert max(held) == (2 + 3) + (1 + 3)
    assert sorted(prefilled) == sorted([(37, 0), (20, 0)] + [(37, 32)] * 2 + [(20, 16)] * 2)

    class Same:  # the turns on the same engine (its compiled programs): a run's RolloutEngine keeps one per shape
        def engine(self, *args):
            return engine

    turns = CachedTurns(cfg, params, Sampler(0.0, 0, 1.0), (), t, jax.random.key(0), engines=Same())
    turns.start([prompts[0]], p)
    prefilled.clear()
    first, _ = turns.turn(np.array([True]), np.array([6]), 0)
    turns.extend({0: [first[0][-1], 70, 71, 72]})  # 37 + 6 + 3 = 46 tokens: 2 full pages cached of the first 42
    turns.turn(np.array([True]), np.array([2]), 1)
    assert prefilled == [(37, 0), (46, 32)]


@pytest.fixture(scope="module")
def eager(tiny_lm, tmp_path_factory):
    """tiny_lm's model made to end every turn at once (its head writes the end-of-turn token whatever it reads),
    so that its episodes' turns, calls and answers are known: the tools' tokens, the KV cache's continuation and
    the masks are checked through `grpo train` itself. Returns (folder, tokenizer folder)."""
    return ending_model(tiny_lm, tmp_path_factory.mktemp("grpo_eager"), 20.0), tiny_lm / "tok"


# The optimizer of the module's runs: a constant rate, so that max_steps is not in the step's program and every run
# (test_kill_and_resume_with_tools_is_bit_identical's 3 steps too) loads the step the first one compiled.
TRAIN_STEP = ("optimizer.learning_rate=3e-2", "schedule.name=constant")


def _grpo_cfg(root, tok_dir, out, *overrides):
    from grpo.config import GRPOConfig
    from pretrain.config import load_config

    return load_config(None, [f"model.path={root / 'zoo'}", f"model.tokenizer={tok_dir}",
                              f"data.chat_template={TEMPLATES / 'qwen2.5.jinja'}", "data.seq_len=160",
                              "batch_size=4", "grpo.num_generations=2", "grpo.max_completion_length=120",
                              "max_steps=1", "grpo.log_completions_every=1", "log_every=1", "lora.rank=2",
                              *TRAIN_STEP, f"output_dir={out}", *overrides], GRPOConfig)


@pytest.mark.slow
def test_grpo_train_with_tools_masks_the_answers_and_logs_whole_episodes(eager, tmp_path):
    """`grpo train` with grpo.tools and a parser that reads every turn as add(2, 3): each episode is three turns
    (max_turns) of one end-of-turn token, two calls and their answers between them, rendered by the template.
    The metrics count them; completions.jsonl holds whole episodes; and the update trains the model's tokens
    only (completions/mean_length counts the 3 model tokens per episode, as TRL counts them)."""
    from grpo.task import GRPOTask
    from pretrain.loop import train
    from tests.run_files import read_metrics, write_jsonl

    root, tok_dir = eager
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "2 + 3?"}]},
                                       {"prompt": [{"role": "user", "content": "add them"}]}])
    cfg = _grpo_cfg(root, tok_dir, tmp_path / "run", f"data.path={tmp_path / 'p.jsonl'}",
                    f"grpo.tools=[{root / 'tools.py'}:add]", f"grpo.tool_parser={root / 'tools.py'}:always_add",
                    "grpo.max_turns=3", f"grpo.rewards=[{root / 'tools.py'}:one]")
    train(cfg, task=GRPOTask(cfg), progress=False)
    m = read_metrics(tmp_path / "run")[0]
    assert (m["num_turns"], m["tool_calls"], m["tool_failures"]) == (3.0, 2.0, 0.0)  # per episode
    assert m["tools/call_frequency"] == 2.0 and m["tools/failure_frequency"] == 0.0
    assert m["completions/mean_length"] == 3.0 and m["turns/clipped_ratio"] == 0.0
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert [msg["role"] for msg in r["messages"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert [msg["content"] for msg in r["messages"] if msg["role"] == "tool"] == ["5", "5"]
        assert [t["results"] for t in r["turns"]][:2] == [[{"name": "add", "content": "5", "failed": False}]] * 2
        assert "<tool_response>\n5\n</tool_response>" in r["completion"]



@pytest.mark.slow
def test_grpo_train_with_tools_under_qwen3s_own_template_trains_under_its_training_template(eager, tmp_path,
                                                                                            capsys):
    """Issue 60 item 14: a tokenizer carrying Qwen3's own template (TRL's copy, trl/chat_templates/qwen3.jinja),
    which re-renders the turn before a tool's answer, and no data.chat_template: `grpo train` with tools runs
    under lmzoo's Qwen3 training template (as TRL's GRPOTrainer swaps in its own), says so in one log line, and
    its episodes hold the tools' answers as Qwen3 renders them. Slow: a GRPO run's compile."""
    import trl
    from transformers import AutoTokenizer

    from grpo.config import GRPOConfig
    from grpo.task import GRPOTask
    from pretrain.config import load_config
    from pretrain.loop import train
    from tests.run_files import read_metrics, write_jsonl

    root, tok_dir = eager
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    tok.save_pretrained(tmp_path / "tok")
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "2 + 3?"}]},
                                       {"prompt": [{"role": "user", "content": "add them"}]}])
    # _grpo_cfg's batch, lengths and optimizer (not its data.chat_template): the programs the module's other runs
    # compiled
    cfg = load_config(None, [f"model.path={root / 'zoo'}", f"model.tokenizer={tmp_path / 'tok'}",
                             f"data.path={tmp_path / 'p.jsonl'}", "data.seq_len=160", "batch_size=4",
                             "grpo.num_generations=2", "grpo.max_completion_length=120", "max_steps=1",
                             "grpo.log_completions_every=1", "log_every=1", "lora.rank=2",
                             f"grpo.tools=[{root / 'tools.py'}:add]", f"grpo.tool_parser={root / 'tools.py'}:always_add",
                             "grpo.max_turns=2", f"grpo.rewards=[{root / 'tools.py'}:one]", *TRAIN_STEP,
                             f"output_dir={tmp_path / 'run'}"], GRPOConfig)
    train(cfg, task=GRPOTask(cfg), progress=False)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("chat template: ")]
    assert len(lines) == 1 and "lmzoo's Qwen3 training template (chat/jinja/qwen3_training.jinja)" in lines[0]
    m = read_metrics(tmp_path / "run")[0]
    assert (m["num_turns"], m["tool_calls"]) == (2.0, 1.0)  # per episode: one call, then the answer
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all("<tool_response>\n5\n</tool_response>" in r["completion"] for r in rows)

@pytest.mark.slow
def test_grpo_train_with_an_environment_resets_scores_and_counts(eager, tmp_path):
    """grpo.environment: one Counter per rollout, reset from its row (its text appended to the user's
    message), its bump method the model's tool, its get_reward a reward source named Counter."""
    from grpo.task import GRPOTask
    from pretrain.loop import train
    from tests.run_files import read_metrics, write_jsonl

    root, tok_dir = eager
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "count"}], "start": 10},
                                       {"prompt": [{"role": "user", "content": "count"}], "start": 20}])
    cfg = _grpo_cfg(root, tok_dir, tmp_path / "run", f"data.path={tmp_path / 'p.jsonl'}",
                    f"grpo.environment={root / 'tools.py'}:counter",
                    f"grpo.tool_parser={root / 'tools.py'}:bump_parser", "grpo.max_turns=2")
    train(cfg, task=GRPOTask(cfg), progress=False)
    m = read_metrics(tmp_path / "run")[0]
    assert m["num_turns"] == 2.0 and m["tool_calls"] == 1.0
    assert m["rewards/Counter/mean"] == pytest.approx(16.0)  # (11 + 11 + 21 + 21) / 4: one bump each
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert sorted(r["rewards"]["Counter"] for r in rows) == [11.0, 11.0, 21.0, 21.0]
    assert all(r["prompt"][-1]["content"].startswith("count (the counter is at ") for r in rows)

    # An environment that ends its episode (done) at the second call, before max_turns: two turns, the last
    # answer in the messages but no turn after it.
    cfg = _grpo_cfg(root, tok_dir, tmp_path / "door", f"data.path={tmp_path / 'p.jsonl'}",
                    f"grpo.environment={root / 'tools.py'}:door",
                    f"grpo.tool_parser={root / 'tools.py'}:knock_parser", "grpo.max_turns=5")
    train(cfg, task=GRPOTask(cfg), progress=False)
    m = read_metrics(tmp_path / "door")[0]
    assert (m["num_turns"], m["tool_calls"], m["rewards/Door/mean"]) == (2.0, 2.0, 2.0)
    rows = [json.loads(x) for x in (tmp_path / "door" / "completions.jsonl").read_text().splitlines()]
    assert [msg["content"] for msg in rows[0]["messages"] if msg["role"] == "tool"] == ["closed", "open"]
    assert rows[0]["messages"][-1]["role"] == "tool"


def test_the_laid_out_batch_weighs_only_the_models_tokens():
    """assemble with an episode's model mask: the targets that are a tool's tokens weigh nothing, the model's
    (truncated rows aside) one, and the sampler's log-probabilities stay aligned with the targets."""
    import jax

    from eval.rollout_batch import assemble

    tokens, valid = np.asarray([[11, 12, 0]], np.int32), np.asarray([[True, True, False]])
    episode = np.asarray([[21, 22, 23, 24, 25, 0]], np.int32)  # model 21, 22; tool 23, 24; model 25
    model = np.asarray([[True, True, False, False, True, False]])
    logps = np.asarray([[-1.0, -2.0, 0.0, 0.0, -5.0, 0.0]], np.float32)
    # NumPy in, jitted, NumPy out: one program (run eagerly, and its inputs made and its outputs indexed on the
    # device, each op compiles its own)
    out = jax.jit(assemble)(tokens, valid, episode, np.asarray([5], np.int32), {"sampler_logps": logps}, {},
                            np.asarray([True]), model)
    out = {k: np.asarray(v) for k, v in out.items()}
    assert out["targets"][0, :6].tolist() == [12, 21, 22, 23, 24, 25]
    assert out["weights"][0].tolist() == [0, 1, 1, 0, 0, 1, 0, 0]
    assert out["sampler_logps"][0].tolist() == [0, -1, -2, 0, 0, -5, 0, 0]


@pytest.mark.slow
def test_kill_and_resume_with_tools_is_bit_identical(tiny_lm, tmp_path):
    """A model that ends a turn after a few sampled tokens (the end-of-turn token about a third of the time), a
    tool called every turn: killed (SIGKILL) after step 2's checkpoint and resumed for step 3, the run's metrics (the
    held-out prompts' rewards and episodes at steps 2 and 3, the last, among them), completions.jsonl (whole episodes) and
    final adapters equal those of a run never stopped.
    Slow: `grpo train` in subprocesses."""
    import os
    import signal
    import subprocess
    import sys

    import jax

    import zoo
    from grpo.cli import main
    from tests.processes import kill_after_checkpoint
    from tests.run_files import read_metrics, write_jsonl

    root = ending_model(tiny_lm, tmp_path / "model", 1.0)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": w}]} for w in ("a", "b", "c")])
    write_jsonl(tmp_path / "held.jsonl", [{"prompt": [{"role": "user", "content": w}]} for w in ("d", "e", "f")])
    args = lambda out, *more: ["train", f"model.path={root / 'zoo'}", f"model.tokenizer={tiny_lm / 'tok'}",  # noqa: E731
                        f"data.path={tmp_path / 'p.jsonl'}", f"data.chat_template={TEMPLATES / 'qwen2.5.jinja'}",
                        "data.seq_len=160", "batch_size=4", "grpo.num_generations=2",
                        "grpo.max_completion_length=120",  # _grpo_cfg's: the programs the others compiled
                        f"grpo.tools=[{root / 'tools.py'}:add]", f"grpo.tool_parser={root / 'tools.py'}:always_add",
                        f"grpo.rewards=[{root / 'tools.py'}:one]", "grpo.max_turns=3", "lora.rank=2",
                        "grpo.log_completions_every=1", "checkpoint.every=2", "max_steps=3", "log_every=1",
                        f"data.eval_path={tmp_path / 'held.jsonl'}", "eval_every=2", *TRAIN_STEP, *more,
                        f"output_dir={out}"]
    # the run never stopped writes no checkpoint before its final one (checkpointing changes nothing it trains or
    # logs)
    assert main(args(tmp_path / "whole", "checkpoint.every=1000")) == 0
    out = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", kill_after_checkpoint("grpo.cli"), "2", *args(out)],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert main(args(out)) == 0
    skip = {"step_time", "tokens_per_sec", "rollout_tokens_per_sec", "train_tokens_per_sec", "generation_share"}
    ma = [{k: v for k, v in m.items() if k not in skip} for m in read_metrics(tmp_path / "whole")]
    mb = [{k: v for k, v in m.items() if k not in skip} for m in read_metrics(out)]
    assert ma == mb and len(ma) == 3
    assert sum(m["tool_calls"] for m in ma) > 3 and len({m["completions/mean_length"] for m in ma}) > 1
    for m in ma[1:]:  # the held-out prompts' rewards and episodes at steps 2 and 3, equal across the resume
        assert {"eval_reward", "eval_greedy_reward", "eval_num_turns", "eval_tool_calls",
                "eval_greedy_tools/call_frequency", "eval_rewards/one/mean"} <= set(m)
    assert (tmp_path / "whole" / "completions.jsonl").read_text() == (out / "completions.jsonl").read_text()
    a = zoo.load(tmp_path / "whole" / "final", dtype=np.float32).param_dict()
    b = zoo.load(out / "final", dtype=np.float32).param_dict()
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


BAD = '''
def undocumented(a: int) -> int:
    return a


class NoReset:
    def act(self) -> str:
        """Act."""
        return "ok"


class Quiet:
    def reset(self, **row):
        return None


def no_reset():
    return NoReset()


def quiet():
    return Quiet()
'''


@pytest.mark.parametrize("overrides, message", [
    (["grpo.tools=[{bad}:undocumented]", "grpo.rewards=[{tools}:one]"], "cannot be described to the model"),
    (["grpo.tools=[{bad}:missing]", "grpo.rewards=[{tools}:one]"], "has no function 'missing'"),
    (["grpo.environment={bad}:no_reset", "grpo.rewards=[{tools}:one]"], "NoReset has no reset method"),
    (["grpo.environment={bad}:quiet"], "defines no get_reward"),
    (["grpo.max_turns=2", "grpo.rewards=[{tools}:one]"], "grpo.max_turns counts the turns of episodes with tools"),
    (["grpo.tools=[{tools}:add]", "grpo.rewards=[{tools}:one]", "grpo.tool_parser=xml"], "choose auto, one of"),
])
def test_bad_tool_settings_are_one_line(tmp_path, overrides, message):
    from grpo.config import GRPOConfig
    from grpo.task import GRPOTask
    from pretrain.config import load_config

    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "tools.py").write_text(TOOLS)
    given = [o.format(bad=tmp_path / "bad.py", tools=tmp_path / "tools.py") for o in overrides]
    with pytest.raises(UserError) as e:
        cfg = load_config(None, [f"data.path={tmp_path / 'p.jsonl'}", "model.path=x", "max_steps=1", *given],
                          GRPOConfig)
        GRPOTask(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_dict_form_picks_each_rows_environment(tmp_path):
    """grpo.environment {name: factory}: each row's environment column picks its kind; instances are pooled (a
    batch draws as many of a kind as it needs, the next batch reuses them); an unknown name is one line."""
    from grpo.tools import Environments

    (tmp_path / "tools.py").write_text(TOOLS)
    envs = Environments({"count": f"{tmp_path / 'tools.py'}:counter", "door": f"{tmp_path / 'tools.py'}:door"})
    assert envs.tool_names("count") == ["bump"] and envs.tool_names("door") == ["knock"]
    names = [envs.pick({"environment": n}, "row") for n in ("count", "door", "count")]
    first = envs.draw(names)
    assert [type(e).__name__ for e in first] == ["Counter", "Door", "Counter"] and first[0] is not first[2]
    again = envs.draw(["count", "count", "door"])
    assert again[0] is first[0] and again[1] is first[2] and again[2] is first[1]
    assert [c.__name__ for c in envs.reward_classes] == ["Counter", "Door"]
    envs.reset(first[0], {"environment": "count", "start": 3})  # the dict form leaves the column out of reset
    assert first[0].count == 3
    with pytest.raises(UserError, match="environment 'maze' is none of grpo.environment's"):
        envs.pick({"environment": "maze"}, "row 3")


def test_a_broken_parser_or_environment_is_one_line(tok, tmp_path):
    """A user's parser that raises or returns something else, an environment whose reset or get_reward raises:
    one-line errors naming them (a tool that raises is the model's feedback; these are the config's bugs)."""
    import dataclasses

    from grpo.tools import EnvironmentReward, Environments

    source = (TEMPLATES / "qwen2.5.jinja").read_text()
    s, (eos,) = _settings(tok, source)
    prompt = _ids(tok, "hi")

    def boom(text):
        raise KeyError("calls")

    for parser, message in ((boom, "grpo.tool_parser boom raised KeyError: 'calls' on the turn 'ok'"),
                            (lambda text: [], "returned no ParsedTurn (got list); return chat.tool_calls.ParsedTurn")):
        with pytest.raises(UserError) as e:
            run_episodes(Scripted([[_ids(tok, "ok") + [eos]]]), [prompt], len(prompt), [{}],
                         dataclasses.replace(s, parser=parser))
        assert message in str(e.value) and "\n" not in str(e.value)

    (tmp_path / "envs.py").write_text(
        "class Bad:\n"
        "    def reset(self, **row):\n"
        "        if row.get('fail'):\n"
        "            raise ValueError('no such level')\n"
        "    def get_reward(self):\n"
        "        return 1 / 0\n"
        "def bad():\n"
        "    return Bad()\n")
    envs = Environments(f"{tmp_path / 'envs.py'}:bad")
    (inst,) = envs.draw([None])
    with pytest.raises(UserError, match=r"^grpo.environment: Bad.reset raised ValueError: no such level$"):
        envs.reset(inst, {"fail": True})
    with pytest.raises(UserError, match=r"^grpo.environment: Bad.get_reward raised ZeroDivisionError"):
        EnvironmentReward(envs, type(inst))(["p"], ["c"])
