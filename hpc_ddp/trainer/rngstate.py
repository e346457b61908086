"""Every random stream a rank draws from (python, numpy, torch, CUDA), captured and restored as tensors
and plain numbers, so a checkpoint holding them loads with `torch.load(weights_only=True)`."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """This process's RNG streams (loadable weights-only)."""
    version, keys, gauss = random.getstate()
    _name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {"python": {"version": version, "keys": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
             "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                       "has_gauss": int(np_has_gauss), "cached": float(np_cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what `capture_rng` captured (CUDA streams only where CUDA is there now)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(k) for k in py["keys"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
