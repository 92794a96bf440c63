"""DSA-TRT: DeepSeek Sparse Attention checkpoints -> compiled per-GPU inference engines.

Subpackages: ``dsa_trt.plugins`` (operators: references, CUDA kernels, TensorRT plugins),
``dsa_trt.export`` (checkpoint -> network -> exported program), ``dsa_trt.calibration``,
``dsa_trt.builder`` (``make engine``) and ``dsa_trt.runtime`` (``LLM(engine_dir).generate``).
This top-level package holds only the two schemas every layer shares: the model config and the
engine-directory config.
"""

__version__ = "0.1.0"
