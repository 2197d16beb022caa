"""The top-k op's input generator: adversarial score rows, shared by ``tests/ops/test_topk.py``,
``sparse-mla verify`` and ``benchmarks/gpu_topk.py`` (one name per distribution)."""

from __future__ import annotations

import torch

#: Every distribution :func:`topk_scores` draws, by name.
TOPK_SCORE_KINDS = (
    "normal",  # N(0, 1) times 10^[-3, 3]
    "all_equal",  # one random value everywhere
    "ties_at_threshold",  # few distinct values, or a large share equal to the k-th largest
    "two_valued",
    "integer_valued",
    "relu_zeros",  # most scores exactly +0 / -0, as after a relu sum
    "neg_inf_runs",  # runs of -inf (row 0: its first half and a run past it)
    "all_neg_inf",
    "nan_mix",  # NaN, -inf and +inf among numbers (row 0 NaN only, row 1 NaN but its tail)
    "nan_payloads",  # NaNs of every payload and sign, half -inf
    "huge_tiny",  # denormal to overflow magnitudes, and a pool of extreme values
    "denormals",
    "signed_zeros",
    "exactly_k_on_top",  # k scores far above the rest: the first pass takes its whole bin
    "k_ties_on_top",  # k equal scores above the rest
    "ascending",
    "descending_dups",
)

_INF, _NAN = float("inf"), float("nan")


def _rand_int(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (), generator=g))


def _uniform(g: torch.Generator) -> float:
    return float(torch.rand((), generator=g))


def _ties_at_threshold(x: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    rows, n = x.shape
    if _rand_int(g, 0, 1):  # few distinct values: every threshold is a long tie
        return torch.randint(0, _rand_int(g, 2, 8), (rows, n), generator=g).float()
    # A large share of each row equals the row's k-th largest score.
    kth = x.sort(dim=1, descending=True).values[:, min(k, n) - 1 : min(k, n)]
    return torch.where(torch.rand(rows, n, generator=g) < 0.05 + 0.6 * _uniform(g), kth, x)


def _neg_inf_runs(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    rows, n = x.shape
    for r in range(rows):
        for _ in range(_rand_int(g, 1, 5)):
            start = _rand_int(g, 0, n - 1)
            x[r, start : start + _rand_int(g, 1, max(1, n // 2))] = -_INF
    x[0, : n // 2] = -_INF
    x[0, n // 2 + 10 : n // 2 + 400] = -_INF
    if rows > 1 and _rand_int(g, 0, 1):
        x[_rand_int(g, 1, rows - 1)] = -_INF  # a row of -inf only
    return x


def _nan_mix(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    rows, n = x.shape
    shares = (0.01, 0.3, 0.95)
    x[torch.rand(rows, n, generator=g) < shares[_rand_int(g, 0, 2)]] = _NAN
    x[torch.rand(rows, n, generator=g) < (0.05, 0.1, 0.5)[_rand_int(g, 0, 2)]] = -_INF
    x[torch.rand(rows, n, generator=g) < 0.01] = _INF
    if rows > 1:
        x[0, :] = _NAN  # a row of NaN only
        x[1, : n - 50] = _NAN  # fewer numbers than k: NaNs fill the rest
    return x


def _nan_payloads(rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0x7F800001, 0x7FFFFFFF, (rows, n), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (rows, n), generator=g, dtype=torch.int64) << 31
    x = ((bits | sign) - (1 << 32) * ((bits | sign) >= 2**31)).to(torch.int32)
    x = x.view(torch.float32).clone()
    x[torch.rand(rows, n, generator=g) < 0.5] = -_INF
    return x


def _huge_tiny(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    rows, n = x.shape
    exp = torch.randint(-46, 40, (rows, n), generator=g).double()
    scaled = (x.double() * torch.pow(10.0, exp)).float()  # past 3.4e38: inf
    pool = [3.4e38, -3.4e38, 1e30, -1e30, 1e-38, -1e-38, 1e-45, -1e-45, _INF, -_INF, 0.0, 1.0]
    picks = torch.tensor(pool)[torch.randint(0, len(pool), (rows, n), generator=g)]
    share = (0.3, 1.0)[_rand_int(g, 0, 1)]  # 1.0: extreme values only, many ties among them
    return torch.where(torch.rand(rows, n, generator=g) < share, picks, scaled)


def _denormals(rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    bits = torch.randint(1, 0x007FFFFF, (rows, n), generator=g, dtype=torch.int32)
    x = bits.view(torch.float32).clone()
    neg = torch.rand(rows, n, generator=g) < 0.5
    x[neg] = -x[neg]
    x[torch.rand(rows, n, generator=g) < 0.2] = 0.0
    return x


def _signed_zeros(rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    z = torch.where(torch.rand(rows, n, generator=g) < 0.5, 0.0, -0.0)
    z[torch.rand(rows, n, generator=g) < 0.04] = 1e-45
    z[torch.rand(rows, n, generator=g) < 0.04] = -1e-45
    z[torch.rand(rows, n, generator=g) < 0.2] = -1.0
    return z


def _on_top(x: torch.Tensor, k: int, g: torch.Generator, *, ties: bool) -> torch.Tensor:
    rows, n = x.shape
    cols = torch.randperm(n, generator=g)[: min(k, n)]
    x[:, cols] = 7.0 if ties else 100.0 + torch.rand(rows, len(cols), generator=g)
    return x


def topk_scores(kind: str, rows: int, n: int, g: torch.Generator, *, k: int = 128) -> torch.Tensor:
    """fp32 ``[rows, n]`` scores (on the CPU) of the distribution ``kind`` (one of
    :data:`TOPK_SCORE_KINDS`), drawn from ``g``; ``k`` is the top-k width the rows are made
    hard for (ties at the k-th score, k scores on top)."""
    x = torch.randn(rows, n, generator=g)
    simple = {
        "normal": lambda: x * 10.0 ** _rand_int(g, -3, 3),
        "all_equal": lambda: torch.full((rows, n), float(torch.randn((), generator=g))),
        "ties_at_threshold": lambda: _ties_at_threshold(x, k, g),
        "two_valued": lambda: torch.where(
            torch.rand(rows, n, generator=g) < _uniform(g), *torch.randn(2, generator=g).tolist()
        ),
        "integer_valued": lambda: torch.randint(-50, 50, (rows, n), generator=g).float(),
        "relu_zeros": lambda: _relu_zeros(x, g),
        "neg_inf_runs": lambda: _neg_inf_runs(x, g),
        "all_neg_inf": lambda: torch.full((rows, n), -_INF),
        "nan_mix": lambda: _nan_mix(x, g),
        "nan_payloads": lambda: _nan_payloads(rows, n, g),
        "huge_tiny": lambda: _huge_tiny(x, g),
        "denormals": lambda: _denormals(rows, n, g),
        "signed_zeros": lambda: _signed_zeros(rows, n, g),
        "exactly_k_on_top": lambda: _on_top(x, k, g, ties=False),
        "k_ties_on_top": lambda: _on_top(x, k, g, ties=True),
        "ascending": lambda: torch.arange(n).float().repeat(rows, 1),
        "descending_dups": lambda: (-(torch.arange(n) // 7)).float().repeat(rows, 1),
    }
    if kind not in simple:
        raise ValueError(f"unknown score distribution {kind!r}")
    return simple[kind]()


def _relu_zeros(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    rows, n = x.shape
    z = torch.where(torch.rand(rows, n, generator=g) < 0.9, 0.0, x.abs())
    z[:, ::7] = -0.0
    return z
