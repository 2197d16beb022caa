"""One package per capability; each holds the Triton kernels with their host wrappers
(``*.py``) and a readable PyTorch reference (``naive.py``)."""
