"""`zoo serve`: the OpenAI API over the inference engine, called on loopback by the official ``openai`` client and
by lm-eval's local-completions / local-chat-completions models.

One server for the module (tests/serve_fixtures.py): a tiny model of SmolLM2's tokenizer with Qwen 2.5's chat
template, and a LoRA adapter. The oracle is the engine itself, run on each prompt alone before the server starts (the engine is
driven from one thread: once it serves, only the server's thread drives it): every answer the server gives,
streamed or whole, alone or among 32 at once, equals the engine's greedy tokens of the same prompt, decoded and
cut at the request's stop strings.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from eval.engine.api import SamplingParams

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
# Slow (slow lane): the module's one server costs about 21 s before its first test (quiet 2-core machine; 13 s of
# setup and 8 s of tests under CI's 2 workers): the tiny model's conversion and the oracle's engine programs, about
# 45 compilations (prefill and decode at each prompt length, page-table width and adapter the tests need).
pytestmark = pytest.mark.slow

CHAT = [{"role": "system", "content": "You are careful assistant."},
        {"role": "user", "content": "What is the colour of the cat?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WORDS = "the cat sat on the mat and then a big red dog ran under the log quickly".split()
# 32 prompts of 1 to 16 words (mixed lengths) for the concurrent clients; new tokens each.
MANY = [" ".join(WORDS[(k * 5) % 7:][:1 + k % 16]) for k in range(32)]
NEW = 8
MAX_LEN = 256
LONG = 120  # new tokens of the answer a client drops mid-stream


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer):
    """(the server's /v1 URL, the Served model, the Runner, the tokenizer, oracle answers by name)."""
    from serve.app import make_app
    from serve.model import load_served
    from serve.runner import Runner
    from tests.serve_fixtures import ServerThread, serve_checkpoints

    base, adapter = serve_checkpoints(smollm2_tokenizer, tmp_path_factory.mktemp("serve"))
    served = load_served(str(base), name="tiny", adapters=[("sql", str(adapter))], max_seqs=4, max_len=MAX_LEN,
                         page_size=8)
    tok = served.tokenizer
    eos = served.eos_ids

    def alone(ids, max_tokens=NEW, stop=(), adapter=None):  # the engine on this prompt alone: its new tokens
        return served.engine.generate([ids], SamplingParams(max_tokens=max_tokens, stop=tuple(stop), eos_ids=eos,
                                                            adapter=adapter))[0]

    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    tool_ids = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    plain = alone(tok("the cat sat on the")["input_ids"], 12)
    stop = _text(tok, plain, eos, ())[4:6]  # a stop string the answer holds
    oracle = {"chat": alone(chat_ids, 12), "chat_sql": alone(chat_ids, 12, adapter="sql"),
              "tools": alone(tool_ids, 12), "plain": plain, "stop": stop,
              "plain_stop": alone(tok("the cat sat on the")["input_ids"], 12, [stop]),
              "many": [alone(tok(p)["input_ids"]) for p in MANY],
              "lm_eval": [alone(tok(p, add_special_tokens=False)["input_ids"], 6, ["\n\n"]) for p in MANY[:3]],
              "lm_eval_chat": [alone(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                                             add_generation_prompt=True, return_dict=False), 6)
                               for p in MANY[:2]],
              "chat_ids": chat_ids, "tool_ids": tool_ids, "long": alone(chat_ids, LONG)}
    runner = Runner(served.engine)
    runner.start()
    http = ServerThread(make_app(served, runner))
    yield http.url, served, runner, tok, oracle
    http.close()
    runner.close()


def _text(tok, tokens, eos, stop) -> str:
    """The answer a client should read: the tokens without EOS, decoded, cut before the first stop string."""
    from eval.answers import cut_at_stop

    return cut_at_stop(tok.decode([t for t in tokens if t not in eos], skip_special_tokens=True), stop)


