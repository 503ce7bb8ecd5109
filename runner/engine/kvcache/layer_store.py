"""One layer's authoritative KV off the device: sealed full blocks in a tier, plus a RAM tail.

New tokens are copied off the device once; a full tail is sealed on the IO thread and never rewritten, and
beam reorders move no block data (each block keeps a row map). Why the tail is token-major and how the
streams wait for each other: docs/kv-cache.md, "Tiered-disk blocks".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from runner.engine.kvcache.io_thread import IOThread
from runner.engine.kvcache.resident import granule
from runner.engine.kvcache.tiers import Tier


@dataclass
class Traffic:
    """Bytes moved between the device and host RAM, and how much of it the decode steps took: each
    figure is the sum of the bytes written by the copies themselves, counted where they happen."""

    device_to_host: int = 0
    host_to_device: int = 0
    decode_steps: int = 0
    decode_bytes: int = 0
    decode_wait_s: float = 0.0  # compute thread time spent waiting for layers to arrive


@dataclass(frozen=True)
class SealedBlock:
    stored_shape: torch.Size  # (batch as stored, heads, block_tokens, head_dim)
    payload: Future[object]  # what the tier returned; ready once the IO thread sealed it
    rows: torch.Tensor | None = None  # logical batch row -> stored row; None while they are the same


@dataclass
class Resident:
    """A layer's old tokens on the device, in buffers with room for `capacity - length` new ones."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int
    copied_bytes: int = 0  # what the copies that filled the buffers wrote (old tokens in, from the tier)
    filled: torch.cuda.Event | None = None  # on CUDA: recorded after those copies, on the stream that made them

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]


@dataclass(frozen=True)
class Slot:
    """A device buffer a read fills, keys and values side by side: one row of a batched step's
    staging buffer (runner/engine/tiered_attention.py), or one the read allocates. Its views are made
    once (`over`): a step's slots are read into at every layer, and each view is an op the host pays for."""

    kv: torch.Tensor  # [2, batch (1 in a step's slot), heads, tokens of room, head_dim]
    keys: torch.Tensor  # kv[0]
    values: torch.Tensor  # kv[1]
    by_token: torch.Tensor  # kv as the tails hold tokens: [tokens of room, 2, 1, heads, head_dim]
    free: torch.cuda.Event | None = None  # on CUDA: recorded after the slot's previous reader was queued

    @classmethod
    def over(cls, kv: torch.Tensor) -> Slot:
        return cls(kv, kv[0], kv[1], kv.permute(3, 0, 1, 2, 4))


class StagingBuffers:
    """Two device buffers, [2, rows, heads, tokens, head_dim] each (keys, then values), that reads fill
    layer after layer, step after step, so the device allocates nothing per read; made again, bigger,
    only when a view would not fit (in granules). Past what a read wrote they hold finite KV or zeros,
    never uninitialised memory: a batched step's mask weighs it at zero, and NaN times zero is NaN."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        self.buffers: list[torch.Tensor] = []
        self.turn = 0
        """Which of the two `next_slot` hands out next."""

    def views(self, rows: int, tokens: int) -> list[torch.Tensor]:
        """Both buffers cut to `rows` rows of `tokens` tokens (made bigger first if they are smaller)."""
        if not self.buffers or rows > self.buffers[0].shape[1] or tokens > self.buffers[0].shape[3]:
            had_rows, had_tokens = (self.buffers[0].shape[1], self.buffers[0].shape[3]) if self.buffers else (0, 0)
            shape = (2, max(rows, had_rows), self.heads, granule(max(tokens, had_tokens)), self.head_dim)
            self.buffers = []  # the old pair goes before the new one is made
            self.buffers = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2)]
        return [buffer[:, :rows, :, :tokens] for buffer in self.buffers]

    def next_slot(self, rows: int, tokens: int) -> Slot:
        """The buffer the one handed out before is not, as a slot of `rows` x `tokens`: a read fills it
        while the layer read before it is attended from the other. On CUDA its `free` event is
        recorded now, on the compute stream, after the attention that read it last (the layer before
        that one) was queued: the read's copies wait for it."""
        slot = Slot.over(self.views(rows, tokens)[self.turn])
        self.turn = 1 - self.turn
        if self.device.type == "cuda":
            slot = dataclasses.replace(slot, free=torch.cuda.current_stream(self.device).record_event())
        return slot


