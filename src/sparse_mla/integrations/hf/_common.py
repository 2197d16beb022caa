"""What the DeepSeek-V3.2 and DeepSeek-V4 integrations share: the transformers-version guard,
the checks of a model's layers and of ``enable``'s options, the page pools behind the paged
caches' block tables, and the hook that makes ``generate``'s beam search reorder them."""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable

import torch

from ..._checks import check_int
from ...ops.decode_metadata.expand import MAX_DECODE_LEN

# The transformers releases these modules were written and tested for: 5.24 renamed
# DeepseekV32's and DeepseekV4's ``past_key_values`` keyword to ``cache``.
TRANSFORMERS = (">=5.24", "<5.26")
PAGE_GROUP = 8  # pages are handed out in groups, in reverse order within one (real paging)


def pip_hint() -> str:
    low, high = TRANSFORMERS
    return f"pip install 'transformers{low},{high}'"


def check_version(stacklevel: int = 3) -> None:
    """Raise RuntimeError when transformers is older than :data:`TRANSFORMERS`; warn when it
    is newer than the tested range."""
    import transformers
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = Version(transformers.__version__)
    low, high = TRANSFORMERS
    if not SpecifierSet(low).contains(version, prereleases=True):
        raise RuntimeError(
            f"sparse-mla's HF integration needs transformers {low} (the range it is tested "
            f"with: {low},{high}); got transformers {transformers.__version__}: before 5.24 "
            f"DeepSeek's attention takes past_key_values= and silently drops the cache= "
            f"keyword this integration and its scripts pass (decoding with no history): "
            f"{pip_hint()}"
        )
    if not SpecifierSet(high).contains(version, prereleases=True):
        warnings.warn(
            f"sparse-mla's HF integration is tested with transformers {low},{high}; got "
            f"{transformers.__version__}",
            stacklevel=stacklevel,
        )


def import_modeling(name: str, model: str):
    """``transformers.models.<name>.modeling_<name>``, or RuntimeError naming ``model``."""
    import importlib

    import transformers

    try:
        importlib.import_module(f"transformers.models.{name}")  # the package first, as `from`
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError as e:
        raise RuntimeError(
            f"transformers {transformers.__version__} has no {model} model "
            f"(transformers.models.{name}: {e}); {pip_hint()}"
        ) from e


def missing_cache_keyword(forwards: dict[str, Callable]) -> list[str]:
    """The names of ``forwards`` whose signature has no ``cache`` parameter."""
    return [k for k, f in forwards.items() if "cache" not in inspect.signature(f).parameters]


def raise_missing_features(model: str, missing: list[str]) -> None:
    if missing:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__}'s {model} lacks what sparse-mla's HF "
            f"integration relies on: {', '.join(missing)}; {pip_hint()}"
        )


MODEL_CLASSES = {"v32": "DeepseekV32Attention", "v4": "DeepseekV4Attention"}


def model_generation(model: object) -> str:
    """Which DeepSeek attention layers ``model`` holds, "v32" or "v4" (by class name, so that
    a transformers lacking one model's module still names the other); TypeError when none."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    names = {type(x).__name__ for x in modules}
    for generation, cls in MODEL_CLASSES.items():
        if cls in names:
            return generation
    raise TypeError(
        f"model is not a DeepSeek-V3.2 (DSA) or DeepSeek-V4 model: got {type(model).__name__}, "
        "which holds no DeepseekV32Attention or DeepseekV4Attention layer; enable() takes a "
        "DeepseekV32ForCausalLM / DeepseekV4ForCausalLM, their base model, or any module "
        "holding their attention layers"
    )


def attention_layers(model: object, cls: type) -> list[torch.nn.Module]:
    """``model``'s ``cls`` modules; TypeError (:func:`model_generation`'s) when none."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    layers = [x for x in modules if isinstance(x, cls)]
    if not layers:
        model_generation(model)  # names what the model is not
        raise TypeError(f"model holds no {cls.__name__} layer (got {type(model).__name__})")
    return layers


def has_path(obj: object, dotted: str) -> bool:
    for name in dotted.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def check_layer_parts(layer: object, parts: tuple[str, ...]) -> None:
    """RuntimeError naming the ``parts`` (dotted attribute paths) ``layer`` lacks."""
    missing = [name for name in parts if not has_path(layer, name)]
    if missing:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__}'s {type(layer).__name__} differs from "
            f"the one sparse-mla's HF integration was written for: it has no "
            f"{', '.join(missing)}; {pip_hint()}"
        )


