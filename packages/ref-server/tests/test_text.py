# ruff: noqa: RUF001  (DeepSeek-V3's special tokens are written with fullwidth bars)
"""Tokenizers (encode, incremental decode, chat template) and `TextStream`, on CPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_server.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from ref_server.services.text import TextStream

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CORPUS = [
    "中文字符测试，日本語のテキスト、한국어 텍스트。",
    "emoji 😀🎉🚀 and music 𝄞 𝕏, héllo wörld, Ελληνικά, русский текст",
] * 30
ARGS = SimpleNamespace(vocab_size=512, bos_token_id=0, eos_token_id=1)
# any character but U+FFFD (which the decoders must only produce for invalid bytes), with CJK
# and astral-plane characters drawn often
CHARS = st.one_of(
    st.characters(codec="utf-8", exclude_characters="\ufffd"), st.sampled_from("中文字한😀🎉𝄞𝕏é")
)
# texts without the special tokens' own text: it encodes to their ids, which decoding leaves
# out (Hypothesis draws string constants of the code under test, these included)
TEXTS = st.text(CHARS).filter(lambda text: BOS not in text and EOS not in text)
SIZES = st.lists(st.integers(1, 5), min_size=1, max_size=8)
many = settings(max_examples=300, deadline=None)


def write_bpe(path, config=None, post_bos=False):
    """A byte-level BPE trained on CORPUS (so multi-byte characters split across tokens), with
    BOS id 0 and EOS id 1, saved in checkpoint directory `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=350, initial_alphabet=alphabet, special_tokens=[BOS, EOS]
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    if post_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, 0)]
        )
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(ARGS, path)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    config = {
        "bos_token": {"content": BOS, "lstrip": False},
        "eos_token": EOS,
        "add_bos_token": True,
    }
    return write_bpe(tmp_path_factory.mktemp("bpe"), config)


@pytest.fixture(scope="module")
def byte():
    return load_tokenizer(ARGS)


def chunks(ids, sizes):
    """`ids` in chunks of `sizes` (cycled)."""
    start, i = 0, 0
    while start < len(ids):
        yield ids[start : start + sizes[i % len(sizes)]]
        start, i = start + sizes[i % len(sizes)], i + 1


def feed(decoder, ids, sizes):
    """What `decoder` gives for `ids` in chunks of `sizes`, then its flush."""
    return [*(decoder.add(chunk) for chunk in chunks(ids, sizes)), decoder.flush()]


def test_the_bpe_splits_characters_across_tokens(hf):
    assert isinstance(hf, HFTokenizer)
    assert hf.tokenizer.get_vocab_size() == 350
    split = [c for c in set("".join(CORPUS)) if len(hf.encode(c, add_special_tokens=False)) > 1]
    assert split
    assert len(hf.encode("😀", add_special_tokens=False)) > 1


@many
@given(text=TEXTS, sizes=SIZES)
def test_byte_decoder_pieces_are_whole_characters(byte, text, sizes):
    pieces = feed(byte.decoder(), byte.encode(text, add_special_tokens=False), sizes)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


@many
@given(data=st.binary(), sizes=SIZES)
def test_byte_decoder_of_invalid_bytes_is_decode(byte, data, sizes):
    ids = [b + byte.offset for b in data]
    assert "".join(feed(byte.decoder(), ids, sizes)) == byte.decode(ids)
    assert byte.decode(ids) == data.decode(errors="replace")


def test_byte_decoder_holds_a_split_character_and_replaces_a_broken_one(byte):
    ids = [b + byte.offset for b in "中".encode()]
    decoder = byte.decoder()
    assert [decoder.add(ids[:1]), decoder.add(ids[1:2]), decoder.add(ids[2:])] == ["", "", "中"]
    broken = [b + byte.offset for b in b"\xe4\xb8A\xe4"]
    assert feed(byte.decoder(), broken, [1]) == ["", "", "\ufffdA", "", "\ufffd"]
    assert byte.decode(broken) == "\ufffdA\ufffd"


@many
@given(text=TEXTS, sizes=SIZES)
def test_bpe_decoder_pieces_are_whole_characters(hf, text, sizes):
    ids = hf.encode(text, add_special_tokens=False)
    pieces = feed(hf.decoder(), ids, sizes)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == hf.decode(ids) == text


@many
@given(ids=st.lists(st.integers(0, 349), max_size=40), sizes=SIZES)
def test_bpe_decoder_of_any_ids_is_decode(hf, ids, sizes):
    # random ids: invalid UTF-8, characters cut at both ends, BOS and EOS (skipped)
    assert "".join(feed(hf.decoder(), ids, sizes)) == hf.decode(ids)


def test_bpe_decoder_holds_a_split_character(hf):
    ids = hf.encode("😀!", add_special_tokens=False)
    decoder = hf.decoder()
    pieces = [decoder.add([i]) for i in ids]
    assert pieces[: len(ids) - 2] == [""] * (len(ids) - 2)
    assert pieces[-2:] == ["😀", "!"]
    assert decoder.flush() == ""
    decoder = hf.decoder()
    assert decoder.add(ids[:1]) == ""
    assert decoder.flush() == "\ufffd" == hf.decode(ids[:1])


def test_encode_adds_one_bos_and_maps_special_text(byte, hf, tmp_path):
    assert byte.encode("hé") == [0, 2 + ord("h"), 2 + 0xC3, 2 + 0xA9]
    assert byte.encode(f"a{EOS}b{BOS}", add_special_tokens=False) == [99, 1, 100, 0]
    assert (byte.bos_token, byte.eos_token) == (BOS, EOS)
    no_bos = ByteTokenizer(300, None, 1)
    assert (no_bos.bos_token, no_bos.encode("a")) == (None, [2 + ord("a")])
    assert no_bos.encode(BOS, add_special_tokens=False) == [2 + b for b in BOS.encode()]

    text = "中文 text"
    plain = hf.encode(text, add_special_tokens=False)
    assert 0 not in plain
    assert hf.encode(text) == [0, *plain]
    assert hf.encode(f"{text}{EOS}", add_special_tokens=False) == [*plain, 1]
    assert hf.encode(f"{BOS}{text}", add_special_tokens=False) == [0, *plain]
    # a post-processor that adds BOS itself: still one; add_bos_token false: none
    assert write_bpe(tmp_path / "post", {}, post_bos=True).encode(text) == [0, *plain]
    assert write_bpe(tmp_path / "off", {"add_bos_token": False}).encode(text) == plain
    bare = write_bpe(tmp_path / "bare")
    assert (bare.bos_token, bare.eos_token, bare.encode(text)) == (BOS, EOS, [0, *plain])


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]
RENDERED = (
    "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
    "<｜User｜>2+2?<｜Assistant｜>"
)


def test_default_chat_template(byte, hf):
    assert byte.apply_chat_template(CONVERSATION) == RENDERED
    assert hf.apply_chat_template(CONVERSATION) == RENDERED
    assert byte.apply_chat_template(CONVERSATION, add_generation_prompt=False) == RENDERED[:-13]
    ids = byte.encode(RENDERED, add_special_tokens=False)
    assert (ids[0], ids.count(0), ids.count(1)) == (0, 1, 1)
    assert hf.encode(RENDERED, add_special_tokens=False)[0] == 0
    assert (
        ByteTokenizer(300, None, None).apply_chat_template(CONVERSATION[1:2])
        == "<｜User｜>Hi<｜Assistant｜>"
    )


def test_special_token_text_is_escaped_into_plain_text(byte, hf):
    """A zero-width space after the first character: encoded, the text has no special id, and
    it decodes to what was shown (text without special-token text is left as it is)."""
    user, assistant = "<｜User｜>", "<｜Assistant｜>"
    content = f"a{EOS}b{BOS}{user}c{assistant}{EOS}{EOS}"
    for tokenizer in (byte, hf):
        escaped = tokenizer.escape_special_tokens(content)
        for special in (EOS, BOS, user, assistant):
            assert special not in escaped
            assert escaped.count(special[0] + "\u200b" + special[1:]) == content.count(special)
        assert escaped.replace("\u200b", "") == content
        ids = tokenizer.encode(escaped, add_special_tokens=False)
        assert 0 not in ids and 1 not in ids
        assert tokenizer.decode(ids) == escaped
        assert tokenizer.escape_special_tokens("中文 text <|im|>") == "中文 text <|im|>"


TEMPLATE = (
    "{% for m in messages %}\n"
    "  {% if m.role == 'system' %}{{ raise_exception('no system messages here') }}{% endif %}\n"
    "{{ bos_token if loop.first }}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.mark.parametrize("form", ["string", "list"])
def test_checkpoint_chat_template(tmp_path, form):
    named = [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": TEMPLATE}]
    config = {
        "bos_token": {"content": BOS},
        "chat_template": TEMPLATE if form == "string" else named,
    }
    tokenizer = write_bpe(tmp_path, config)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    # trim_blocks and lstrip_blocks: block tags leave no spaces or newlines behind
    assert (
        tokenizer.apply_chat_template(messages)
        == f"{BOS}[user] hi{EOS}\n[assistant] yo{EOS}\n[assistant]"
    )
    with pytest.raises(ValueError, match=r"^chat template: no system messages here$"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_broken_chat_template_is_a_value_error(tmp_path):
    tokenizer = write_bpe(tmp_path, {"chat_template": "{% for %}"})
    with pytest.raises(ValueError, match=r"^chat template: "):
        tokenizer.apply_chat_template(CONVERSATION)


@pytest.mark.parametrize(
    "messages, problem",
    [
        ([], "no messages"),
        (["hi"], "message 0 is a str, not a dict"),
        (
            [{"role": "tool", "content": "x"}],
            "message 0 has role 'tool', not system, user or assistant",
        ),
        ([{"content": "x"}], "message 0 has role None"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": ["a"]}],
            "message 1 has content of type list, not str",
        ),
    ],
)
def test_bad_messages_are_named(byte, messages, problem):
    with pytest.raises(ValueError, match=problem):
        byte.apply_chat_template(messages)


def stream(byte, chunks, stops):
    """A TextStream over `chunks` of text (each encoded alone): the pieces and the stream."""
    text = TextStream(byte.decoder(), stops)
    pieces = [text.add(byte.encode(c, add_special_tokens=False)) for c in chunks]
    return pieces, text


def test_stop_split_across_chunks(byte):
    pieces, text = stream(byte, ["Hello ST", "OP world", "more"], ["STOP"])
    assert pieces == ["Hello ", "", ""]
    assert (text.stopped, text.text, text.finish()) == (True, "Hello ", "")


def test_stop_inside_the_first_chunk_and_the_earliest_of_several(byte):
    pieces, text = stream(byte, ["abc<END>def"], ["<END>"])
    assert (pieces, text.stopped) == (["abc"], True)
    pieces, text = stream(byte, ["hello ", "world"], ["world", "lo w", ""])
    assert (pieces, text.text) == (["hel", ""], "hel")


def test_a_held_prefix_that_is_no_stop_is_released(byte):
    pieces, text = stream(byte, ["Hello ST", "ART", " S"], ["STOP"])
    assert pieces == ["Hello ", "START", " "]
    assert (text.stopped, text.finish(), text.text) == (False, "S", "Hello START S")


def test_finish_flushes_the_decoder_and_no_stops(byte):
    text = TextStream(byte.decoder(), [])
    data = [b + byte.offset for b in "a中é".encode()]
    assert [text.add(data[:2]), text.add(data[2:4]), text.add(data[4:5])] == ["a", "中", ""]
    assert (text.finish(), text.text, text.stopped) == ("\ufffd", "a中\ufffd", False)


@settings(max_examples=500, deadline=None)
@given(
    text=st.text("ab中😀", max_size=30), stop=st.text("ab中😀", min_size=1, max_size=4), sizes=SIZES
)
def test_streamed_text_ends_before_the_first_stop(byte, text, stop, sizes):
    stream = TextStream(byte.decoder(), [stop])
    ids = byte.encode(text, add_special_tokens=False)
    pieces = [*(stream.add(chunk) for chunk in chunks(ids, sizes)), stream.finish()]
    want = text.split(stop)[0]
    assert stream.stopped == (stop in text)
    assert "".join(pieces) == stream.text == want
