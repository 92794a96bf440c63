"""Triton Inference Server deployment: model repository, request schema, server launcher.

model.py is not imported here: it runs inside the python backend stub (it imports
triton_python_backend_utils) and is copied into the repository by write_model_repository.
"""

from .repository import ModelRepository, write_model_repository
from .schema import INPUTS, OUTPUTS, RequestError, parse_request
from .server import TritonServer, free_ports

__all__ = ["INPUTS", "OUTPUTS", "ModelRepository", "RequestError", "TritonServer", "free_ports", "parse_request",
           "write_model_repository"]
