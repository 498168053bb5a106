"""Text to token ids: the checkpoint's `tokenizer.json` through `tokenizers`, else bytes."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
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

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode(errors="replace")


class HFTokenizer:
    def __init__(self, path: Path, bos_token_id: int | None, eos_token_id: int | None) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(args, path: str | Path | None = None):
    """The checkpoint directory's tokenizer.json if there is one, else a byte tokenizer."""
    if path is not None and (Path(path) / "tokenizer.json").is_file():
        return HFTokenizer(Path(path) / "tokenizer.json", args.bos_token_id, args.eos_token_id)
    return ByteTokenizer(args.vocab_size, args.bos_token_id, args.eos_token_id)
