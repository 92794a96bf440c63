"""The per-step inputs of every engine; defined in the contract layer (dsa_trt/step.py)."""

from dsa_trt.step import StepInputs

__all__ = ["StepInputs"]
