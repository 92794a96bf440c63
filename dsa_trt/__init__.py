"""DSA-TRT: DeepSeek Sparse Attention checkpoints -> compiled per-GPU inference engines.

Subpackages: ``dsa_trt.plugins`` (operators: references, CUDA kernels, TensorRT plugins),
``dsa_trt.export`` (checkpoint -> network -> exported program), ``dsa_trt.calibration``,
``dsa_trt.builder`` (``make engine``) and ``dsa_trt.runtime`` (``LLM(engine_dir).generate``).
This top-level package is the contract layer every other one shares (docs/architecture.md §1):
the model config (``config``), the engine-directory schema (``engine_config``, ``package_check``),
the step inputs (``step``), the cache layout (``cache_layout``) and the tokenizer (``tokenizer``).
It imports nothing else of ours.
"""

__version__ = "0.1.0"
