"""One DSA decode step end to end: a plan sized once (eager or one CUDA graph) and its
plain-PyTorch reference."""

from .naive import decode_step_reference, sparse_attention_torch
from .plan import STAGES, DecodeInputs, DecodePlan, DecodePlanConfig, DecodeStepOutput

__all__ = [
    "STAGES",
    "DecodeInputs",
    "DecodePlan",
    "DecodePlanConfig",
    "DecodeStepOutput",
    "decode_step_reference",
    "sparse_attention_torch",
]
