"""Other projects' models through sparse-mla (optional dependencies, imported on use).

``sparse_mla.integrations.hf``: Hugging Face transformers' DeepSeek-V3.2 and DeepSeek-V4
(extra ``hf``).
"""
