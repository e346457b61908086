"""Token data for the built-in trainer's `gpt` model: nanoGPT's format, a flat uint16 file of token ids per
split (`train.bin`, `val.bin`), memory-mapped, never read whole. Sample i is the i-th window of
`block_size` tokens and its targets, the same window shifted by one: the windows do not overlap, so an
epoch is every token once, and the trainer's samplers (exact resume, another world size) work on window
indices as they do on images. `meta.json` says the vocabulary size (nanoGPT's meta.pkl is a pickle:
not read)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hpc_ddp.common.errors import SpecError

__all__ = ["TokenWindows", "vocab_size"]


class TokenWindows(torch.utils.data.Dataset):
    """(x, y) int64 tensors of `block_size` tokens from a uint16 token file; y is x shifted by one."""

    def __init__(self, path: Path, block_size: int):
        self.path, self.block_size = Path(path), block_size
        try:
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        except (OSError, ValueError) as exc:  # missing, or empty (memmap cannot map 0 bytes)
            raise SpecError(f"cannot read the token file {self.path}: {exc}",
                            hint="make one with `hpc-ddp make-dataset tokens DIR`, or point data_dir at a folder "
                                 "with train.bin and val.bin (uint16, as nanoGPT's prepare.py writes)") from None
        if len(self.tokens) <= block_size:
            raise SpecError(f"the token file {self.path} holds {len(self.tokens)} tokens, not more than one window "
                            f"of block_size {block_size}", hint="use a smaller block_size, or more data")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.block_size
        window = torch.from_numpy(self.tokens[start:start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


def vocab_size(root: Path, given: int | None) -> int:
    """`num_classes` where the job file sets it, else meta.json's vocab_size; one line where neither says."""
    if given:
        return given
    try:
        meta = json.loads((Path(root) / "meta.json").read_text())
        value = meta.get("vocab_size") if isinstance(meta, dict) else None
    except (OSError, ValueError):
        value = None
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 65536:
        raise SpecError(f"{root} has no meta.json with a vocab_size from 2 to 65536, and the job file sets no "
                        "num_classes", hint="set num_classes = VOCAB_SIZE in [train] (50257 for GPT-2's tokens)")
    return value
