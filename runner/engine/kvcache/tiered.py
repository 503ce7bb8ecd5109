"""TieredCache: a transformers `Cache` whose full-attention layers live off the device, as far as needed.

A `Placement` (jobs.kvplan) says which full-attention layers stay on the device; the rest (all of them
without one) are streamed from host RAM or block files, on the device only for their turn while the IO
thread brings the next (docs/kv-cache.md, "Tiered-disk blocks"). Sliding-window layers stay resident.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from jobs.kvplan import Placement
from jobs.rungs import TierName
from runner.engine.kvcache.budget import ResidentMeter
from runner.engine.kvcache.io_thread import IOThread
from runner.engine.kvcache.layer_store import LayerStore, Read, Resident, Slot, StagingBuffers, Traffic, read_all
from runner.engine.kvcache.resident import GrowingLayer, allocated_bytes
from runner.engine.kvcache.tiers import DiskTier, HostTier, Tier
from storage.kvblocks import BlockCodec, Compression


class _Shared:
    """What the layers of one TieredCache share: the tier, the IO thread, the meters, the counters."""

    def __init__(self, tier: Tier, block_tokens: int, device_meter: ResidentMeter, host_meter: ResidentMeter) -> None:
        self.tier = tier
        self.block_tokens = block_tokens
        self.device_meter = device_meter
        self.host_meter = host_meter
        self.traffic = Traffic()
        self._io: IOThread | None = None
        self.reads: StagingBuffers | None = None
        """The two buffers the layers are read into (`read_slot`), once a layer is read."""

    def read_slot(self, store: LayerStore, extra_tokens: int) -> Slot:
        """Where a read of `store`'s layer (not into a batched step's slot) goes: the next of the
        cache's two read buffers, kept across layers and steps, while the layer read before it is
        attended from the other (one read is pending at a time)."""
        like = (store.heads, store.head_dim, store.dtype)
        if self.reads is None or (self.reads.heads, self.reads.head_dim, self.reads.dtype) != like:
            self.reads = StagingBuffers(store.heads, store.head_dim, store.dtype, store.device)
        return self.reads.next_slot(store.batch, store.seq_len + extra_tokens)

    def io(self, device: torch.device) -> IOThread:
        if self._io is None:
            self._io = IOThread(device)
        return self._io

    def drain(self) -> None:
        """Wait for every queued seal and read, so sizes and counters are final."""
        if self._io is not None:
            self._io.run(lambda: None)

    def close(self) -> None:
        if self._io is not None:
            self._io.close()
            self._io = None
        self.reads = None
        self.tier.close()


class TieredLayer(DynamicLayer):
    """A full-attention layer kept off the device between its turns in the forward pass (a `DynamicLayer`
    for its mask sizes and flags; every method that touches KV is its own)."""

    streamed = True
    """Its KV lives on a tier and comes to the device for its turn (the other layers of a cache stay there)."""

    def __init__(self, layer_idx: int, shared: _Shared, tier: Tier) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.shared = shared
        self.tier = tier
        self.store: LayerStore | None = None
        self._pending: Read | None = None  # queued on an IO thread: this row's own, or a batched step's reader
        self._ready: Resident | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store = LayerStore(self.layer_idx, key_states, self.tier, self.shared.io(key_states.device),
                                self.shared.block_tokens, self.shared.traffic)
        self.is_initialized = True

    # --- the forward pass ----------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.store is not None
        new = key_states.shape[-2]
        old, waited = self._take_resident(extra_tokens=new)
        copied_out = self.store.append(key_states, value_states)
        self.shared.host_meter.hold(self.layer_idx, self.store.host_bytes)
        if old is None:
            keys, values = key_states, value_states
        elif old.capacity == old.length + new:
            old.keys[:, :, old.length :].copy_(key_states)
            old.values[:, :, old.length :].copy_(value_states)
            keys, values = old.keys, old.values
        else:  # the prefetch guessed the step size wrong (e.g. the first decode step after prefill)
            keys = torch.cat([old.keys[:, :, : old.length], key_states], dim=-2)
            values = torch.cat([old.values[:, :, : old.length], value_states], dim=-2)
        self.shared.device_meter.hold(self.layer_idx, keys.nbytes + values.nbytes)
        self._count_decode(new, old, copied_out, waited)
        return keys, values

    def begin_turn(self, slot: Slot) -> SlotTurn:
        """A batched decode step's share of this layer (runner/engine/tiered_attention.py), first half:
        the old tokens in `slot` (read ahead into it, or for the step to copy in: `SlotTurn.carried`)
        and the tail window the new token goes to; the step attends, then `finish_turn`s."""
        assert self.store is not None
        old, waited = self._take_resident(extra_tokens=1, into=slot)
        assert old is not None, "a batched step's tiered rows hold tokens"
        carried = []
        if old.keys.data_ptr() != slot.kv.data_ptr():  # read before the step had slots (its first layer's prefetch)
            carried = [(slot.keys[:, :, : old.length], old.keys[:, :, : old.length]),
                       (slot.values[:, :, : old.length], old.values[:, :, : old.length])]
            self.shared.device_meter.hold(self.layer_idx, slot.kv.nbytes)  # a read into the slot held it already
        return SlotTurn(self, old, waited, carried, self.store.tail_window())

    def finish_turn(self, turn: SlotTurn, waited_with_others: float) -> None:
        """After the step copied the new token into `turn.window`: the token is this layer's; the
        copies are counted (`waited_with_others`: this row's share of the step's wait for its reads)."""
        assert self.store is not None
        copied_out = self.store.wrote_token(turn.window)
        self.shared.host_meter.hold(self.layer_idx, self.store.host_bytes)
        self._count_decode(1, turn.old, copied_out, turn.waited + waited_with_others)

    def _count_decode(self, new: int, old: Resident | None, copied_out: int, waited: float) -> None:
        if new == 1:  # a decode step: what the copies that brought its old tokens in and took its new one out wrote
            self.shared.traffic.decode_bytes += (old.copied_bytes if old is not None else 0) + copied_out
            self.shared.traffic.decode_wait_s += waited

    def read_ahead(self, extra_tokens: int, into: Slot | None = None) -> Read | None:
        """The read that brings this layer to the device for its next turn (with room for its new
        tokens; into `into`, a batched step's slot, when given), for the caller to queue: alone, or
        with the step's other rows' (`read_all`). None if there is nothing to read or a read is pending."""
        if self.store is None or self.store.seq_len == 0 or self._pending is not None or self._ready is not None:
            return None
        self._pending = self.store.read_later(extra_tokens, self._held_slot(extra_tokens, into))
        return self._pending

    def _held_slot(self, extra_tokens: int, into: Slot | None) -> Slot:
        """Where a read goes (`into`, else the cache's next read buffer), held in the device meter."""
        assert self.store is not None
        into = into if into is not None else self.shared.read_slot(self.store, extra_tokens)
        self.shared.device_meter.hold(self.layer_idx, into.kv.nbytes)
        return into

    def _take_resident(self, extra_tokens: int, into: Slot | None = None) -> tuple[Resident | None, float]:
        """The layer's old tokens on the device (None if it holds none), and the seconds waited for them."""
        waited_from = time.perf_counter()
        self._settle()
        ready, self._ready = self._ready, None
        assert self.store is not None
        if ready is None and self.store.seq_len > 0:
            ready = self._adopt(self.store.load(extra_tokens, self._held_slot(extra_tokens, into)))
        return ready, time.perf_counter() - waited_from

    def _settle(self) -> None:
        """Finish a background read of this layer before anything reads or changes the layer."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if pending.done.cancel():
                # Still queued (the IO thread is busy or starved of CPU): reading here beats waiting
                # for its turn. Nothing changed the layer since the read was queued.
                assert self.store is not None
                self._ready = self._adopt(self.store.load(pending.extra_tokens, pending.into, here=True))
            else:
                self._ready = self._adopt(pending.done.result())

    def _adopt(self, resident: Resident) -> Resident:
        """Buffers filled on the IO thread's stream are used on this (the compute) thread's stream,
        after their copies: a wait on the device, not the host."""
        assert self.store is not None
        self.store.io.adopt(resident.filled, resident.keys, resident.values)
        return resident

    def _discard_resident(self) -> None:
        self._settle()
        self._ready = None
        self.shared.device_meter.drop(self.layer_idx)

    # --- CacheLayerMixin -----------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return self.store.seq_len if self.store is not None else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search (generate() on the cache directly; the batch runner refuses beams): a row selection
        like any other, the prefetched copy read again."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            self.batch_select_indices(torch.arange(self.store.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is not None:
            self._discard_resident()
            self.store.select_rows(torch.as_tensor(indices).reshape(-1))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        if tokens_to_remove == 0 or self.store is None:
            return
        self._discard_resident()
        self.store.crop(-tokens_to_remove)

    def reset(self) -> None:
        if self.store is not None:
            self._discard_resident()
            self.store.crop(self.store.seq_len)


@dataclass
class SlotTurn:
    """One row's share of one streamed layer in a batched decode step, between its two halves."""

    layer: TieredLayer
    old: Resident
    waited: float  # seconds the compute thread waited for this row's read of the layer
    carried: list[tuple[torch.Tensor, torch.Tensor]]  # copies (slot window, source) of old tokens read elsewhere
    window: torch.Tensor  # the tail window the new token goes to


class TieredCache(Cache):
    """A transformers Cache whose full-attention KV lives on the device, in host RAM or in NVMe block
    files, layer by layer as `placement` says (default: every full-attention layer streamed from `tier`)."""

    def __init__(
        self,
        config: PretrainedConfig,
        tier: TierName = "host",
        offload_dir: str | Path | None = None,
        block_tokens: int = 512,
        compression: Compression = "zstd",
        zstd_level: int = 1,
        shuffle: bool = True,
        device_budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        placement: Placement | None = None,
        device_meter: ResidentMeter | None = None,
        host_meter: ResidentMeter | None = None,
        batched_attention: bool = False,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.shared = _Shared(
            _make_tier(tier, offload_dir, BlockCodec(compression, zstd_level, shuffle)),
            block_tokens,
            ResidentMeter(device_budget_bytes, "resident device", "cache.device_kv_budget_bytes", device_meter),
            ResidentMeter(host_budget_bytes, "host RAM", "cache.host_kv_budget_bytes", host_meter),
        )
        self.placement = placement
        self.batched_attention = batched_attention
        """Whether a batched decode step attends this row's streamed layers with the step's other
        tiered rows in one call (runner/engine/tiered_attention.py), as `batch.attention: pooled` asks."""
        layers = _layers_for(config.get_text_config(decoder=True), self.shared, placement)
        super().__init__(layers=layers)
        tiered = [i for i, layer in enumerate(layers) if getattr(layer, "streamed", False)]
        self._next_tiered = dict(zip(tiered, tiered[1:] + tiered[:1]))
        with_kv = [i for i, dummy in enumerate(self.is_dummy) if not dummy]  # transformers: which layers hold no KV
        self._first_layer, self._last_layer = (with_kv[0], with_kv[-1]) if with_kv else (None, None)
        self._current: int | None = None
        self.batched_layers = 0
        """Layers this cache took part in through a batched tiered step: what a test or a bench asks."""
        self.most_batched_rows = 0
        """The most tiered rows one batched step attended with this one in one call."""
        self.staging: StagingBuffers | None = None
        """The staging buffers of the batched steps this row takes part in (runner/engine/tiered_attention.py):
        held here so they outlive a step and are freed once no open row holds them."""
        self._kv_peak = 0
        self._closed = False

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        new = key_states.shape[-2]
        self._count_step(layer_idx, new)
        if not getattr(layer, "streamed", False):  # resident or sliding-window: stays on the device, moves nothing
            if getattr(layer, "grows", False) and not layer.is_initialized:
                # room for the whole planned document at once: it never regrows (no copies), and the
                # budget guard checks what the planner counted before it is allocated
                assert self.placement is not None
                layer.lazy_initialization(key_states, value_states)
                self.shared.device_meter.hold(("kept", layer_idx), layer.bytes_for(self.placement.tokens))
                layer.grow_to(self.placement.tokens)
            keys, values = layer.update(key_states, value_states, *args, **kwargs)
            self.shared.device_meter.hold(("kept", layer_idx), allocated_bytes(layer))
        else:
            self._switch_to(layer_idx)
            keys, values = layer.update(key_states, value_states)
            read = self._read_after(layer_idx, new, None)
            if read is not None:
                read.store.io.submit(read_all, [read])
        self._note_kv_peak(layer_idx)
        return keys, values

    def streams(self, layer_idx: int) -> bool:
        """Whether a batched decode step can take this row's layer `layer_idx` in a slot: a streamed
        layer of one sequence that holds tokens (resident and sliding-window layers stay per row)."""
        layer = self.layers[layer_idx]
        return getattr(layer, "streamed", False) and layer.store is not None and layer.store.seq_len > 0 \
            and layer.store.batch == 1

    def begin_turn(self, layer_idx: int, slot: Slot) -> SlotTurn:
        """This row's share of streamed layer `layer_idx` in a batched decode step
        (runner/engine/tiered_attention.py), first half: its old tokens in `slot`, its tail window."""
        layer = self.layers[layer_idx]
        assert getattr(layer, "streamed", False)
        self._count_step(layer_idx, 1)
        self._switch_to(layer_idx)
        return layer.begin_turn(slot)

    def finish_turn(self, turn: SlotTurn, rows: int, waited_with_others: float, next_slot: Slot | None
                    ) -> Read | None:
        """Second half, once the step of `rows` tiered rows copied the new token to `turn.window`:
        the read of the streamed layer after this one, for the step to queue with its other rows'
        (into `next_slot` when that is layer `layer_idx + 1`); None if there is none."""
        layer_idx = turn.layer.layer_idx
        turn.layer.finish_turn(turn, waited_with_others)
        self._note_kv_peak(layer_idx)
        self.batched_layers += 1
        self.most_batched_rows = max(self.most_batched_rows, rows)
        return self._read_after(layer_idx, 1, next_slot)

    def _count_step(self, layer_idx: int, new: int) -> None:
        if layer_idx == self._first_layer and new == 1:
            self.shared.traffic.decode_steps += 1

    def _switch_to(self, layer_idx: int) -> None:
        if self._current is not None and self._current != layer_idx:
            self.shared.device_meter.drop(self._current)  # its attention has run: its buffers are free
        self._current = layer_idx

    def _read_after(self, layer_idx: int, new: int, next_slot: Slot | None) -> Read | None:
        following_idx = self._next_tiered[layer_idx]
        if following_idx == layer_idx:
            return None
        # Within a step the next layer gets the same new tokens; past the last layer, guess a
        # decode step (one token) rather than reserve room for another prompt-sized chunk.
        into = next_slot if following_idx == layer_idx + 1 else None
        return self.layers[following_idx].read_ahead(extra_tokens=new if following_idx > layer_idx else 1, into=into)

    def _note_kv_peak(self, layer_idx: int) -> None:
        """After the last layer of a forward pass every layer holds its new tokens: the KV size
        only grows between passes, so its peak is read there (one walk over the layers a pass)."""
        if layer_idx == self._last_layer:
            self._kv_peak = max(self._kv_peak, sum(_kv_bytes(layer) for layer in self.layers))

    def stats(self) -> dict[str, Any]:
        """Sizes and traffic so far; the first five keys are the result row's columns."""
        for layer in self.layers:  # a read ahead may be queued on another row's IO thread (a batched step's)
            if getattr(layer, "streamed", False):
                layer._settle()
        self.shared.drain()
        traffic = self.shared.traffic
        store = getattr(self.shared.tier, "store", None)  # a tier with a block store: the disk's
        if store is not None:
            written, read = store.bytes_written, store.bytes_read
            ratio = store.compression_ratio if store.codec.compression == "zstd" else 1.0
        else:  # the host tier's offload traffic is the device<->host copies
            written, read, ratio = traffic.device_to_host, traffic.host_to_device, None
        return {
            "kv_bytes": self._kv_peak,
            "kv_resident_peak_bytes": self.shared.device_meter.peak,
            "offload_bytes_written": written,
            "offload_bytes_read": read,
            "compression_ratio": ratio,
            "host_peak_bytes": self.shared.host_meter.peak,
            "device_to_host_bytes": traffic.device_to_host,
            "host_to_device_bytes": traffic.host_to_device,
            "decode_steps": traffic.decode_steps,
            "bytes_moved_per_decode_step": traffic.decode_bytes / traffic.decode_steps if traffic.decode_steps else None,
            # time the compute thread waited for layers in decode steps: what prefetch did not hide
            "read_wait_per_decode_step_s": traffic.decode_wait_s / traffic.decode_steps if traffic.decode_steps else None,
        }

    def time_read_pass(self) -> float:
        """Seconds to bring every offloaded layer to the device once with no compute to hide it:
        the I/O that prefetching must overlap in a decode step. Adds to the read counters."""
        self.shared.drain()
        start = time.perf_counter()
        for layer in self.layers:
            if getattr(layer, "streamed", False) and layer.store is not None:
                resident = layer.store.load(extra_tokens=1)
                if resident.filled is not None:  # on CUDA the load returns once its copies are queued
                    resident.filled.synchronize()
        return time.perf_counter() - start

    def offload_files(self) -> list[Path]:
        """The block files currently in the offload dir (none for the host tier)."""
        store = getattr(self.shared.tier, "store", None)
        return store.files() if store is not None else []

    def close(self) -> None:
        """Stop the IO thread and remove the block files; the cache is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self.shared.close()  # waits for the IO thread's running job; queued reads are cancelled
        self.staging = None
        self.shared.device_meter.release()
        self.shared.host_meter.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kv_bytes(layer: CacheLayerMixin | DummyLayer) -> int:
    """A layer's KV as `dynamic` would hold it on the device."""
    if getattr(layer, "streamed", False):
        return layer.store.seq_len * layer.store.token_bytes if layer.store is not None else 0
    return layer.keys.nbytes + layer.values.nbytes if getattr(layer, "keys", None) is not None else 0


def _make_tier(tier: str, offload_dir: str | Path | None, codec: BlockCodec) -> Tier:
    if tier == "host":
        return HostTier()
    if tier == "disk":
        if offload_dir is None:
            raise ValueError("TieredCache(tier='disk') needs offload_dir: the task's own directory on fast local disk")
        return DiskTier(offload_dir, codec)
    raise ValueError(f"TieredCache tier must be 'host' or 'disk', got {tier!r}")


def _layers_for(config: PretrainedConfig, shared: _Shared, placement: Placement | None
                ) -> list[CacheLayerMixin | DummyLayer]:
    """The cache's layers, as `placement` puts them."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    resident = set(placement.resident_layers) if placement else set()
    in_host_ram = set(placement.host_layers) if placement else set()
    host_tier = HostTier()
    layers: list[CacheLayerMixin | DummyLayer] = []
    for idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if layer_type == "full_attention" and idx in resident:
            layers.append(GrowingLayer())
        elif layer_type == "full_attention":
            layers.append(TieredLayer(idx, shared, host_tier if idx in in_host_ram else shared.tier))
        elif layer_type in ("sliding_attention", "chunked_attention"):
            layers.append(DynamicSlidingWindowLayer(**kwargs))
        elif layer_type == "dummy":
            layers.append(DummyLayer())
        else:
            raise ValueError(
                f"TieredCache handles full and sliding-window attention layers; layer {idx} of "
                f"{config.model_type} is {layer_type!r}: use cache.strategy=dynamic for this model"
            )
    full = tuple(i for i, layer_type in enumerate(layer_types) if layer_type == "full_attention")
    if placement is not None and placement.full_attention_layers != full:
        raise ValueError(
            f"the placement covers full-attention layers {list(placement.full_attention_layers)}, but "
            f"{config.model_type} has {list(full)}: plan it from this model's kv_shape"
        )
    return layers