class LayerStore:
    def __init__(
        self, layer_idx: int, like: torch.Tensor, tier: Tier, io: IOThread, block_tokens: int, traffic: Traffic
    ) -> None:
        self.layer_idx = layer_idx
        self.tier = tier
        self.io = io
        self.block_tokens = block_tokens
        self.traffic = traffic
        self.batch, self.heads, _, self.head_dim = like.shape
        self.dtype = like.dtype
        self.device = like.device
        self.pinned = like.device.type == "cuda"
        self.blocks: list[SealedBlock] = []
        self.tail: torch.Tensor | None = None
        """(block_tokens, 2, batch, heads, head_dim): `tail[t]` is token t's keys, then its values."""
        self.tail_len = 0
        self.seq_len = 0
        self._copies_done: torch.cuda.Event | None = None

    @property
    def token_bytes(self) -> int:
        """Keys + values of one token of every batch row."""
        return 2 * self.batch * self.heads * self.head_dim * self.dtype.itemsize

    @property
    def host_bytes(self) -> int:
        """Host RAM this layer holds: the tail, plus the sealed blocks when the tier keeps them in RAM."""
        in_ram = len(self.blocks) if self.tier.keeps_blocks_in_ram else 0
        tail = 1 if self.tail is not None else 0
        return (in_ram + tail) * self.block_tokens * self.token_bytes

    # --- writing -------------------------------------------------------------------------------

    def _new_tail(self) -> torch.Tensor:
        """Token-major: `tail[a:b]` (tokens a..b, keys and values, of every row and head) is contiguous."""
        shape = (self.block_tokens, 2, self.batch, self.heads, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.pinned)

    def _mark_copies(self) -> torch.cuda.Event | None:
        """On CUDA the tail is filled by asynchronous copies; readers wait for this event."""
        if not self.pinned:
            return None
        self._copies_done = torch.cuda.current_stream(self.device).record_event()
        return self._copies_done

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Copy only the new tokens ((batch, heads, tokens, head_dim) each) off the device, sealing
        each tail that fills up; returns the bytes the copies wrote."""
        pairs = token_pairs(keys, values)
        new = pairs.shape[0]
        done = copied = 0
        while done < new:
            window = self.tail_window(new - done)
            window.copy_(pairs[done : done + window.shape[0]], non_blocking=self.pinned)
            copied += window.nbytes
            done += window.shape[0]
            self._filled(window.shape[0])
        return self._appended(new, copied)

    def wrote_token(self, window: torch.Tensor) -> int:
        """After the copy into `tail_window()`: the token is the layer's; returns the bytes it wrote."""
        self._filled(1)
        return self._appended(1, window.nbytes)

    def tail_window(self, tokens: int = 1) -> torch.Tensor:
        """The tail's room for up to `tokens` new tokens (a new tail if there is none), contiguous: a
        batched step copies every row's new token into its row's window with one op, then `wrote_token`."""
        if self.tail is None:
            self.tail = self._new_tail()
        return self.tail[self.tail_len : self.tail_len + min(tokens, self.block_tokens - self.tail_len)]

    def _filled(self, tokens: int) -> None:
        """`tokens` more of the tail are written: a full tail is sealed."""
        self.tail_len += tokens
        if self.tail_len == self.block_tokens:
            self._seal_tail()

    def _appended(self, tokens: int, copied: int) -> int:
        self.seq_len += tokens
        self.traffic.device_to_host += copied
        self._mark_copies()
        return copied

    def _seal_tail(self) -> None:
        payload = self.io.submit(self._seal, self.tail, self._mark_copies())
        self.blocks.append(SealedBlock(torch.Size((self.batch, self.heads, self.block_tokens, self.head_dim)), payload))
        self.tail = None
        self.tail_len = 0

    def _seal(self, tail: torch.Tensor, copies_done: torch.cuda.Event | None) -> object:
        if copies_done is not None:
            copies_done.synchronize()  # the bytes are read here, on the host
        return self.tier.seal(self.layer_idx, *(_head_major(tail[:, i], self.pinned) for i in range(2)))

    # --- reading -------------------------------------------------------------------------------

    def read_later(self, extra_tokens: int, into: Slot | None = None) -> Read:
        """A read of the layer as it is now, with room for `extra_tokens` (into the buffers of `into`
        when given: a batched step's slot for this row), for `read_all` to do, with other rows' reads."""
        return Read(self, extra_tokens, into, tuple(self.blocks), self.tail, self.tail_len, self.seq_len, self.batch,
                    self._copies_done)

    def load(self, extra_tokens: int, into: Slot | None = None, here: bool = False) -> Resident:
        """Bring the layer to the device after the IO thread's queued work (its seals) is done, or
        `here`, on the calling thread (blocks still being sealed are waited for)."""
        read = self.read_later(extra_tokens, into)
        if here:
            read_all([read])
        else:
            self.io.run(read_all, [read])
        return read.done.result()

    def _read_block(self, block: SealedBlock) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.tier.load(block.payload.result(), block.stored_shape, self.dtype)
        if block.rows is not None:
            keys, values = keys.index_select(0, block.rows), values.index_select(0, block.rows)
        return keys, values

    def _plan(self, read: Read) -> tuple[Slot, list[tuple[torch.Tensor, torch.Tensor]], int]:
        """A read's buffer (`into`, or a new one with room for `extra_tokens` more), the copies
        that fill it, (destination, source), left for the caller to make (`read_all` makes every
        row's at once), and the bytes already decoded into it (a disk block on CPU decodes straight
        into its window; a block in RAM is one of the copies)."""
        stream = torch.cuda.current_stream(self.device) if self.pinned else None
        into, extra_tokens = read.into, read.extra_tokens
        if into is None:  # keys and values side by side, as the tail holds them: one copy reads the tail into both
            shape = (2, read.batch, self.heads, read.seq_len + extra_tokens, self.head_dim)
            into = Slot.over(torch.empty(shape, dtype=self.dtype, device=self.device))
        else:
            assert into.kv.shape[1] == read.batch and into.kv.shape[-2] >= read.seq_len + extra_tokens, \
                "the slot is too small"
            if stream is not None:  # written on this stream: its memory is not handed out again before
                into.kv.record_stream(stream)  # these copies ran, even if the step that made it is gone
            if into.free is not None:
                stream.wait_event(into.free)
        if read.copies_done is not None:
            stream.wait_event(read.copies_done)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        decoded = 0
        for i, block in enumerate(read.blocks):
            window = slice(i * self.block_tokens, (i + 1) * self.block_tokens)
            keys, values = into.keys[:, :, window], into.values[:, :, window]
            if self.device.type == "cpu" and block.rows is None and not self.tier.keeps_blocks_in_ram:
                decoded += self.tier.load_into(block.payload.result(), keys, values)
                continue
            block_keys, block_values = self._read_block(block)
            copies += [(keys, block_keys), (values, block_values)]
        if read.tail_len:  # token-major into the buffer seen by token; on CUDA one contiguous copy to the device first
            tail = read.tail[: read.tail_len].to(into.kv.device, non_blocking=True)
            copies.append((into.by_token[read.seq_len - read.tail_len : read.seq_len], tail))
        return into, copies, decoded

    # --- reshaping (callers settle any pending read of this layer first) -----------------------

    def _wait_copies(self) -> None:
        if self._copies_done is not None:
            self._copies_done.synchronize()

    def select_rows(self, rows: torch.Tensor) -> None:
        """New batch row i is old row rows[i]: beam reorder, repeat-interleave and selection alike."""
        rows = rows.to("cpu")
        self._wait_copies()
        self.blocks = [
            dataclasses.replace(b, rows=rows.clone() if b.rows is None else b.rows.index_select(0, rows))
            for b in self.blocks
        ]
        self.batch = rows.numel()
        if self.tail is not None:
            old, self.tail = self.tail, self._new_tail()
            torch.index_select(old, 2, rows, out=self.tail)

    def crop(self, tokens: int) -> None:
        """Forget the last `tokens` tokens; a block cut in two comes back as the tail."""
        keep = max(self.seq_len - tokens, 0)
        sealed = len(self.blocks) * self.block_tokens
        self._wait_copies()
        if keep >= sealed:
            self.tail_len = keep - sealed
        else:
            first_dropped, partial = divmod(keep, self.block_tokens)
            dropped = self.blocks[first_dropped]
            self.tail = None
            if partial:
                keys, values = self.io.run(self._read_block, dropped)
                self.tail = self._new_tail()
                self.tail[:partial].copy_(token_pairs(keys[:, :, :partial], values[:, :, :partial]))
            self.tail_len = partial
            self.io.run(self.tier.discard_from, dropped.payload.result())
            del self.blocks[first_dropped:]
        self.seq_len = keep


