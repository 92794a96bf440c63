"""GPU reference path for tests/test_gpu_engine.py, run in its own process: the eager network on CUDA
driven by the same runtime, with our CUDA kernels (DSA_KERNELS=cuda) or the plain-torch operators
(DSA_KERNELS=reference).

    DSA_KERNELS=reference python tests/gpu_reference_generate.py CKPT ENGINE_DIR MAX_TOKENS OUT.json PROMPT...
"""

import json
import sys

import torch

from dsa_trt.engine_config import EngineConfig
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network
from dsa_trt.plugins import cuda_ops
from dsa_trt.runtime.engine import eager_engine
from dsa_trt.runtime.llm import LLM
from dsa_trt.runtime.sampling import SamplingParams


def main() -> None:
    ckpt_dir, engine_dir, max_tokens, out, *prompts = sys.argv[1:]
    cuda_ops.load()  # DSA_KERNELS=cuda: our kernels serve the ops; =reference: the plain-torch ones
    cfg = EngineConfig.load(engine_dir)
    ckpt = Checkpoint(ckpt_dir)
    dtype = getattr(torch, cfg.dtype)
    nets = [build_network(ckpt, cfg.cache_mode, dtype, cfg.kv_scales, dense_prefill=d, device="cuda") for d in (0, 1)]
    engine = eager_engine(nets[0], nets[1], cfg, torch.device("cuda"), ckpt.tokenizer_path)
    llm = LLM(engine, num_pages=64)
    llm.graphs = None  # plain eager reference
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True))
    with open(out, "w") as f:
        json.dump([o.token_ids for o in outs], f)


if __name__ == "__main__":
    main()
