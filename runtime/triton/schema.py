"""The request schema of the Triton model: TensorRT-LLM's (tensorrt_llm_bls / ensemble) names and types.

Every input is a tensor of one element per request (batch dimension 1), or, for the HTTP
``generate`` endpoints, a JSON field of the same name. JSON fields that are not model inputs reach
the model as request parameters: a parameter with a schema name is read like the input (the
``"parameters": {...}`` form), any other name is refused. Pure Python and numpy: tested without
Triton; model.py feeds it ``pb_utils`` tensors as numpy arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dsa_trt.runtime.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 16
INT64_MAX = 2**63 - 1


class RequestError(ValueError):
    """A bad request; the message names the field and the problem (sent back as the error response)."""


@dataclass(frozen=True)
class Field:
    name: str
    data_type: str  # Triton config type
    dims: tuple[int, ...] = (1,)
    optional: bool = True
    doc: str = ""


# Same names as TensorRT-LLM's tensorrt_llm_bls config, plus `seed` (what Triton's OpenAI frontend
# sends to TRT-LLM models) and the two token-count flags of the frontend. Integer fields are INT64,
# not TRT-LLM's INT32: Triton's HTTP generate endpoint narrows a JSON integer to the declared type
# by wrapping (4294967300 -> 4, 2**31 -> -2**31) before the model sees it, so only a 64-bit input
# lets the model range-check what the client sent. gRPC clients send INT64 tensors for them.
INPUTS: tuple[Field, ...] = (
    Field("text_input", "TYPE_STRING", optional=False, doc="the prompt, UTF-8"),
    Field("max_tokens", "TYPE_INT64", doc=f"tokens to generate, >= 1 (default {DEFAULT_MAX_TOKENS})"),
    Field("stream", "TYPE_BOOL", doc="one response per step (default false: one response)"),
    Field("temperature", "TYPE_FP32", doc=">= 0, 0 = greedy (default 1)"),
    Field("top_k", "TYPE_INT64", doc=">= 0, 0 = off"),
    Field("top_p", "TYPE_FP32", doc="in (0, 1], 1 = off"),
    Field("random_seed", "TYPE_UINT64", doc="per-request sampling seed (TRT-LLM name)"),
    Field("seed", "TYPE_UINT64", doc="alias of random_seed (Triton OpenAI frontend name)"),
    Field("stop_words", "TYPE_STRING", (-1,), doc="stop strings, one per element (not comma-split)"),
    Field("bad_words", "TYPE_STRING", (-1,), doc="refused when non-empty: no banned-token mask"),
    Field("end_id", "TYPE_INT64", doc="stop token replacing the model's EOS"),
    Field("pad_id", "TYPE_INT64", doc="accepted, unused: outputs are never padded"),
    Field("repetition_penalty", "TYPE_FP32", doc="> 0, 1 = off"),
    Field("presence_penalty", "TYPE_FP32", doc="in [-2, 2], 0 = off"),
    Field("frequency_penalty", "TYPE_FP32", doc="in [-2, 2], 0 = off"),
    Field("beam_width", "TYPE_INT64", doc="must be 1 (no beam search)"),
    Field("return_log_probs", "TYPE_BOOL", doc="must be false (log probabilities are not returned)"),
    Field("exclude_input_in_output", "TYPE_BOOL", doc="default true; false: text_output starts with the prompt"),
    Field("return_num_input_tokens", "TYPE_BOOL", doc="add num_input_tokens to the responses"),
    Field("return_num_output_tokens", "TYPE_BOOL", doc="add num_output_tokens (per response when streaming)"),
)
OUTPUTS: tuple[Field, ...] = (
    Field("text_output", "TYPE_STRING", (-1,), doc="generated text (streaming: this response's piece)"),
    Field("num_input_tokens", "TYPE_INT32", doc="prompt tokens, BOS included"),
    Field("num_output_tokens", "TYPE_INT32", doc="tokens in this response (streaming) or in all"),
    Field("finish_reason", "TYPE_STRING", doc="stop | length | cancelled | error on the last response; "
          "empty on the streamed pieces before it"),
)
INPUT_NAMES = frozenset(f.name for f in INPUTS)
_TYPES = {f.name: f.data_type for f in INPUTS}


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = True
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def parse_request(tensors: dict[str, np.ndarray], parameters: dict | None = None, vocab_size: int | None = None,
                  default_max_tokens: int = DEFAULT_MAX_TOKENS, max_model_len: int | None = None) -> ParsedRequest:
    """Validate one request's inputs (name -> numpy array) and request parameters; RequestError names
    the first field that is wrong, or every unknown one. Integers are checked as received (64-bit
    inputs, unbounded JSON parameters) before any narrowing."""
    parameters = dict(parameters or {})
    unknown = sorted(set(tensors) - INPUT_NAMES) + sorted(set(parameters) - INPUT_NAMES)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; this model accepts "
                           f"{', '.join(f.name for f in INPUTS)}")
    both = sorted(set(tensors) & set(parameters))
    if both:
        raise RequestError(f"{', '.join(both)} given both as input and as request parameter; give it once")
    values = {name: list(np.asarray(arr).reshape(-1)) for name, arr in tensors.items()}
    values.update({name: list(v) if isinstance(v, (list, tuple)) else [v] for name, v in parameters.items()})

    def scalar(name: str, kind: type, default=None):
        if name not in values:
            return default
        vals = values[name]
        if len(vals) != 1:
            raise RequestError(f"{name} has {len(vals)} values; send one request per prompt (batch size 1)")
        return _convert(name, vals[0], kind)

    if "text_input" not in values:
        raise RequestError("text_input is missing: give the prompt as a UTF-8 string")
    prompt = scalar("text_input", str)
    if prompt == "":
        raise RequestError("text_input is empty: give at least one character")
    if scalar("beam_width", int, 1) != 1:
        raise RequestError(f"beam_width={scalar('beam_width', int)}: only 1 is supported (no beam search)")
    if scalar("return_log_probs", bool, False):
        raise RequestError("return_log_probs=true is not supported: this model returns no log probabilities")
    bad_words = [_convert("bad_words", w, str) for w in values.get("bad_words", [])]
    if any(bad_words):
        raise RequestError(f"bad_words {bad_words[:3]!r} is not supported: the sampler has no banned-token "
                           "mask; leave bad_words out")
    seed, alias = scalar("random_seed", int), scalar("seed", int)
    if seed is not None and alias is not None and seed != alias:
        raise RequestError(f"random_seed={seed} and seed={alias} disagree; give one of them")
    end_id = scalar("end_id", int)
    if end_id is not None and not (0 <= end_id < (vocab_size or 2**31)):
        raise RequestError(f"end_id={end_id} is not a token id (vocabulary of {vocab_size})")
    pad_id = scalar("pad_id", int)  # validated, unused
    if pad_id is not None and not (0 <= pad_id < (vocab_size or 2**31)):
        raise RequestError(f"pad_id={pad_id} is not a token id (vocabulary of {vocab_size})")
    max_tokens = scalar("max_tokens", int, default_max_tokens)
    if max_model_len is not None and max_tokens > max_model_len:
        raise RequestError(f"max_tokens={max_tokens} exceeds max_model_len {max_model_len} (prompt and output "
                           "together); lower max_tokens")
    top_k = scalar("top_k", int)
    if top_k is not None and vocab_size is not None and top_k > vocab_size:
        raise RequestError(f"top_k={top_k} exceeds the vocabulary ({vocab_size} tokens); 0 = off")
    stop = [s for s in (_convert("stop_words", w, str) for w in values.get("stop_words", [])) if s]
    sampling = dict(
        temperature=scalar("temperature", float), top_k=top_k, top_p=scalar("top_p", float),
        max_tokens=max_tokens, seed=seed if seed is not None else alias,
        repetition_penalty=scalar("repetition_penalty", float), presence_penalty=scalar("presence_penalty", float),
        frequency_penalty=scalar("frequency_penalty", float),
    )
    kwargs = {k: v for k, v in sampling.items() if v is not None}
    if end_id is not None:  # TRT-LLM: end_id replaces the model's end token
        kwargs.update(stop_token_ids=[end_id], ignore_eos=True)
    try:
        params = SamplingParams(stop=stop, **kwargs)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return ParsedRequest(
        prompt=prompt, params=params, stream=scalar("stream", bool, False),
        exclude_input_in_output=scalar("exclude_input_in_output", bool, True),
        return_num_input_tokens=scalar("return_num_input_tokens", bool, False),
        return_num_output_tokens=scalar("return_num_output_tokens", bool, False),
    )


def _convert(name: str, v, kind: type):
    """One element -> str (strict UTF-8) | int | float | bool, with messages naming the field."""
    if kind is str:
        if isinstance(v, (bytes, np.bytes_)):
            try:
                return bytes(v).decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(f"{name} is not valid UTF-8: byte 0x{bytes(v)[e.start]:02x} at offset {e.start} "
                                   f"({e.reason})") from None
        if isinstance(v, str):
            return v
        raise RequestError(f"{name} must be a string, got {type(v).__name__}")
    if kind is bool:
        if isinstance(v, (bool, np.bool_)):
            return bool(v)
        raise RequestError(f"{name} must be a bool, got {v!r}")
    if isinstance(v, (bool, np.bool_)) or isinstance(v, (str, bytes)):
        raise RequestError(f"{name} must be a number ({_TYPES[name]}), got {v!r}")
    if kind is int:
        if isinstance(v, (float, np.floating)) and not float(v).is_integer():
            raise RequestError(f"{name} must be an integer, got {v!r}")
        if isinstance(v, (float, np.floating)) and not math.isfinite(v):
            raise RequestError(f"{name} must be finite, got {v!r}")
        i = int(v)
        lo = 0 if _TYPES[name] == "TYPE_UINT64" else -INT64_MAX - 1
        hi = 2 * INT64_MAX + 1 if _TYPES[name] == "TYPE_UINT64" else INT64_MAX
        if not lo <= i <= hi:
            raise RequestError(f"{name}={i} is out of range for {_TYPES[name][5:]} [{lo}, {hi}]")
        return i
    f = float(v)
    if not math.isfinite(f):
        raise RequestError(f"{name} must be finite, got {f}")
    return f