def token_pairs(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head_dim) keys and values as the tail holds them: (tokens, 2, batch,
    heads, head_dim), contiguous (one op; on CUDA on the device, before the copy off it)."""
    return torch.stack((keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3)), dim=1)


def _head_major(tail: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A sealed tail as the tiers store blocks: (batch, heads, tokens, head_dim), contiguous."""
    block = torch.empty(tail.permute(1, 2, 0, 3).shape, dtype=tail.dtype, pin_memory=pinned)
    block.permute(2, 0, 1, 3).copy_(tail)
    return block


@dataclass
class Read:
    """One layer of one row to bring to the device for its next turn, and the future its layer
    settles on: a prefetch hands it to an IO thread alone, a batched step with its other rows'.
    The layer as it was when the read was made is frozen in it (the layer may change afterwards)."""

    store: LayerStore
    extra_tokens: int
    into: Slot | None
    blocks: tuple[SealedBlock, ...]
    tail: torch.Tensor | None
    tail_len: int
    seq_len: int
    batch: int
    copies_done: torch.cuda.Event | None
    done: Future[Resident] = field(default_factory=Future)


def read_all(reads: Sequence[Read]) -> None:
    """Do `reads` (any rows' layers, on one device) as one job: one batched copy for all their
    windows, blocks and tails, rather than a job and copies per row. A read whose future was
    cancelled first (its layer read itself instead) is skipped; a read that fails fails its own
    future only, so the error names its row."""
    planned = []
    for read in reads:
        if not read.done.set_running_or_notify_cancel():
            continue
        try:
            with _writing([read.into]):
                planned.append((read, *read.store._plan(read)))
        except Exception as e:  # noqa: BLE001 - raised where its row settles the read
            read.done.set_exception(e)
    if not planned:
        return
    try:
        with _writing([read.into for read, *_ in planned]):
            copy_all([pair for _, _, copies, _ in planned for pair in copies])
    except Exception as e:  # noqa: BLE001 - raised where each row settles its read
        for read, *_ in planned:
            read.done.set_exception(e)
        return
    store = planned[0][0].store  # on CUDA: an event after the copies queued on this thread's stream, for their readers
    filled = torch.cuda.current_stream(store.device).record_event() if store.pinned else None
    for read, buffer, copies, decoded in planned:
        copied = decoded + sum(dst.nbytes for dst, _ in copies)  # the traffic counters add up the copies' own writes
        read.store.traffic.host_to_device += copied
        read.done.set_result(Resident(buffer.keys, buffer.values, read.seq_len, copied, filled))


def _writing(slots: Sequence[Slot | None]) -> AbstractContextManager[object]:
    """A slot made under inference mode (a decode step) is written under it, on whichever thread."""
    inference = any(slot is not None and slot.kv.is_inference() for slot in slots)
    return torch.inference_mode() if inference else nullcontext()


def copy_all(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make every (destination, source) copy with one op (`_foreach_copy_`): one dispatch for many
    rows' small copies, where a loop of `copy_` pays the host's cost of an op for each."""
    if copies:
        torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies], non_blocking=True)
