"""The OS CSPRNG fetched in blocks (dpsql.privacy.samplers.OsRandomBlocks): every byte handed
out is the CSPRNG's own, in order, handed out once; threads never share a block; a forked
child never draws its parent's bytes."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from dpsql.privacy import samplers
from dpsql.privacy.samplers import OsRandomBlocks, SecureNoise, random_bits


class _Counter:
    """A stand-in for os.urandom: bytes 0, 1, 2, ... (mod 256), each fetch continuing."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.next = 0
        self.lock = threading.Lock()

    def __call__(self, n: int) -> bytes:
        with self.lock:
            start, self.next = self.next, self.next + n
            self.calls.append(n)
        return bytes((start + i) % 256 for i in range(n))


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> _Counter:
    source = _Counter()
    monkeypatch.setattr(samplers.os, "urandom", source)
    return source


def test_bytes_are_the_source_stream_in_order_each_once(counter: _Counter) -> None:
    blocks = OsRandomBlocks()
    sizes = [1, 7, 64, 3, 2048, 5, 1000, 1000, 1000, 33] * 3
    out = [blocks(n) for n in sizes]
    assert all(n == OsRandomBlocks.BLOCK for n in counter.calls)  # whole blocks only
    # where each piece must come from: consecutive within a block; a piece that does not fit
    # in the rest of its block starts the next block (the rest is dropped, never reused)
    block, pos, expected = -1, OsRandomBlocks.BLOCK, []
    for n in sizes:
        if pos + n > OsRandomBlocks.BLOCK:
            block, pos = block + 1, 0
        start = block * OsRandomBlocks.BLOCK + pos
        expected.append(bytes((start + i) % 256 for i in range(n)))
        pos += n
    assert out == expected
    assert len(counter.calls) == block + 1


def test_a_large_request_goes_straight_to_the_source(counter: _Counter) -> None:
    blocks = OsRandomBlocks()
    big = OsRandomBlocks.BLOCK // 2 + 1
    assert len(blocks(big)) == big
    assert counter.calls == [big]


def test_threads_never_share_a_block(counter: _Counter) -> None:
    blocks = OsRandomBlocks()
    got: dict[int, bytes] = {}

    def draw(i: int) -> None:
        got[i] = b"".join(blocks(16) for _ in range(8))

    threads = [threading.Thread(target=draw, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(counter.calls) == 4  # one block each
    firsts = {got[i][0] for i in got}
    # each thread's bytes start at its own block (blocks start at multiples of BLOCK, and the
    # counter's byte there is BLOCK * k mod 256 = 0): they are four different blocks
    assert firsts == {0}
    fetched = sorted(counter.calls)
    assert fetched == [OsRandomBlocks.BLOCK] * 4


def test_a_new_process_or_forget_drops_the_block(
    counter: _Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = OsRandomBlocks()
    blocks(8)
    blocks.forget()
    blocks(8)
    assert len(counter.calls) == 2
    real = os.getpid()
    monkeypatch.setattr(samplers.os, "getpid", lambda: real + 1)  # as in a forked child
    blocks(8)
    assert len(counter.calls) == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_draws_other_bytes() -> None:
    samplers.os_random_bytes(8)  # the parent holds a block
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next bytes, to the parent
        try:
            os.write(write, samplers.os_random_bytes(32))
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 32)
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 32 and child != samplers.os_random_bytes(32)


def test_random_bits_and_secure_noise_use_the_blocks(counter: _Counter) -> None:
    assert OsRandomBlocks()(2) == bytes([0, 1])
    for k in (1, 8, 62, 64):
        v = random_bits(k)
        assert 0 <= v < 1 << k
    assert SecureNoise()._random_bytes is samplers.os_random_bytes
    draws = SecureNoise().discrete_laplace(4.0, 5)
    assert draws.dtype == np.int64 and draws.shape == (5,)
