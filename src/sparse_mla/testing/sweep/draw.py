"""What every random check shares: the case, draws from its generator, and comparisons."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Case:
    """One configuration of the sweep; ``seed`` alone reproduces its inputs."""

    kind: str  # "remap", "dcp", "expand", "topk", "kvcache", "logits", "attention", "decode_step"
    seed: int
    params: dict = field(hash=False, compare=False)

    def label(self) -> str:
        p = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.kind} seed={self.seed} {p}"


def log_uniform_int(g: torch.Generator, lo: int, hi: int) -> int:
    """An int in [lo, hi], uniform in log scale."""
    u = torch.rand((), generator=g).item()
    return int(round(lo * (hi / lo) ** u))


def rand_int(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (), generator=g))


def rand_choice(g: torch.Generator, options: tuple | list):
    """One of ``options``, uniformly."""
    return options[rand_int(g, 0, len(options) - 1)]


def to_device(dev, *ts):
    """Each tensor of ``ts`` on ``dev`` (other values as they are)."""
    return [t.to(dev) if isinstance(t, torch.Tensor) else t for t in ts]


def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when bit-equal, else what differs first."""
    return None if torch.equal(got, want) else f"{what}: {first_diff(got, want)}"


def first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    """How many elements differ and the first of them."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    where = (got != want).nonzero()
    if len(where) == 0:  # equal values, different bits (NaN, -0.0)
        return "values differ only in NaN/-0.0 bits"
    at = tuple(where[0].tolist())
    return f"{len(where)} mismatches, first at {at}: got {got[at].item()} want {want[at].item()}"
