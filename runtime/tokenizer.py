"""The engine directory's tokenizer; defined in the contract layer (dsa_trt/tokenizer.py)."""

from dsa_trt.tokenizer import UNDECODED, TextDecoder, Tokenizer

__all__ = ["UNDECODED", "TextDecoder", "Tokenizer"]
