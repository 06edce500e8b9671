"""Vision-language data (chat/images.py, chat/formats.py, zoo/data/images.py): TRL's image rows -> token ids, loss
masks and pixel values, checked against transformers' own processor (the ids and pixels) and TRL's
``prepare_multimodal_messages`` (where image parts go), on a tiny SmolVLM processor (tests/vlm_processors.py)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from chat.formats import BadRow, normalize
from chat.images import ImageExpander, tokenize_image_rows, tokenize_with_images
from chat.loss_masks import render_mask, tokenize_example
from tests.vlm_processors import IMAGE_SEQ_LEN, reference_processor, smolvlm_folder, write_images
from zoo.errors import UserError

# (width, height): square, portrait, landscape, and a wide one that SmolVLM cuts into 1 x 2 tiles.
SIZES = [(28, 28), (20, 28), (60, 40), (60, 20)]
QUESTION, ANSWER = "What is in this picture?", "It is a red square."


@pytest.fixture(scope="module", params=[False, True], ids=["whole", "tiles"])
def vlm(request, tmp_path_factory):
    """A tiny SmolVLM processor folder (image splitting off, then on), its expander, transformers' processor
    for it, and image files beside the data."""
    from PIL import Image
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vlm")
    folder = smolvlm_folder(root / "model", splitting=request.param)
    tok = AutoTokenizer.from_pretrained(str(folder))
    names = write_images(root, SIZES)
    return SimpleNamespace(root=root, tok=tok, expander=ImageExpander.from_folder(folder, tok),
                           ref=reference_processor(folder), names=names,
                           pil=[Image.open(root / n).convert("RGB") for n in names], splitting=request.param)


def _chat(user, answer=ANSWER):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _reference(vlm, messages, images):
    """transformers' ids and pixels for a conversation rendered by the chat template from TRL's messages."""
    from trl.data_utils import prepare_multimodal_messages

    text = vlm.tok.apply_chat_template(prepare_multimodal_messages(messages, images), tokenize=False)
    return vlm.ref(text=text, images=images, return_tensors="np")


@pytest.mark.parametrize("case", ["one image", "two image parts", "three images in two turns"])
def test_ids_and_pixels_are_the_processors(vlm, case):
    parts = [{"type": "image"}, {"type": "text", "text": QUESTION}, {"type": "image"}]
    rows = {
        "one image": (_chat(QUESTION), [0]),
        "two image parts": (_chat(parts), [1, 3]),
        "three images in two turns": (_chat(parts) + _chat([{"type": "text", "text": "And this?"},
                                                             {"type": "image"}], "A circle."), [2, 0, 3]),
    }
    messages, which = rows[case]
    got = tokenize_with_images(normalize({"messages": messages, "images": [vlm.names[i] for i in which]},
                                         "messages"), vlm.tok, vlm.expander, vlm.root)
    ref = _reference(vlm, messages, [vlm.pil[i] for i in which])
    np.testing.assert_array_equal(got.ids, ref["input_ids"][0])
    pixels = np.concatenate([p.pixel_values for p in got.images])
    np.testing.assert_array_equal(pixels, ref["pixel_values"][0])
    np.testing.assert_array_equal(np.concatenate([p.pixel_attention_mask for p in got.images]),
                                  ref["pixel_attention_mask"][0])
    frames = [len(p.pixel_values) for p in got.images]
    assert frames == ([3 if i == 3 else 5 for i in which] if vlm.splitting else [1] * len(which))
    image_id = vlm.tok.convert_tokens_to_ids("<image>")
    assert (got.ids == image_id).sum() == IMAGE_SEQ_LEN * sum(frames)


def test_no_image_token_is_trained_and_the_answer_is(vlm):
    row = {"messages": _chat([{"type": "image"}, {"type": "text", "text": QUESTION}]) + [
        {"role": "user", "content": [{"type": "text", "text": "Draw it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Like"}, {"type": "image"},
                                          {"type": "text", "text": " this."}]}], "images": [vlm.names[0], vlm.names[1]]}
    got = tokenize_with_images(normalize(row, "messages"), vlm.tok, vlm.expander, vlm.root)
    assert len(got.image_spans) == 2
    inside = np.zeros(len(got.ids), bool)
    for (s, e), image in zip(got.image_spans, got.images):
        assert vlm.tok.decode(got.ids[s:e], skip_special_tokens=False) == image.text
        inside[s:e] = True
    assert not got.mask[inside].any()
    trained = vlm.tok.decode(got.ids[got.mask], skip_special_tokens=False)
    # The answers with their end-of-turn tokens, the assistant's own image left out.
    assert trained == f" {ANSWER}<end_of_utterance> Like this.<end_of_utterance>"
    # Everything else is untrained: the user turns, headers, and the image in the user turn.
    first_image = got.image_spans[0]
    assert not got.mask[:first_image[1]].any()


def test_inspect_shows_each_image_as_one_untrained_marker(vlm):
    row = {"messages": _chat(QUESTION), "images": [vlm.names[0]]}
    got = tokenize_with_images(normalize(row, "messages"), vlm.tok, vlm.expander, vlm.root)
    (s, e), = got.image_spans
    shown = render_mask(got.ids, got.mask, vlm.tok, color=False, images=got.image_spans)
    n = len(vlm.tok(got.images[0].text, add_special_tokens=False)["input_ids"])
    assert e - s == n
    assert shown == f"<|im_start|>User:⟨image 1: {n} tokens⟩{QUESTION}<end_of_utterance>\nAssistant:[[ {ANSWER}<end_of_utterance>]]\n"


@pytest.mark.parametrize("messages, n_images", [
    (_chat(QUESTION), 2),
    ([{"role": "system", "content": "Be brief."}] + _chat(QUESTION) + _chat("More?", "No."), 1),
    # The first user turn already has parts: TRL puts the images in the next user turn with a string content.
    (_chat([{"type": "text", "text": QUESTION}]) + _chat("More?", "No."), 1),
    (_chat([{"type": "image"}, {"type": "text", "text": QUESTION}]), 1),
])
def test_image_parts_go_where_trl_puts_them(messages, n_images):
    from trl.data_utils import prepare_multimodal_messages

    images = [f"i{k}.png" for k in range(n_images)]
    got = normalize({"messages": messages, "images": images}, "messages")
    ref = prepare_multimodal_messages(messages, images)
    bare = [{**m, "content": [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})}
                              for p in m["content"]]} for m in ref]
    assert got.messages == bare and got.images == tuple(images)


def test_inline_images_keep_their_place_and_one_image_column():
    row = {"messages": _chat([{"type": "image", "image": "inline.png"}, {"type": "text", "text": QUESTION},
                              {"type": "image"}]), "images": ["column.png"]}
    assert normalize(row, "messages").images == ("inline.png", "column.png")
    one = normalize({"messages": _chat(QUESTION), "image": "only.png"}, "messages")
    assert one.images == ("only.png",) and one.messages[0]["content"][0] == {"type": "image"}
    renamed = normalize({"messages": _chat(QUESTION), "pictures": ["a.png"], "images": None}, "messages",
                        image_column="pictures")
    assert renamed.images == ("a.png",)


def test_text_tasks_refuse_rows_with_images(vlm):
    example = normalize({"messages": _chat(QUESTION), "images": [vlm.names[0]]}, "messages")
    with pytest.raises(BadRow, match=r"it has 1 image\(s\), and this task trains on text only"):
        tokenize_example(example, vlm.tok)
    parts = normalize({"messages": _chat([{"type": "text", "text": QUESTION}])}, "messages")
    with pytest.raises(BadRow, match=r"message 0 \(user\) content is a list of parts, and this task trains on text"):
        tokenize_example(parts, vlm.tok)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(path):
    from zoo.data.files import indexed_rows, load_dataset_rows

    ds, _ = load_dataset_rows(path)
    return indexed_rows(ds)


def test_bad_images_are_one_line_naming_the_file_and_line(vlm):
    (vlm.root / "broken.png").write_bytes(b"not a png at all")
    path = _write(vlm.root / "bad.jsonl", [
        {"messages": _chat(QUESTION), "images": [vlm.names[0]]},
        {"messages": _chat(QUESTION), "images": ["missing.png"]},
        {"messages": _chat(QUESTION), "images": [vlm.names[1], "broken.png"]},
    ])
    for line, why in [(2, r"images\[0\] 'missing\.png' not found \(looked for .*missing\.png\); image paths are "
                          r"relative to the data file's folder"),
                      (3, r"images\[1\] 'broken\.png' is not an image Pillow can read \(UnidentifiedImageError")]:
        rows = [(i, r) for i, r in _rows(path) if i in (0, line - 1)]
        with pytest.raises(UserError) as e:
            tokenize_image_rows(rows, "messages", vlm.tok, vlm.expander, path, skip_bad_rows=False)
        assert "\n" not in str(e.value)
        assert e.match(rf"^{re.escape(path)}, line {line}: {why}.*; fix the row or set data.skip_bad_rows: true$")
    out, skipped = tokenize_image_rows(_rows(path), "messages", vlm.tok, vlm.expander, path, skip_bad_rows=True)
    assert list(out) == [0] and skipped == 2


def test_image_bytes_are_read_and_bad_bytes_are_named(vlm):
    good = {"bytes": (vlm.root / vlm.names[0]).read_bytes(), "path": "x.png"}
    ok = tokenize_with_images(normalize({"messages": _chat(QUESTION), "images": [good]}, "messages"),
                              vlm.tok, vlm.expander, vlm.root)
    by_path = tokenize_with_images(normalize({"messages": _chat(QUESTION), "images": [vlm.names[0]]}, "messages"),
                                   vlm.tok, vlm.expander, vlm.root)
    np.testing.assert_array_equal(ok.images[0].pixel_values, by_path.images[0].pixel_values)
    with pytest.raises(BadRow, match=r"^images\[0\] \(bytes of 'x\.png'\) is not an image Pillow can read"):
        tokenize_with_images(normalize({"messages": _chat(QUESTION), "images": [{"bytes": b"\x89PNG", "path": "x.png"}]},
                                       "messages"), vlm.tok, vlm.expander, vlm.root)


def test_image_count_mismatch_is_trls_error_with_the_row(vlm):
    answer = [{"type": "text", "text": ANSWER}]  # parts in every turn: a JSON column has one type
    image, question = {"type": "image", "text": None}, {"type": "text", "text": QUESTION}
    path = _write(vlm.root / "count.jsonl", [
        {"messages": _chat([image, question], answer), "images": [vlm.names[0]]},
        {"messages": _chat([image, image, question], answer), "images": [vlm.names[0]]},
    ])
    with pytest.raises(UserError) as e:
        tokenize_image_rows(_rows(path), "messages", vlm.tok, vlm.expander, path, skip_bad_rows=False)
    assert str(e.value) == (f"{path}, line 2: Number of images provided (1) does not match number of image "
                            "placeholders (2); fix the row or set data.skip_bad_rows: true")


def test_expander_reads_the_model_config_and_names_what_is_missing(vlm, tmp_path):
    import shutil

    folder = shutil.copytree(vlm.root / "model", tmp_path / "model")
    (folder / "processor_config.json").unlink()
    with pytest.raises(UserError, match=r"cannot tell how many tokens an image takes: no image_seq_len"):
        ImageExpander.from_folder(folder, vlm.tok)
    # Without the processor's image_seq_len, the model config's (28 / 7)² / 2² gives it.
    (folder / "config.json").write_text(json.dumps({"scale_factor": 2, "vision_config": {"image_size": 28,
                                                                                       "patch_size": 7}}))
    image = vlm.pil[3]
    assert ImageExpander.from_folder(folder, vlm.tok).process(image).text == vlm.expander.process(image).text
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]")),
                                    unk_token="[UNK]")
    with pytest.raises(UserError, match=r"the tokenizer has no <fake_token_around_image>, <image>, <global-img> "
                                        r"token; use the model's own tokenizer"):
        ImageExpander.from_folder(folder, words)


def test_prompt_completion_rows_train_the_completion_only(vlm):
    prompt = [{"role": "user", "content": QUESTION}]
    completion = [{"role": "assistant", "content": ANSWER}]
    row = {"prompt": prompt, "completion": completion, "images": [vlm.names[2]]}
    got = tokenize_with_images(normalize(row, "prompt_completion"), vlm.tok, vlm.expander, vlm.root)
    np.testing.assert_array_equal(got.ids, _reference(vlm, prompt + completion, [vlm.pil[2]])["input_ids"][0])
    assert vlm.tok.decode(got.ids[got.mask], skip_special_tokens=False) == f" {ANSWER}<end_of_utterance>"
