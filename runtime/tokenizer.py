"""The engine directory's tokenizer; defined in the contract layer (dsa_trt/tokenizer.py)."""

from dsa_trt.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
