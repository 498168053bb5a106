"""Text to token ids and back: the checkpoint's `tokenizer.json` through `tokenizers`, else bytes.

Both tokenizers also decode incrementally (`decoder()`, for streamed output) and render chat
messages into a prompt (`apply_chat_template`): the checkpoint's Jinja template when it has one,
else DeepSeek-V3's conversation format.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Protocol

# DeepSeek-V3's special tokens; the bars are fullwidth (U+FF5C), the "▁" is U+2581.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"  # noqa: RUF001
EOS_TOKEN = "<｜end▁of▁sentence｜>"  # noqa: RUF001
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"  # noqa: RUF001
# the default chat template: each turn's text before and after its content
_TURNS = {"system": ("", ""), "user": (USER, ""), "assistant": (ASSISTANT, EOS_TOKEN)}
ZERO_WIDTH_SPACE = "\u200b"


class IncrementalDecoder(Protocol):
    """Text of ids as they come: `add` holds a character's bytes until it is complete, so all
    `add`s and then `flush` concatenate to `decode` of all the ids."""

    def add(self, ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class _ChatTemplate:
    """`apply_chat_template` for a tokenizer with `chat_template`, `bos_token` and `eos_token`,
    and `escape_special_tokens` for one whose `special_texts` are the texts of its control
    tokens (and of the template's own markers)."""

    chat_template: str | None = None
    bos_token: str | None
    eos_token: str | None
    special_texts: list[str]

    def escape_special_tokens(self, text: str) -> str:
        """`text` with a zero-width space after the first character of each special token's
        text in it: chat content then encodes as the characters it shows, never as a control
        token (it cannot end a turn or forge one)."""
        if self._specials_found is None:
            return text
        return self._specials_found.sub(lambda m: m[0][0] + ZERO_WIDTH_SPACE + m[0][1:], text)

    @cached_property
    def _specials_found(self) -> re.Pattern | None:
        texts = sorted((t for t in self.special_texts if len(t) > 1), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (`{"role": "system"|"user"|"assistant", "content": str}`).

        It starts with the BOS token's text already: encode it with `add_special_tokens=False`.
        Raises ValueError for bad messages and for a template that rejects them.
        """
        if not messages:
            raise ValueError("no messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"message {i} is a {type(message).__name__}, not a dict")
            if message.get("role") not in _TURNS:
                role = message.get("role")
                raise ValueError(f"message {i} has role {role!r}, not system, user or assistant")
            if not isinstance(message.get("content"), str):
                kind = type(message.get("content")).__name__
                raise ValueError(f"message {i} has content of type {kind}, not str")
        if self.chat_template is None:
            turns = [_TURNS[m["role"]][0] + m["content"] + _TURNS[m["role"]][1] for m in messages]
            prompt = ASSISTANT if add_generation_prompt else ""
            return (self.bos_token or "") + "".join(turns) + prompt
        from jinja2 import TemplateError

        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise ValueError(f"chat template: {e}") from e

    @cached_property
    def _compiled(self):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template)
        except TemplateError as e:
            raise ValueError(f"chat template: {e}") from e


class ByteTokenizer(_ChatTemplate):
    """One token per UTF-8 byte: 256 consecutive ids clear of the special tokens' ids."""

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None) -> None:
        specials = [t for t in (bos_token_id, eos_token_id) if t is not None]
        for offset in (0, max(specials, default=-1) + 1):
            if offset + 256 <= vocab_size and not any(offset <= t < offset + 256 for t in specials):
                break
        else:
            raise ValueError(f"no room for 256 byte ids beside {specials} in {vocab_size} ids")
        self.offset = offset
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.bos_token = BOS_TOKEN if bos_token_id is not None else None
        self.eos_token = EOS_TOKEN if eos_token_id is not None else None
        pairs = [(self.bos_token, bos_token_id), (self.eos_token, eos_token_id)]
        self._specials = {text: i for text, i in pairs if text is not None}
        self.special_texts = [*self._specials, USER, ASSISTANT]  # its turn markers are bytes
        alternatives = "|".join(map(re.escape, self._specials))
        self._split = re.compile(f"({alternatives})") if alternatives else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        for piece in self._split.split(text) if self._split else [text]:
            if piece in self._specials:
                ids.append(self._specials[piece])
            else:
                ids += [b + self.offset for b in piece.encode()]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._bytes(ids).decode(errors="replace")

    def decoder(self) -> IncrementalDecoder:
        return _ByteDecoder(self)

    def _bytes(self, ids: list[int]) -> bytes:
        return bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)


class _ByteDecoder:
    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._bytes = tokenizer._bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, ids: list[int]) -> str:
        return self._utf8.decode(self._bytes(ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class HFTokenizer(_ChatTemplate):
    """`tokenizer.json` through `tokenizers`; special tokens, BOS and chat template from the
    checkpoint's `tokenizer_config.json` (`config`), ids from the model's config.json."""

    def __init__(
        self,
        path: Path,
        bos_token_id: int | None,
        eos_token_id: int | None,
        config: dict | None = None,
    ) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        config = config or {}
        self.bos_token_id, self.bos_token = self._special(config.get("bos_token"), bos_token_id)
        self.eos_token_id, self.eos_token = self._special(config.get("eos_token"), eos_token_id)
        self.add_bos_token = (
            bool(config.get("add_bos_token", True)) and self.bos_token_id is not None
        )
        template = config.get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template
        # every added token (encode() matches each, special or not), and the default
        # template's turn markers
        added = [token.content for token in self.tokenizer.get_added_tokens_decoder().values()]
        self.special_texts = [*added, USER, ASSISTANT]

    def _special(
        self, token: str | dict | None, token_id: int | None
    ) -> tuple[int | None, str | None]:
        text = token["content"] if isinstance(token, dict) else token
        if token_id is None and text is not None:
            token_id = self.tokenizer.token_to_id(text)
        if text is None and token_id is not None:
            text = self.tokenizer.id_to_token(token_id)
        return token_id, text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = encoding.ids
        # special_tokens_mask marks what the post-processor added: its BOS is not doubled.
        added_bos = ids[:1] == [self.bos_token_id] and encoding.special_tokens_mask[0] == 1
        if add_special_tokens and self.add_bos_token and not added_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decoder(self) -> IncrementalDecoder:
        return _StreamDecoder(self)


class _StreamDecoder:
    """`DecodeStream` (re-decodes only the ids since its last output) while the text grows; at
    the end, what one full `decode` has beyond that (a trailing incomplete character)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._emitted = 0

    def add(self, ids: list[int]) -> str:
        self._ids += ids
        pieces = [self._stream.step(self._tokenizer.tokenizer, i) for i in ids]
        text = "".join(p for p in pieces if p is not None)
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        return self._tokenizer.decode(self._ids)[self._emitted :]


def load_tokenizer(args, path: str | Path | None = None) -> ByteTokenizer | HFTokenizer:
    """The checkpoint directory's tokenizer.json (with its tokenizer_config.json if there is
    one) if there is one, else a byte tokenizer."""
    if path is not None and (Path(path) / "tokenizer.json").is_file():
        config_path = Path(path) / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else None
        return HFTokenizer(
            Path(path) / "tokenizer.json", args.bos_token_id, args.eos_token_id, config
        )
    return ByteTokenizer(args.vocab_size, args.bos_token_id, args.eos_token_id)
