"""durable.read_regular: a regular file's bytes, and nothing else ever opened or followed."""

from __future__ import annotations

import os

import pytest

from hpc_ddp.common.durable import NotRegularFile, TooLarge, read_regular


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 1 << 20, (1 << 20) + 3, 3 << 20])
@pytest.mark.parametrize("listed", [False, True])
def test_reads_whole_files(tmp_path, size, listed):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert read_regular(tmp_path / "f", listed=listed) == data
    assert read_regular(tmp_path / "f", limit=size, listed=listed) == data


def test_limit_refuses_before_reading(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 11)
    with pytest.raises(TooLarge):
        read_regular(tmp_path / "f", limit=10)
    with pytest.raises(TooLarge):
        read_regular(tmp_path / "f", limit=10, listed=True)


def test_files_that_lie_about_their_size_are_read_to_the_end():
    # /proc files say 0 bytes and hold more: read to their end, within the limit
    data = read_regular("/proc/self/status")
    assert data.startswith(b"Name:") and data.endswith(b"\n")
    with pytest.raises(TooLarge):
        read_regular("/proc/self/status", limit=10)


@pytest.mark.parametrize("listed", [False, True])
def test_links_fifos_and_folders_are_refused(tmp_path, listed):
    (tmp_path / "target").write_bytes(b"secret")
    os.symlink(tmp_path / "target", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name in ("link", "fifo", "dir"):
        with pytest.raises(NotRegularFile):  # a FIFO is never waited on, a link never followed
            read_regular(tmp_path / name, listed=listed)


def test_relative_to_a_folder_descriptor(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_regular("f", dir_fd=fd, listed=True) == b"abc"
    finally:
        os.close(fd)
