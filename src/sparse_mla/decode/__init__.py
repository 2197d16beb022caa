"""One DSA decode step end to end: a plan sized once (eager or one CUDA graph) and its
plain-PyTorch reference."""

from .naive import decode_step_reference, sparse_attention_torch
from .plan import STAGES, DecodeInputs, DecodePlan, DecodePlanConfig, DecodeStepOutput
from .v4_naive import V4Compressor, V4StepInputs, V4StepResult, v4_decode_step_reference
from .v4_plan import V4_STAGES, V4DecodePlan, V4DecodePlanConfig, V4StepOutput, v4_stages

__all__ = [
    "STAGES",
    "V4_STAGES",
    "DecodeInputs",
    "DecodePlan",
    "DecodePlanConfig",
    "DecodeStepOutput",
    "V4Compressor",
    "V4DecodePlan",
    "V4DecodePlanConfig",
    "V4StepInputs",
    "V4StepOutput",
    "V4StepResult",
    "decode_step_reference",
    "sparse_attention_torch",
    "v4_decode_step_reference",
    "v4_stages",
]