def _client(url: str):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def test_models_chat_streaming_adapters_and_completions_match_the_engine(server):
    """GET /v1/models lists the base and its adapter; a greedy chat answer equals the engine's tokens of the
    template's render (its usage counts them), streamed chunks add up to the same text (usage chunk last);
    "model": the adapter decodes with it (another answer, the engine's with that adapter); /v1/completions
    answers a string prompt and a token-id prompt alike, a stop string cuts its text, and a list of prompts gets
    a choice each."""
    url, served, _, tok, oracle = server
    client, eos = _client(url), served.eos_ids
    assert [m.id for m in client.models.list().data] == ["tiny", "sql"]

    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == _text(tok, oracle["chat"], eos, ())
    assert reply.choices[0].finish_reason == ("stop" if oracle["chat"][-1] in eos else "length")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(oracle["chat_ids"]), len(oracle["chat"]))

    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(oracle["chat"])

    sql = client.chat.completions.create(model="sql", messages=CHAT, max_tokens=12, temperature=0)
    assert oracle["chat_sql"] != oracle["chat"]
    assert sql.choices[0].message.content == _text(tok, oracle["chat_sql"], eos, ())

    prompt_ids = tok("the cat sat on the")["input_ids"]
    for prompt in ("the cat sat on the", prompt_ids):
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert done.choices[0].text == _text(tok, oracle["plain"], eos, ())
    stop = oracle["stop"]
    cut = client.completions.create(model="tiny", prompt="the cat sat on the", max_tokens=12, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == _text(tok, oracle["plain_stop"], eos, [stop]) and stop not in cut.choices[0].text
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="the cat sat on the", max_tokens=12, temperature=0,
                                         stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    two = client.completions.create(model="tiny", prompt=MANY[:2], max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == [_text(tok, o, eos, ())
                                                                            for o in oracle["many"][:2]]


def test_tool_calls_parse_the_templates_own_calls_and_reach_the_client(server, monkeypatch):
    """The answer builder reads the calls Qwen 2.5's template renders (hermes) back into OpenAI's message (the
    arguments a JSON string); end to end, ``tools`` reach the template (the prompt is the render with them) and a
    call the parser reads comes back as ``tool_calls`` with finish_reason "tool_calls", whole and streamed. The
    tiny model's greedy answer holds no call: a stand-in parser reads it as one, with the raw answer as argument."""
    from chat.tool_calls import ParsedTurn, ToolCall, hermes
    from serve.chat import answer

    url, served, _, tok, oracle = server
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    before = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(CHAT + [{"role": "assistant", "content": "Let me see.", "tool_calls": calls}],
                                   tools=TOOLS, tokenize=False)
    raw = full[len(before):].rstrip("\n").removesuffix("<|im_end|>")
    message, called = answer("unused", raw, hermes, True)
    assert called and message["content"] == "Let me see."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "get_weather", {"city": "Paris"})]
    assert answer("plain", raw, hermes, False) == ({"role": "assistant", "content": "plain"}, False)

    said = tok.decode([t for t in oracle["tools"] if t not in served.eos_ids], skip_special_tokens=False)
    monkeypatch.setattr(served, "parser", lambda text: ParsedTurn("", [ToolCall("get_weather", {"said": text})]))
    client = _client(url)
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=12, temperature=0)
    assert reply.usage.prompt_tokens == len(oracle["tool_ids"]) != len(oracle["chat_ids"])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] \
        == [("get_weather", {"said": said})]
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=12,
                                                 temperature=0, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] \
        == [(0, "get_weather", {"said": said})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    monkeypatch.undo()
    plain = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=12, temperature=0)
    assert plain.choices[0].message.tool_calls is None  # hermes reads no call in the tiny model's answer
    assert plain.choices[0].message.content == _text(tok, oracle["tools"], served.eos_ids, ())


def test_lm_eval_local_completions_and_local_chat_completions(server):
    """lm-eval's API models against the server: local-completions (token-id prompts, its HF tokenizer) and
    local-chat-completions (messages) give the engine's greedy answers of the same prompts."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    url, served, _, tok, oracle = server
    folder = str(served.tokenizer.name_or_path)
    lm = LocalCompletionsAPI(base_url=f"{url}/completions", model="tiny", tokenizer_backend="huggingface",
                             tokenizer=folder, max_retries=1, max_length=MAX_LEN)
    gen = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    got = lm.generate_until([Instance("generate_until", {}, (p, dict(gen)), i) for i, p in enumerate(MANY[:3])],
                            disable_tqdm=True)
    assert got == [_text(tok, o, served.eos_ids, ["\n\n"]) for o in oracle["lm_eval"]]

    chat = LocalChatCompletion(base_url=f"{url}/chat/completions", model="tiny", max_retries=1)
    requests = [Instance("generate_until", {}, (JsonChatStr(json.dumps([{"role": "user", "content": p}])),
                                                {"max_gen_toks": 6}), i) for i, p in enumerate(MANY[:2])]
    assert chat.generate_until(requests, disable_tqdm=True) == [_text(tok, o, served.eos_ids, ())
                                                                for o in oracle["lm_eval_chat"]]


def test_32_concurrent_clients_each_get_their_answer_alone(server):
    """32 clients at once (the official AsyncOpenAI client; 4 decode at a time, the rest queued), greedy, prompts
    of 1 to 16 words: every answer equals the engine's on that prompt alone."""
    url, served, runner, tok, oracle = server

    async def run_all():
        client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
        async with client:
            return await asyncio.gather(*(client.completions.create(model="tiny", prompt=p, max_tokens=NEW,
                                                                    temperature=0) for p in MANY))

    replies = asyncio.run(run_all())
    assert [r.choices[0].text for r in replies] == [_text(tok, o, served.eos_ids, ()) for o in oracle["many"]]
    assert runner.counts()["requests"] == 0