def check_common_options(
    block_size: object, prefill_chunk: object, max_chunk: int = MAX_DECODE_LEN, **flags: object
) -> None:
    """TypeError / ValueError naming the first bad option of ``enable``."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    check_int("block_size", block_size, lo=1, hi=2**20)  # slots are int32: keep pages modest
    check_int("prefill_chunk", prefill_chunk, lo=1, hi=max_chunk)


def patch_forwards(model: torch.nn.Module, cls: type, forward: Callable) -> None:
    """Make ``forward`` the forward of every ``cls`` module of ``model`` (marked for
    :func:`unpatch`)."""
    forward._sparse_mla = True
    for module in model.modules():
        if isinstance(module, cls):
            module.forward = types.MethodType(forward, module)


def unpatch(model: torch.nn.Module) -> None:
    """Undo :func:`patch_forwards` and drop the model's ``sparse_mla`` state."""
    for module in model.modules():
        if "forward" in vars(module) and getattr(module.forward, "_sparse_mla", False):
            del module.forward
    vars(model).pop("sparse_mla", None)


class PagePool:
    """The page ids of one block table: ``pages[b]`` are request b's, in order. Pages are
    handed out in groups of :data:`PAGE_GROUP`, in reverse order within a group, so that
    consecutive pages of a request are not consecutive in memory (as a real pager's)."""

    def __init__(self) -> None:
        self.pages: list[list[int]] = []
        self.count = 0

    def reset(self, batch: int) -> None:
        """Forget every request; ``batch`` new ones with no pages."""
        self.pages = [[] for _ in range(batch)]
        self.count = 0

    def grow(self, per_request: int) -> None:
        """Give every request at least ``per_request`` pages."""
        for pages in self.pages:
            while len(pages) < per_request:
                group, within = divmod(self.count, PAGE_GROUP)
                pages.append(group * PAGE_GROUP + PAGE_GROUP - 1 - within)
                self.count += 1

    def held(self) -> int:
        """Pages a cache must have to hold every page id handed out (whole groups)."""
        return -(-self.count // PAGE_GROUP) * PAGE_GROUP

    def table(self) -> torch.Tensor:
        """int32 ``[B, pages per request]`` (every request holds as many; CPU)."""
        return torch.tensor(self.pages, dtype=torch.int32)

    def copy_requests(self, src: list[int], caches: list[torch.Tensor]) -> None:
        """Request ``i``'s pages of every cache get request ``src[i]``'s contents (beam
        search; every request holds as many pages)."""
        if not self.pages or not self.pages[0]:
            return
        table = torch.tensor(self.pages)
        for cache in caches:
            dst, frm = table.flatten().to(cache.device), table[src].flatten().to(cache.device)
            cache[dst] = cache[frm]  # the gather copies first: sources may be overwritten


def grown_cache(old: torch.Tensor | None, held: int, make: Callable[[int], torch.Tensor]):
    """``old`` when it has ``held`` pages, else a new cache of ``max(held, 2 * old's)`` pages
    from ``make(pages)`` with ``old``'s contents copied in."""
    if old is not None and old.shape[0] >= held:
        return old
    fresh = make(max(held, 2 * old.shape[0] if old is not None else 0))
    if old is not None:
        fresh[: old.shape[0]] = old
    return fresh


def follow_reorders(cache, state) -> None:
    """Make ``cache.reorder_cache`` (what ``generate``'s beam search calls after each step
    when the model has no ``_reorder_cache``) call ``state.reorder`` too."""
    if getattr(cache, "_sparse_mla_state", None) is state:
        return
    original = getattr(cache, "_sparse_mla_original", cache.reorder_cache)

    def reorder_cache(beam_idx: torch.Tensor) -> None:
        original(beam_idx)
        state.reorder(beam_idx)

    cache._sparse_mla_original = original
    cache._sparse_mla_state = state
    cache.reorder_cache = reorder_cache


def beam_sources(beam_idx: torch.Tensor, batch: int) -> list[int] | None:
    """``beam_idx`` as a list (None when it keeps every request where it is)."""
    src = [int(i) for i in beam_idx.tolist()]
    if len(src) != batch:
        raise ValueError(f"beam_idx has {len(src)} entries, the paged caches hold {batch} requests")
    return None if src == list(range(batch)) else src


def count_tokens(cache, layer_idx: int, hidden_states: torch.Tensor) -> int:
    """Tokens the HF cache held before this forward; then counts this forward's in it (one
    scalar per token: its positions and masks stay right, its dense rows are never kept)."""
    if cache is None:
        return 0
    past = cache.get_seq_length(layer_idx)
    batch, seq = hidden_states.shape[:2]
    tick = hidden_states.new_zeros(batch, 1, seq, 1)
    cache.update(tick, tick, layer_idx)
    return past
