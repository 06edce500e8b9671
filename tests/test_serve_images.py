"""`zoo serve` with a vision-language model: a chat request's ``image_url`` parts (inline ``data:`` URLs) expanded
as the model's processor does, answered as transformers' ``generate`` answers the same conversation and images;
image URLs the server would have to fetch, and bytes that are no image, are OpenAI-shaped 400s."""

import base64

import pytest
import torch

from tests.vlm_models import make_vlm
from tests.vlm_processors import reference_processor, smolvlm_folder, write_images
from zoo.cli import main

QUESTION = "What is in this picture?"
# A second server (a vision-language model's): the fast lane leaves the servers to the full suite.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    """(an OpenAI client of `zoo serve` over a tiny SmolVLM checkpoint, transformers' model, its source folder, an
    image file); the server in-process on loopback."""
    import openai

    from serve.app import make_app
    from serve.model import load_served
    from serve.runner import Runner
    from tests.serve_fixtures import ServerThread

    root = tmp_path_factory.mktemp("serve_vlm")
    src = smolvlm_folder(root / "hf", splitting=True)
    tok = reference_processor(src).tokenizer
    hf = make_vlm(src, vocab_size=len(tok), image_token_id=tok.convert_tokens_to_ids("<image>"))
    assert main(["convert", str(src), "--out", str(root / "zoo")]) == 0
    served = load_served(str(root / "zoo"), name="vlm", adapters=[], max_seqs=2, max_len=256, page_size=16)
    runner = Runner(served.engine)
    runner.start()
    http = ServerThread(make_app(served, runner))
    yield openai.OpenAI(base_url=http.url, api_key="none", max_retries=0), hf, src, \
        root / write_images(root, [(56, 42)], seed=7)[0]
    http.close()
    runner.close()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_an_image_in_a_chat_request_is_answered_as_transformers_answers_it(vlm_server):
    """A user turn of an image (a PNG as a data: URL) and a question: the answer is transformers' greedy reply to
    the same turn through its processor (8 tokens at most, the tokenizer's EOS ending it)."""
    from PIL import Image

    client, hf, src, path = vlm_server
    proc = reference_processor(src)
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = proc.tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[text], images=[[Image.open(path).convert("RGB")]], return_tensors="pt")
    eos = proc.tokenizer.eos_token_id
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=[eos], pad_token_id=eos)
    want = proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    got = client.chat.completions.create(model="vlm", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [_image_part(url), {"type": "text", "text": QUESTION}]}])
    assert want and got.choices[0].message.content == want
    assert got.usage.prompt_tokens == inputs["input_ids"].shape[1]


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "fetches no URL"),
    ("data:image/png;base64,not*base64", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"no image here").decode(), "messages:"),
])
def test_images_the_server_cannot_read_are_400s(vlm_server, url, message):
    """An image URL to fetch, a data: URL that is not base64, and bytes no image reader takes: 400 naming it."""
    import openai

    client = vlm_server[0]
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="vlm", max_tokens=2, messages=[
            {"role": "user", "content": [_image_part(url), {"type": "text", "text": QUESTION}]}])
