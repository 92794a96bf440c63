"""Tokenizer of an engine directory (tokenizer.json, the `tokenizers` library; no hub access).

Part of the contract layer: the builder copies the checkpoint's tokenizer into the engine
directory and checks it loads, calibration encodes its prompts with it, the runtime serves with it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path, bos_token_id: int | None, eos_token_ids: tuple[int, ...]):
        self._tok = _HFTokenizer.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"prompt must be str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decoder(self, ids: list[int] | None = None) -> "TextDecoder":
        """An incremental decoder of one growing output (``TextDecoder``) over ``ids``."""
        return TextDecoder(self, ids)


UNDECODED = "\ufffd"  # what decode() shows for a byte sequence the next token may complete


class TextDecoder:
    """The text of a growing token sequence at O(new tokens) per token, where ``decode`` of the whole
    sequence at every token costs O(length) (3 ms per token at a 32K-token output on the 2-core
    machine): vLLM's incremental detokenisation. Only a short window is decoded, from the last point
    where the text was complete: ``committed`` is final (it never ends in an incomplete UTF-8
    sequence), ``tail`` is the window's text past it (non-empty only while bytes are incomplete:
    ends in U+FFFD), and ``committed + tail`` equals ``decode(ids)`` for byte-level BPE tokenizers
    (DeepSeek's, GLM's, the tiny model's; tests/test_detokenize.py checks it)."""

    def __init__(self, tokenizer: Tokenizer, ids: list[int] | None = None):
        self._tok = tokenizer
        self.ids = [] if ids is None else ids  # the output's token list, appended to by add() only
        self._prefix = self._read = 0  # window ids[_prefix:]; ids[_prefix:_read] already committed
        self.committed = ""
        self.tail = ""

    def add(self, token: int) -> str:
        """Append one token; returns the text it committed ("" while its bytes are incomplete)."""
        self.ids.append(token)
        done = self._tok.decode(self.ids[self._prefix : self._read])
        window = self._tok.decode(self.ids[self._prefix :])
        if len(window) > len(done) and not window.endswith(UNDECODED):
            new = window[len(done) :]
            self._prefix, self._read = self._read, len(self.ids)
            self.committed += new
            self.tail = ""
            return new
        self.tail = window[len(done) :]
        return ""

    @property
    def text(self) -> str:
        return self.committed + self.tail
