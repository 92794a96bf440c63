"""The per-step inputs of every engine; defined in the contract layer (dsa_trt/step.py).

``DeviceIds``: token ids a host step does not hold yet because they are still on the device (the
MTP speculator's greedy drafts, runtime/speculative.py): (indices into the step's input_ids [n]
int64 on the host, the ids [n] int64 on the device). The step carries placeholders there; the
runner writes the ids over them on the device, so the host never waits for them.
"""

import torch

from dsa_trt.step import StepInputs

DeviceIds = tuple[torch.Tensor, torch.Tensor]

__all__ = ["DeviceIds", "StepInputs", "with_device_ids"]


def with_device_ids(inputs: StepInputs, device_ids: DeviceIds | None) -> StepInputs:
    """``inputs`` (already on the device) with ``device_ids`` written over its placeholder tokens."""
    if device_ids is not None:
        rows, ids = device_ids
        dev = inputs.input_ids.device
        inputs.input_ids.index_copy_(0, rows.to(dev, non_blocking=True), ids.to(dev))
    return inputs
