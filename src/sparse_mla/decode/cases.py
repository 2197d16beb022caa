"""Old home of the decode-step test cases, kept for one release: they are now
:mod:`sparse_mla.testing.cases` (the testing kit). Import from there."""

from ..testing.cases import (  # noqa: F401
    INDEX_DIM,
    INDEX_HEADS,
    OP_CASE_K,
    StepCase,
    check_random_step,
    clone_inputs,
    compile_cases,
    custom_op_cases,
    op_path_matches_public,
    public_call_cases,
    public_function,
    random_step,
    replay_error,
    step_error,
    tie_band,
)
