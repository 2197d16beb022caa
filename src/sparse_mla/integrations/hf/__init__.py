"""Hugging Face transformers' DeepSeek models through sparse-mla (extra ``hf``).

:func:`enable` is the one entry: it looks at the model's attention layers and routes them
through the library's decode step,

* ``DeepseekV32ForCausalLM`` (DSA: MLA with the lightning indexer) -- :mod:`.v32`, on
  :class:`sparse_mla.decode.DecodePlan`;
* ``DeepseekV4ForCausalLM`` (sliding-window, CSA and HCA layers) -- :mod:`.v4`, on
  :class:`sparse_mla.decode.V4DecodePlan`;

``generate()`` and the rest of the model (MoE, mHC, norms) stay HF's. :func:`disable` undoes
it. ``tiny_config`` / ``random_model`` here are V3.2's (V4's: ``hf.v4.tiny_config``,
``hf.v4.random_model``).
"""

from __future__ import annotations

from typing import Any

import torch

from . import v4, v32
from ._common import TRANSFORMERS, check_version, model_generation, unpatch
from .v32 import LAYER_PARTS, SparseMlaState, check_config, random_model, tiny_config

__all__ = [
    "LAYER_PARTS",
    "TRANSFORMERS",
    "SparseMlaState",
    "check_config",
    "check_transformers",
    "disable",
    "enable",
    "random_model",
    "tiny_config",
    "v4",
    "v32",
]

_MODULES = {"v32": v32, "v4": v4}


def enable(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Route the DeepSeek attention layers of ``model`` through sparse-mla; returns ``model``.

    A model holding ``DeepseekV32Attention`` layers goes to :func:`.v32.enable`, one holding
    ``DeepseekV4Attention`` layers to :func:`.v4.enable` (their docstrings list ``options``
    and what they check).

    Raises:
        TypeError: ``model`` holds neither (the message names what it is); or as the
            model's own ``enable``.
        RuntimeError, ValueError: as the model's own ``enable``.
    """
    return _MODULES[model_generation(model)].enable(model, **options)


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable` (HF's own attention again); returns ``model``."""
    unpatch(model)
    return model


def check_transformers(model: str = "v32") -> None:
    """Raise RuntimeError unless the installed transformers is one this package was written
    for (:data:`TRANSFORMERS`) and its ``model`` ("v32" or "v4") takes ``cache=`` and has
    the parts the integration reads; warn when transformers is newer than the tested range."""
    check_version(stacklevel=3)
    _MODULES[model].check_features()
