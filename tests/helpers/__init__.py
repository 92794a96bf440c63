"""What the tests share and is not a test: independent references (ref_dsa_ops, ref_sparse_mla), the
GPU engine's teacher-forced checks (engine_checks) and the CPU model of the fp8 sparse MLA kernel
(model_sparse_mla_fp8, a script: ``.venv/bin/python -m tests.helpers.model_sparse_mla_fp8``)."""
