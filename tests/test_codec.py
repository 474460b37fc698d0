"""The archive codec: every codec and value size round-trips any bytes, and the byte-shuffle
is the plain definition (plane j holds byte j of every value, the tail is kept as is)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs import CorruptPage
from kvfs._codec import CODECS, decode, encode, shuffle, unshuffle


def planes(data: bytes, elem: int) -> bytes:
    n = len(data) // elem
    return b"".join(data[j : n * elem : elem] for j in range(elem)) + data[n * elem :]


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4099), elem=st.sampled_from([1, 2, 4, 8]))
def test_shuffle_is_byte_planes_and_unshuffle_inverts_it(data: bytes, elem: int) -> None:
    shuffled = bytes(shuffle(data, elem))
    assert shuffled == planes(data, elem)
    assert unshuffle(shuffled, elem) == data


@settings(max_examples=100, deadline=None)
@given(
    data=st.binary(max_size=9000),
    codec=st.sampled_from(sorted(CODECS)),
    elem=st.sampled_from([2, 4]),
)
def test_every_codec_round_trips(data: bytes, codec: str, elem: int) -> None:
    obj, used = encode(data, codec=codec, elem=elem)
    assert used == codec
    assert bytes(decode(obj)) == data


@pytest.mark.parametrize("codec", ["zstd", "zstd+shuffle"])
def test_a_corrupted_object_does_not_decode(codec: str) -> None:
    data = bytes(range(256)) * 64
    obj, _ = encode(data, codec=codec, elem=2)
    with pytest.raises(CorruptPage):
        decode(obj[: len(obj) // 2])  # truncated
    with pytest.raises(CorruptPage):
        decode(b"x" * len(obj))  # no header
    size = int.from_bytes(obj[8:16], "little")
    # A header that says more or less than it holds; one far more (a high byte flipped)
    # asked for a buffer that large first, and failed with ENOMEM, an OSError
    for wrong in (size - 1, size + 1, size | 1 << 62):
        with pytest.raises(CorruptPage, match="header says"):
            decode(obj[:8] + wrong.to_bytes(8, "little") + obj[16:])


@pytest.mark.parametrize("codec", ["raw", "auto"])
def test_an_object_holds_its_page_once_while_it_is_made(codec: str) -> None:
    """An incompressible page (``auto`` stores it raw) was copied twice into its object
    (``hdr + bytes(payload)``): a spill worker held a 512 MiB page three times, and
    concurrent jobs of 1 GiB pages had the workers killed for memory. Measured with
    tracemalloc: the page itself, made before, is not counted."""
    import os
    import tracemalloc

    size = 32 << 20
    data = os.urandom(size)
    tracemalloc.start()
    try:
        obj, used = encode(data, codec=codec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert used == "raw" and bytes(decode(obj)) == data
    assert peak < 1.2 * size, peak / size  # the object (before: 2.0)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_decoding_a_large_object_holds_its_page_once(codec: str) -> None:
    """A raw object's body was copied into a buffer of its own, and a zstd object's page
    was decompressed into a bytes then copied into the buffer: a restore held the page
    twice beside its compressed object. Measured with tracemalloc: the object, made
    before, is not counted."""
    import os
    import tracemalloc

    size = 32 << 20
    # incompressible halves between runs of zeros: zstd shrinks it, auto would keep zstd
    data = (os.urandom(1 << 16) + bytes(1 << 16)) * (size >> 17)
    obj, used = encode(data, codec=codec)
    tracemalloc.start()
    try:
        page = decode(obj)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert used == codec and page == data
    # raw: a view of the object (before: 1.0); zstd: the page (before: 2.0)
    assert peak < (0.2 if codec == "raw" else 1.2) * size, peak / size
