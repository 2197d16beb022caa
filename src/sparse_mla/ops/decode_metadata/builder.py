"""Persistent-buffer decode-metadata builder: chooses native or flattened layout per step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..._checks import check_dcp, check_int, check_tensor
from ..._custom_op import compiling
from ..._runtime import canonical_device
from .api import launch_expand_through_op, launch_native_through_op
from .config import ExpandConfig, check_expand_config
from .expand import (
    _INT32_MAX,
    MAX_DECODE_LEN,
    ExpandedDecodeTokens,
    _check_seq_lens_block_table,
    _host_decode_lens,
    _launch_expand,
    _launch_native,
)

# Pinned staging slots for the host->device copy of ragged row offsets. A slot is reused
# only after the copy issued from it two builds earlier has completed (checked by an event).
_STAGING_SLOTS = 2
_MAX_VIEWS = 256  # cached buffer views per builder (shapes vary with the batch)


@dataclass(frozen=True)
class DecodeMetadata:
    """What one :meth:`DecodeMetadataBuilder.build` produced. Tensors are views into the
    builder's persistent buffers (the next build overwrites them), except ``block_table`` in
    native mode, which is the caller's ``block_table`` itself.

    * ``flattened``: True when every query token got its own row (``next_n == 1`` rows).
    * ``requires_padding``: True when the requests' decode lengths ``n_b`` differ.
    * ``next_n``: query tokens per row the consuming kernel sees (``n`` native, 1 flattened).
    * ``num_tokens``: rows (flattened, incl. padding rows) or ``B * n`` (native).
    * ``seq_lens``: int32, flattened ``[num_tokens]`` or native ``[B, n]``; visible positions
      per query token (DCP-localised when the builder has ``dcp_size > 1``).
    * ``block_table``: int32, flattened ``[num_tokens, W]`` or native ``[B, W]``.
    * ``decode_lens``: int32, flattened ``[num_tokens]`` (all 1) or native ``[B]`` (all ``n``).
    * ``req_id``: int32, request of each row: flattened ``[num_tokens]``, native ``[B]``
      (``0..B-1``).
    * ``num_requests``: ``B``.
    """

    flattened: bool
    requires_padding: bool
    next_n: int
    num_tokens: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    decode_lens: torch.Tensor
    req_id: torch.Tensor
    num_requests: int


class DecodeMetadataBuilder:
    """Builds decode metadata each step into buffers sized once (CUDA-graph friendly).

    Args:
        max_num_tokens: capacity in flattened rows (including CUDA-graph padding rows).
        max_num_requests: capacity in requests ``B``.
        max_blocks_per_req: capacity in block-table columns ``W``.
        max_decode_len: largest ``n_b`` accepted.
        native_decode_lens: the ``n`` the consuming kernel takes natively; when every request
            has the same ``n`` and it is in this set nothing is flattened.
        dcp_size, dcp_rank, interleave: decode context parallelism of this rank.
        device: where buffers live (default: CUDA, or the CPU under the interpreter).
        config: tuning of the expansion kernels (:class:`ExpandConfig`; None = defaults).

    :meth:`build` allocates no device memory, launches exactly one kernel and never reads
    device data back: decode lengths are host-known, and when the ragged kernel needs them on
    the device their offsets (``query_start_loc``) travel through a pinned staging buffer
    with a non-blocking copy. (Two staging slots alternate; reusing one waits on its copy
    from two builds earlier, which has normally long finished.) Call it outside CUDA-graph
    capture; the kernels it launches read and write only the persistent buffers, so captured
    consumers see each build's results.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_requests: int,
        max_blocks_per_req: int,
        max_decode_len: int,
        *,
        native_decode_lens: Iterable[int] = (1,),
        dcp_size: int = 1,
        dcp_rank: int = 0,
        interleave: int = 1,
        device: torch.device | str | None = None,
        config: ExpandConfig | None = None,
    ) -> None:
        check_int("max_num_tokens", max_num_tokens, lo=0, hi=_INT32_MAX)
        check_int("max_num_requests", max_num_requests, lo=0, hi=_INT32_MAX)
        check_int("max_blocks_per_req", max_blocks_per_req, lo=0, hi=_INT32_MAX)
        check_int("max_decode_len", max_decode_len, lo=1, hi=MAX_DECODE_LEN)
        if max_num_requests * max_decode_len > _INT32_MAX:
            raise ValueError("max_num_requests * max_decode_len must fit in int32")
        native = tuple(native_decode_lens)
        for n in native:
            check_int("native_decode_lens", n, lo=1, hi=max_decode_len)
        check_dcp(dcp_size, dcp_rank, interleave)
        self.config = check_expand_config(config)

        self.max_num_tokens = max_num_tokens
        self.max_num_requests = max_num_requests
        self.max_blocks_per_req = max_blocks_per_req
        self.max_decode_len = max_decode_len
        self.native_decode_lens = frozenset(native)
        self.dcp_size, self.dcp_rank, self.interleave = dcp_size, dcp_rank, interleave
        self.device = canonical_device(device)

        def buf(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=self.device)

        # Flattened outputs.
        self._seq_lens = buf(max_num_tokens)
        self._block_table = buf(max_num_tokens, max_blocks_per_req)
        self._tok_decode_lens = buf(max_num_tokens)
        self._req_id = buf(max_num_tokens)
        # Native outputs; req_id is 0..B-1 whatever the step, so it is filled once here.
        max_native = max(native, default=0)
        self._native_seq_lens = buf(max_num_requests * max_native)
        self._req_decode_lens = buf(max_num_requests)  # native output
        self._req_starts = buf(max_num_requests + 1)  # ragged-kernel input
        self._arange = torch.arange(max_num_requests, dtype=torch.int32, device=self.device)

        # Host staging for the ragged case; pinned only where there is a CUDA device to copy to.
        self._pinned = self.device.type == "cuda"
        self._staging = [
            torch.zeros(max_num_requests + 1, dtype=torch.int32, pin_memory=self._pinned)
            for _ in range(_STAGING_SLOTS)
        ]
        self._staging_events: list[torch.cuda.Event | None] = [None] * _STAGING_SLOTS
        self._slot = 0
        self._views: dict[tuple, tuple] = {}  # buffer views by shape (_native/_flat_views)

    def _native_views(self, num_reqs: int, n: int) -> tuple[torch.Tensor, ...]:
        """(seq_lens ``[B, n]``, decode_lens ``[B]``, req_id ``[B]``): views of the buffers,
        made once per shape (slicing costs host time every step)."""
        key = ("native", num_reqs, n)
        views = self._views.get(key)
        if views is None:
            views = (
                self._native_seq_lens[: num_reqs * n].view(num_reqs, n),
                self._req_decode_lens[:num_reqs],
                self._arange[:num_reqs],
            )
            self._keep_view(key, views)
        return views

    def _flat_views(self, num_tokens: int, width: int) -> ExpandedDecodeTokens:
        """The flattened outputs' views for ``num_tokens`` rows of ``width`` columns."""
        key = ("flat", num_tokens, width)
        views = self._views.get(key)
        if views is None:
            views = ExpandedDecodeTokens(
                seq_lens=self._seq_lens[:num_tokens],
                block_table=self._block_table[:num_tokens, :width],
                decode_lens=self._tok_decode_lens[:num_tokens],
                req_id=self._req_id[:num_tokens],
            )
            self._keep_view(key, views)
        return views

    def _keep_view(self, key: tuple, views: tuple) -> None:
        if len(self._views) >= _MAX_VIEWS:
            self._views.clear()
        self._views[key] = views

    def _stage_starts(
        self, decode_lens: Sequence[int] | torch.Tensor, num_reqs: int
    ) -> torch.Tensor:
        """The requests' row offsets ``[0, n_0, n_0 + n_1, ...]`` (``[B + 1]``), computed on
        the host and copied into ``self._req_starts`` without a sync."""
        src = decode_lens
        if not isinstance(src, torch.Tensor):
            src = torch.tensor(src, dtype=torch.int32)
        dst = self._req_starts[: num_reqs + 1]
        stage = dst  # CPU (interpreter) or a non-CUDA device: straight into the buffer
        if self._pinned:
            slot = self._slot
            self._slot = (slot + 1) % _STAGING_SLOTS
            event = self._staging_events[slot]
            if event is not None:
                # The copy from this slot was issued _STAGING_SLOTS builds ago; normally done.
                event.synchronize()
            stage = self._staging[slot][: num_reqs + 1]
        stage[:1].zero_()
        torch.cumsum(src, 0, dtype=torch.int32, out=stage[1:])
        if self._pinned:
            dst.copy_(stage, non_blocking=True)
            if event is None:
                event = torch.cuda.Event()
                self._staging_events[slot] = event
            event.record()
        return dst

    def build(
        self,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        decode_lens: int | Sequence[int] | torch.Tensor,
        *,
        num_tokens: int | None = None,
        enable_pdl: bool | None = None,
    ) -> DecodeMetadata:
        """Build this step's decode metadata.

        Args:
            seq_lens: int32 ``[B]`` on the builder's device, total length of each request
                (including its query tokens); ``B <= max_num_requests``.
            block_table: int32 ``[B, W]`` on the same device, any strides;
                ``W <= max_blocks_per_req``.
            decode_lens: host-known ``n_b`` per request: an int (every request), a sequence of
                ints or a CPU int32/int64 tensor ``[B]``, each in ``[0, max_decode_len]``.
            num_tokens: flattened rows to produce (CUDA-graph padding); default ``sum(n_b)``;
                must lie in ``[sum(n_b), max_num_tokens]``. Native mode always has ``B * n``
                rows (the value is only checked).
            enable_pdl: programmatic dependent launch of the one launch (None or True: on
                where supported; False: off).

        Returns:
            :class:`DecodeMetadata` whose tensors are views into this builder's buffers.
        """
        seq_lens, block_table, device = _check_seq_lens_block_table(seq_lens, block_table)
        if device != self.device:
            raise ValueError(f"seq_lens is on {device}, the builder's buffers on {self.device}")
        num_reqs, width = block_table.shape
        if num_reqs > self.max_num_requests:
            raise ValueError(
                f"seq_lens has {num_reqs} requests, over the builder capacity "
                f"max_num_requests={self.max_num_requests}"
            )
        if width > self.max_blocks_per_req:
            raise ValueError(
                f"block_table has {width} columns, over the builder capacity "
                f"max_blocks_per_req={self.max_blocks_per_req}"
            )
        if isinstance(decode_lens, torch.Tensor):
            if decode_lens.device.type != "cpu":
                raise ValueError(
                    f"decode_lens must be host-known (a sequence or a CPU tensor), got a tensor "
                    f"on {decode_lens.device}"
                )
            check_tensor("decode_lens", decode_lens, dtype=(torch.int32, torch.int64), ndim=1)
        host = _host_decode_lens(decode_lens, num_reqs, self.max_decode_len)
        total = sum(host)
        if num_tokens is None:
            num_tokens = total
        check_int("num_tokens", num_tokens, lo=0)
        if num_tokens < total:
            raise ValueError(f"num_tokens={num_tokens} is smaller than sum(decode_lens)={total}")
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"num_tokens={num_tokens} exceeds the builder capacity "
                f"max_num_tokens={self.max_num_tokens}"
            )

        distinct = set(host)
        requires_padding = len(distinct) > 1
        launch_native, launch_expand = _launch_native, _launch_expand
        if compiling():  # torch.compile: through the ops (docs/DEVELOPING.md, "Custom ops")
            launch_native, launch_expand = launch_native_through_op, launch_expand_through_op
        kw = {
            "dcp_size": self.dcp_size,
            "dcp_rank": self.dcp_rank,
            "interleave": self.interleave,
            "config": self.config,
            "enable_pdl": enable_pdl,
        }

        if len(distinct) == 1 and host[0] in self.native_decode_lens:
            n = host[0]
            lens, dl, req_id = self._native_views(num_reqs, n)
            launch_native(seq_lens, lens, dl, next_n=n, **kw)
            return DecodeMetadata(
                flattened=False,
                requires_padding=False,
                next_n=n,
                num_tokens=num_reqs * n,
                seq_lens=lens,
                block_table=block_table,
                decode_lens=dl,
                req_id=req_id,
                num_requests=num_reqs,
            )

        out = self._flat_views(num_tokens, width)
        if requires_padding:
            launch_expand(
                seq_lens,
                block_table,
                out,
                query_start_loc=self._stage_starts(decode_lens, num_reqs),  # ragged: not an int
                max_decode_len=self.max_decode_len,
                **kw,
            )
        else:
            launch_expand(
                seq_lens,
                block_table,
                out,
                uniform_n=host[0] if host else 0,
                max_decode_len=self.max_decode_len,
                **kw,
            )
        return DecodeMetadata(
            flattened=True,
            requires_padding=requires_padding,
            next_n=1,
            num_tokens=num_tokens,
            seq_lens=out.seq_lens,
            block_table=out.block_table,
            decode_lens=out.decode_lens,
            req_id=out.req_id,
            num_requests=num_reqs,
        )