def _error(response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"]
    return body["error"]["message"]


def test_bad_requests_are_openai_errors_and_a_dropped_stream_is_cancelled(server):
    """Malformed JSON, an unknown model, a prompt over the context, max_tokens 0 or negative, an unknown
    parameter, n > 1, logprobs, a temperature of the wrong type, a tool_choice that forces a call, an image sent
    to this text model: each an OpenAI-shaped 4xx (the official client raises BadRequestError / NotFoundError),
    and the server answers the next request. A streaming client that disconnects mid-answer has its request cancelled (the engine reports it
    "cancelled" and holds no request)."""
    url, served, runner, tok, oracle = server
    post = httpx.Client(base_url=url, timeout=30)
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 4}
    assert "not valid JSON" in _error(post.post("/chat/completions", content=b"{not json",
                                                headers={"content-type": "application/json"}), 400, None)
    assert "'nope'" in _error(post.post("/chat/completions", json={**chat, "model": "nope"}), 404, "model")
    assert "context" in _error(post.post("/chat/completions", json={**chat, "max_tokens": MAX_LEN}), 400, "max_tokens")
    for bad, param in (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
                       ({"frobnicate": 1}, "frobnicate"), ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                       ({"temperature": "hot"}, "temperature"), ({"tool_choice": "required"}, "tool_choice")):
        assert param in _error(post.post("/chat/completions", json={**chat, **bad}), 400, param)
    assert "prompt" in _error(post.post("/completions", json={"model": "tiny", "prompt": [10 ** 6]}), 400, "prompt")
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "hi"}]
    assert "reads no images" in _error(post.post("/chat/completions", json={
        **chat, "messages": [{"role": "user", "content": image}]}), 400, "messages[0].content[0]")
    client = _client(url)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.completions.create(model="tiny", prompt="the", extra_body={"frobnicate": 1})
    good = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert good.choices[0].message.content == _text(tok, oracle["chat"], served.eos_ids, ())

    assert oracle["long"][-1] not in served.eos_ids  # the answer runs to max_tokens: still running when dropped
    before = runner.counts()["cancelled"]
    with post.stream("POST", "/chat/completions", json={**chat, "max_tokens": LONG, "temperature": 0,
                                                        "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the first chunk: it is running
    deadline = time.monotonic() + 20
    while runner.counts()["requests"] or runner.counts()["cancelled"] == before:
        assert time.monotonic() < deadline, runner.counts()
        time.sleep(0.05)
    health = post.get("/health").json()
    assert (health["running"], health["queued"], health["free_pages"]) == (0, 0, health["pages"])
    again = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == good.choices[0].message.content


def test_serve_flags_and_the_missing_extra(server, monkeypatch, capsys):
    """`zoo serve --help` documents every flag; without fastapi/uvicorn it is one line naming the extra; a
    malformed --adapter, or one that is no adapter checkpoint, is one line; --dtype bfloat16 loads the weights
    and makes the KV cache in bfloat16, and the engine answers with an adapter over them."""
    import sys
    from pathlib import Path

    import jax

    from serve.model import load_adapter, load_served, parse_adapters
    from tests.run_files import one_line_error
    from zoo.checkpoints.format import read_meta
    from zoo.cli import main
    from zoo.errors import UserError

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--max-seqs", "--max-len", "--page-size", "--adapter", "--served-model-name",
                 "--dtype"):
        assert flag in out
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert "pip install 'lmzoo[serve]'" in one_line_error(capsys, main, ["serve", "ckpt"])
    with pytest.raises(UserError, match="NAME=PATH"):
        parse_adapters(["sql"])
    base = Path(server[1].tokenizer.name_or_path).parent
    with pytest.raises(UserError, match="is not an adapter checkpoint"):
        load_adapter("self", str(base), base, read_meta(base))
    half = load_served(str(base), name="tiny", adapters=[("sql", str(base.parent / "adapter"))], max_seqs=2,
                       max_len=64, page_size=8, dtype="bfloat16")
    assert {str(a.dtype) for a in jax.tree.leaves((half.engine.weights.base, half.engine.pool))} == {"bfloat16"}
    ids = server[3]("the cat sat on the")["input_ids"]
    assert len(half.engine.generate([ids], SamplingParams(max_tokens=3, adapter="sql"))[0]) == 3
