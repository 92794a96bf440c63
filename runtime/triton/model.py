"""Triton python-backend model: the DSA-TRT runtime behind TensorRT-LLM's request schema.

Copied into ``<repo>/<model>/1/model.py`` by ``write_model_repository``; runs in the python
backend stub (decoupled transaction policy). ``execute`` returns at once: each request becomes a
coroutine on the model's event loop thread that reads its AsyncLLM stream and sends responses, so
requests arriving while others generate join the running batch (continuous batching). A bad
request gets one error response naming the problem; the others are not affected.
"""

import asyncio
import json
import os
import site
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message: str, code_name: str = "INVALID_ARG") -> "pb_utils.InferenceResponse":
    code = getattr(pb_utils.TritonError, code_name, None)
    err = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


class TritonPythonModel:
    def initialize(self, args):
        if int(np.__version__.split(".")[0]) >= 2:  # the numpy triton_python_backend_utils imported
            raise pb_utils.TritonModelException(
                f"numpy {np.__version__} ({np.__file__}): the python backend stub of tritonserver 2.51 is built "
                "with pybind11 2.10, whose tensors break under numpy >= 2 (python_backend#384): run the server "
                "from an environment with numpy<2 (pyproject's pin; the stub takes the venv of the first python3 "
                "on PATH)")
        self.model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in self.model_config.get("parameters", {}).items()}
        for path in params.get("site_packages", "").split(os.pathsep):
            if path and path not in sys.path:
                site.addsitedir(path)  # also runs the .pth files (dsa_trt's editable-install finder)
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("this model streams: set model_transaction_policy { decoupled: true }")

        from dsa_trt.runtime.async_llm import AsyncLLM
        from dsa_trt.runtime.triton import schema

        self.schema = schema
        num_pages = int(params["num_pages"]) if params.get("num_pages") else None
        self.engine = AsyncLLM(params["engine_dir"], num_pages=num_pages, speculative=params.get("speculative") or None)
        self.vocab_size = self.engine.llm.model_config.vocab_size
        self.log = pb_utils.Logger
        llm = self.engine.llm
        advertised = params.get("max_model_len")
        if advertised and int(advertised) != llm.max_model_len:
            self.engine.shutdown()
            raise pb_utils.TritonModelException(
                f"config.pbtxt advertises max_model_len {advertised} but the engine's pool holds {llm.max_model_len} "
                f"({llm.limits}); rewrite the repository with write_model_repository (same num_pages)")
        self.log.log_info(f"dsa_trt: engine {params['engine_dir']} on {llm.device}, cache {llm.tokens_that_fit:,} "
                          f"tokens, max_model_len {llm.max_model_len}")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dsa-trt-responses", daemon=True)
        self.thread.start()

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
        return None

    async def _serve(self, request) -> None:
        sender = request.get_response_sender()
        try:
            parsed = self._parse(request)
        except self.schema.RequestError as e:
            self._send_error(sender, str(e))
            return
        try:
            await self._generate(parsed, request, sender)
        except ValueError as e:  # refused by the runtime (prompt too long for the engine or the cache)
            self._send_error(sender, str(e))
        except Exception as e:  # noqa: BLE001 - an engine failure: this request's error response
            self.log.log_error(f"dsa_trt: request failed: {type(e).__name__}: {e}")
            self._send_error(sender, f"finish_reason=error: {type(e).__name__}: {e}", "INTERNAL")

    def _send_error(self, sender, message: str, code: str = "INVALID_ARG") -> None:
        try:
            sender.send(_error(message, code), flags=FINAL)
        except Exception as e:  # noqa: BLE001 - e.g. the client is gone; nothing else to tell
            self.log.log_warn(f"dsa_trt: could not send the error response ({e}): {message}")

    def _parse(self, request):
        tensors = {t.name(): t.as_numpy() for t in request.inputs()}
        try:
            parameters = json.loads(request.parameters() or "{}")
        except json.JSONDecodeError as e:
            raise self.schema.RequestError(f"request parameters are not JSON: {e}") from None
        return self.schema.parse_request(tensors, parameters, vocab_size=self.vocab_size,
                                         max_model_len=self.engine.llm.max_model_len)

    async def _generate(self, parsed, request, sender) -> None:
        # Never ask a sender anything after its FINAL send: Triton 2.51 frees the response factory
        # then, and is_cancelled() on it crashes the server (TRITONBACKEND_ResponseFactoryIsCancelled).
        handle = self.engine.submit(parsed.prompt, parsed.params)
        prefix = "" if parsed.exclude_input_in_output else parsed.prompt
        text, cancelled = prefix, False
        async for d in handle:
            # Asked every step, streaming or not: a client that hung up stops costing engine steps.
            if not cancelled and self._cancelled(request, sender):
                cancelled = True
                handle.cancel()  # the stream then ends with a "cancelled" delta
            if cancelled:
                continue
            if parsed.stream:
                sender.send(self._response(parsed, prefix + d.text, d.num_prompt_tokens, len(d.token_ids),
                                           d.finish_reason), flags=FINAL if d.finished else 0)
                prefix = ""
            else:
                text += d.text
                if d.finished:
                    sender.send(self._response(parsed, text, d.num_prompt_tokens, d.num_output_tokens,
                                               d.finish_reason), flags=FINAL)
        if cancelled:
            self._send_error(sender, "finish_reason=cancelled: request cancelled", "CANCELLED")

    @staticmethod
    def _cancelled(request, sender) -> bool:
        if sender.is_cancelled():
            return True
        is_cancelled = getattr(request, "is_cancelled", None)  # python backends >= 23.10
        return bool(is_cancelled and is_cancelled())

    def _response(self, parsed, text: str, num_prompt: int, num_output: int, finish_reason: str | None):
        outs = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                pb_utils.Tensor("finish_reason", np.array([[(finish_reason or "").encode()]], dtype=np.object_))]
        if parsed.return_num_input_tokens:
            outs.append(pb_utils.Tensor("num_input_tokens", np.array([[num_prompt]], dtype=np.int32)))
        if parsed.return_num_output_tokens:
            outs.append(pb_utils.Tensor("num_output_tokens", np.array([[num_output]], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=outs)

    def finalize(self):
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
