"""Where a layer's sealed (full) blocks live once they are off the device: host RAM or block files.

Sealing and loading run on the IO thread. The disk tier sends bf16 to the numpy-only block store as int16
bits: numpy has no bfloat16, and the codec only needs widths.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

import numpy as np
import torch

from storage.kvblocks import BlockCodec, KVBlockStore

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SAME_WIDTH_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a numpy array of integers of the same width, sharing its memory."""
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()]).numpy()


class HostTier:
    """Sealed blocks stay as host tensors (pinned on CUDA: they were the layer's RAM tail)."""

    keeps_blocks_in_ram = True

    def seal(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> object:
        return keys, values

    def load(self, payload: object, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return payload  # type: ignore[return-value]

    def discard_from(self, payload: object) -> None:
        pass

    def close(self) -> None:
        pass


class DiskTier:
    """Sealed blocks are encoded once and appended to the layer's file in the offload dir."""

    keeps_blocks_in_ram = False

    def __init__(self, directory: str | Path, codec: BlockCodec) -> None:
        self.store = KVBlockStore(directory, codec)

    def seal(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> object:
        return tuple(self.store.append(layer_idx, _bits(kv.contiguous())) for kv in (keys, values))

    def load(self, payload: object, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        np_dtype = np.dtype(_SAME_WIDTH_NP[dtype.itemsize])  # the bits back as `dtype`, `shape`
        keys, values = (torch.from_numpy(self.store.read(ref, np_dtype)).view(dtype).reshape(shape)
                        for ref in payload)  # type: ignore[attr-defined]
        return keys, values

    def load_into(self, payload: object, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Decode straight into CPU windows of the layer's buffer (no intermediate copy); returns the
        bytes decoded into them. The host tier has none: its `load` is the stored block itself, which
        the reader copies with every other row's (layer_store.read_all)."""
        return sum(self.store.read_into(ref, _bits(kv)) for ref, kv in zip(payload, (keys, values)))  # type: ignore

    def discard_from(self, payload: object) -> None:
        self.store.truncate(payload[0])  # type: ignore[index]

    def close(self) -> None:
        self.store.close()


Tier: TypeAlias = HostTier | DiskTier
