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
