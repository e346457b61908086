"""The gpt model's data and model (data.tokens, datagen.write_tokens, trainer.models.GPT) and its [train]
keys: nanoGPT's uint16 files, windows and their shifted targets, the vocabulary from meta.json, a causal
decoder, and the settings refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpc_ddp.common.errors import SpecError
from hpc_ddp.data.datagen import write_tokens
from hpc_ddp.data.tokens import TokenWindows, vocab_size
from hpc_ddp.spec.trainconfig import parse_train
from hpc_ddp.trainer.models import GPT, build_model


def test_tokens_are_written_as_nanogpt_reads_them_and_cut_into_shifted_windows(tmp_path):
    root = write_tokens(tmp_path / "tok", train=1000, test=100, vocab=50)
    tokens = np.memmap(root / "train.bin", dtype=np.uint16, mode="r")  # nanoGPT's own reading
    assert len(tokens) == 1000 and tokens.max() < 50 and (root / "val.bin").stat().st_size == 200
    assert vocab_size(root, None) == 50 and vocab_size(root, 7) == 7
    windows = TokenWindows(root / "train.bin", 16)
    assert len(windows) == 999 // 16
    x, y = windows[3]
    assert x.dtype == torch.int64 and x.shape == (16,)
    assert x.tolist() == tokens[48:64].tolist() and y.tolist() == tokens[49:65].tolist()
    with pytest.raises(IndexError):
        windows[len(windows)]
    assert write_tokens(tmp_path / "tok", train=1000, test=100, vocab=50) == root  # the same: kept


def test_the_text_is_learnable_not_noise(tmp_path):
    """Each token has 4 likely successors: the successor's entropy is about ln 4, far below ln(vocab)."""
    root = write_tokens(tmp_path / "tok", train=20000, test=100, vocab=64)
    t = np.fromfile(root / "train.bin", dtype="<u2").astype(int)
    pairs = np.zeros((64, 64))
    np.add.at(pairs, (t[:-1], t[1:]), 1)
    p = pairs / pairs.sum(1, keepdims=True).clip(1)
    entropy = -(pairs.sum(1) / pairs.sum() * np.where(p > 0, p * np.log(p.clip(1e-12)), 0).sum(1)).sum()
    assert entropy < np.log(4) + 0.4 < np.log(64)


def test_missing_or_short_token_files_and_no_vocabulary_are_one_line(tmp_path):
    with pytest.raises(SpecError, match="cannot read the token file") as e:
        TokenWindows(tmp_path / "train.bin", 8)
    assert "make-dataset tokens" in e.value.hint
    (tmp_path / "train.bin").write_bytes(np.arange(5, dtype="<u2").tobytes())
    with pytest.raises(SpecError, match="holds 5 tokens, not more than one window of block_size 8"):
        TokenWindows(tmp_path / "train.bin", 8)
    with pytest.raises(SpecError, match="no meta.json") as e:
        vocab_size(tmp_path, None)
    assert "num_classes" in e.value.hint


def test_the_decoder_is_causal_and_gives_logits_in_cross_entropys_layout():
    torch.manual_seed(0)
    model = build_model("gpt", num_classes=40, in_channels=1, image_size=12,
                        decoder={"n_layer": 2, "n_head": 4, "n_embd": 32})
    assert isinstance(model, GPT) and len(model.blocks) == 2
    idx = torch.randint(0, 40, (3, 12))
    logits = model(idx)
    assert logits.shape == (3, 40, 12) and logits.is_contiguous()
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 40
    assert torch.equal(model(changed)[:, :, :8], logits[:, :, :8])  # the future does not leak backwards
    torch.nn.functional.cross_entropy(logits, idx).backward()


def test_the_gpt_settings():
    cfg = parse_train({"dataset": "tokens", "data_dir": "tok", "model": "gpt", "strategy": "fsdp", "block_size": 32})
    assert (cfg.strategy, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == ("fsdp", 32, 2, 2, 64)
    assert parse_train({}).strategy == "ddp"
    for table, said in (({"dataset": "tokens", "model": "gpt"}, "needs data_dir (make one with `hpc-ddp make-dataset "
                                                                 "tokens`)"),
                        ({"dataset": "tokens", "data_dir": "t"}, "the gpt model reads dataset = \"tokens\""),
                        ({"model": "gpt"}, "the gpt model reads"),
                        ({"dataset": "tokens", "data_dir": "t", "model": "gpt", "n_embd": 30, "n_head": 4},
                         "n_embd 30 is not a multiple of n_head 4"),
                        ({"strategy": "zero3"}, "strategy")):
        with pytest.raises(ValueError, match=None) as e:
            parse_train(table)
        assert said in str(e.value), (table, str(e.value))
