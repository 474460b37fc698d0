"""The engine-neutral KV page format (``kvfs-kv/1``) and the model geometry it records.

One page holds the keys and values of one layer for one chunk of tokens. It is a valid
`safetensors <https://huggingface.co/docs/safetensors>`_ file, readable by any engine::

    bytes 0..7     little-endian u64 N: length of the JSON header
    bytes 8..8+N   JSON header, padded with spaces so that 8 + N is a multiple of 4096
    4096*k ...     tensor data: "key" then "value", each [kv_heads, tokens, head_dim],
                   C order, in the recorded dtype (F32, F16 or BF16)

The tensor data starts at a 4 KiB-aligned offset, so the file can be mmap-ed, read with
O_DIRECT into an aligned buffer, or read by cuFile straight into GPU memory. The header's
``__metadata__`` (all strings) records the format, the model geometry, the chunk's token
range, its prefix hash and ``digest``, ``blake3:<hex>`` of the tensor data, so a copy of a
page anywhere (a plain directory, an rsync of one) can be checked; kvfs stores the same
dictionary as the page's attrs, so the object API can check a page without reading it.

Nothing here imports torch: the format is bytes, shapes and dtype names.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import blake3

from .._aligned import ALIGN, aligned_buffer, round_up
from .._errors import CorruptPage, KvfsError

__all__ = [
    "DTYPES",
    "FORMAT",
    "Geometry",
    "GeometryMismatch",
    "PageHeader",
    "PageLayout",
    "parse_header",
    "check_page",
]

FORMAT = "kvfs-kv/1"
#: dtype name -> (safetensors dtype, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
}
_ST_TO_NAME = {st: name for name, (st, _) in DTYPES.items()}
# Read this much first: the header of any page kvfs writes fits (it is padded to 4 KiB).
HEADER_READ = ALIGN
DIGEST = "digest"
_DIGEST_ALGO = "blake3:"
# Stands in for the digest until the data is in: same length, so the header's length and
# the data's offset do not change when the real one is written.
_NO_DIGEST_YET = _DIGEST_ALGO + "0" * 64


def _digest(data: memoryview) -> str:
    return _DIGEST_ALGO + blake3.blake3(data).hexdigest()


class GeometryMismatch(KvfsError, ValueError):
    """A KV page (or a session's pages) belongs to a model of another geometry or identity."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """What makes two KV caches interchangeable: the model and the shape of its KV.

    ``model_id`` must identify the weights (a hub name and revision, or any fingerprint):
    two models with the same shapes but other weights produce other KV.
    """

    model_id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"unsupported KV dtype {self.dtype!r}; kvfs-kv/1 stores {', '.join(DTYPES)}"
            )
        for name in ("layers", "kv_heads", "head_dim", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not self.model_id or "\n" in self.model_id:
            raise ValueError("model_id must be a non-empty single-line string")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def layer_bytes_per_token(self) -> int:
        """Bytes of keys plus values of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV of one token across all layers (the field's "KV per token")."""
        return self.layers * self.layer_bytes_per_token

    def describe(self) -> str:
        return (
            f"{self.model_id}: {self.layers} layers x {self.kv_heads} kv heads x "
            f"{self.head_dim} dims, {self.dtype}, {self.chunk_tokens}-token chunks"
        )

    def to_attrs(self) -> dict[str, str]:
        """The geometry as string attrs (``model`` is the key kvfs shows per session)."""
        return {
            "format": FORMAT,
            "model": self.model_id,
            "layers": str(self.layers),
            "kv_heads": str(self.kv_heads),
            "head_dim": str(self.head_dim),
            "dtype": self.dtype,
            "chunk_tokens": str(self.chunk_tokens),
        }

    @classmethod
    def from_attrs(cls, attrs: dict[str, str]) -> Geometry:
        """Parse :meth:`to_attrs` output. Raises GeometryMismatch on a foreign format."""
        if attrs.get("format") != FORMAT:
            raise GeometryMismatch(f"not a {FORMAT} page (format={attrs.get('format')!r})")
        try:
            return cls(
                model_id=attrs["model"],
                layers=int(attrs["layers"]),
                kv_heads=int(attrs["kv_heads"]),
                head_dim=int(attrs["head_dim"]),
                dtype=attrs["dtype"],
                chunk_tokens=int(attrs["chunk_tokens"]),
            )
        except (KeyError, ValueError) as e:
            raise GeometryMismatch(f"{FORMAT} page with unreadable geometry: {e}") from e

    def check_same(self, other: Geometry, where: str) -> None:
        """Raise GeometryMismatch, naming every differing field, unless ``other`` (what
        ``where`` holds) is this geometry (the model's here)."""
        if other == self:
            return
        diffs = [
            f"{f}: {getattr(other, f)!r} there, {getattr(self, f)!r} here"
            for f in ("model_id", "layers", "kv_heads", "head_dim", "dtype", "chunk_tokens")
            if getattr(other, f) != getattr(self, f)
        ]
        raise GeometryMismatch(
            f"{where} holds KV of another model geometry ({'; '.join(diffs)});"
            f" refusing to mix it with {self.describe()}"
        )


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Where things are in a page of ``tokens`` tokens: build it, then fill :meth:`buffer`."""

    header: bytes
    data_start: int
    tensor_bytes: int

    @classmethod
    def build(cls, g: Geometry, tokens: int, metadata: dict[str, str]) -> PageLayout:
        """The layout of a page; its header's digest is a placeholder until :meth:`seal`
        (a page written unsealed has no digest: it is checked for size only)."""
        metadata = {**metadata, DIGEST: _NO_DIGEST_YET}
        shape = [g.kv_heads, tokens, g.head_dim]
        n = g.kv_heads * tokens * g.head_dim * g.itemsize
        st = DTYPES[g.dtype][0]
        head = {
            "__metadata__": metadata,
            "key": {"dtype": st, "shape": shape, "data_offsets": [0, n]},
            "value": {"dtype": st, "shape": shape, "data_offsets": [n, 2 * n]},
        }
        js = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
        start = round_up(8 + len(js))
        js += b" " * (start - 8 - len(js))
        return cls(header=struct.pack("<Q", len(js)) + js, data_start=start, tensor_bytes=n)

    @property
    def size(self) -> int:
        return self.data_start + 2 * self.tensor_bytes

    @property
    def key_offset(self) -> int:
        return self.data_start

    @property
    def value_offset(self) -> int:
        return self.data_start + self.tensor_bytes

    def buffer(self) -> memoryview:
        """A fresh 4 KiB-aligned buffer of :attr:`size` bytes with the header written."""
        buf = aligned_buffer(self.size)
        buf[: self.data_start] = self.header
        return buf

    def seal(self, buf: memoryview) -> dict[str, str]:
        """Write the digest of the tensor data now in ``buf`` into its header; returns the
        page's metadata (its attrs), digest included."""
        n = struct.unpack("<Q", self.header[:8])[0]
        head = json.loads(self.header[8 : 8 + n])
        meta: dict[str, str] = head["__metadata__"]
        meta[DIGEST] = _digest(buf[self.data_start : self.size])
        js = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
        js += b" " * (n - len(js))
        if len(js) != n:
            raise AssertionError("the sealed header changed length")
        buf[8 : 8 + n] = js
        return meta


@dataclass(frozen=True, slots=True)
class PageHeader:
    """A parsed page header: metadata, dtype, shape, and absolute byte offsets of K and V."""

    metadata: dict[str, str]
    dtype: str
    shape: tuple[int, int, int]
    key_offset: int
    value_offset: int
    tensor_bytes: int

    @property
    def tokens(self) -> int:
        return self.shape[1]


def parse_header(buf: bytes | memoryview, where: str = "page") -> PageHeader:
    """Parse and validate the header of a kvfs-kv/1 page held (at least its header) in ``buf``.

    Raises CorruptPage if the bytes are not a well-formed page of this format, and
    GeometryMismatch if they are a safetensors file of another kind.
    """
    mv = memoryview(buf)
    if len(mv) < 8:
        raise CorruptPage(f"{where}: {len(mv)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > 100_000_000 or 8 + n > len(mv):
        raise CorruptPage(f"{where}: header length {n} does not fit the {len(mv)} bytes read")
    try:
        head = json.loads(bytes(mv[8 : 8 + n]))
        meta = head.pop("__metadata__", {})
        k, v = head.pop("key"), head.pop("value")
        if not isinstance(meta, dict) or not all(
            isinstance(x, str) for kv in meta.items() for x in kv
        ):
            raise TypeError("its metadata is not a table of strings")
    # (RecursionError: JSON nested some thousand deep, which a few KiB of header can be)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptPage(f"{where}: not a {FORMAT} page ({e})") from e
    if meta.get("format") != FORMAT:
        raise GeometryMismatch(f"{where}: not a {FORMAT} page (format={meta.get('format')!r})")
    if head:  # any other tensor: a safetensors reader would look for its bytes past the end
        raise CorruptPage(f"{where}: tensors {sorted(head)} besides key and value")
    start = 8 + n
    try:  # (the digest covers the tensor data only: a damaged header is caught here)
        if k["dtype"] != v["dtype"] or k["shape"] != v["shape"] or k["dtype"] not in _ST_TO_NAME:
            raise CorruptPage(f"{where}: key and value tensors disagree or have an unknown dtype")
        kb, ke = k["data_offsets"]
        vb, ve = v["data_offsets"]
        shape = tuple(k["shape"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptPage(f"{where}: a damaged {FORMAT} header ({e!r})") from e
    # Counts and offsets are JSON integers, as safetensors has them: a float (2.0, 1e3,
    # Infinity), a string or a bool was read as one (or raised OverflowError), a float
    # offset passed the checks below and failed as a slice index, and negative dimensions
    # whose product is positive passed as a shape.
    if not all(_is_count(x) for x in (*shape, kb, ke, vb, ve)):
        raise CorruptPage(f"{where}: a shape or offset that is not a non-negative integer")
    if len(shape) != 3:
        raise CorruptPage(f"{where}: tensors of shape {list(shape)}; expected 3 dimensions")
    name = _ST_TO_NAME[k["dtype"]]
    nbytes = shape[0] * shape[1] * shape[2] * DTYPES[name][1]
    if (kb, ke, vb, ve) != (0, nbytes, nbytes, 2 * nbytes):
        raise CorruptPage(f"{where}: tensor offsets do not match their shapes")
    return PageHeader(
        metadata=meta,
        dtype=name,
        shape=shape,  # type: ignore[arg-type]
        key_offset=start + kb,
        value_offset=start + vb,
        tensor_bytes=nbytes,
    )


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0


def check_page(h: PageHeader, page: memoryview, where: str = "page", *, digest: bool) -> None:
    """Check that ``page`` (all of it, as read) is as long as its header ``h`` says and,
    with ``digest``, that its tensor data matches the header's digest. Raises CorruptPage.
    (A page written before pages carried a digest has none: only its size is checked.)"""
    end = h.value_offset + h.tensor_bytes
    if len(page) != end:
        raise CorruptPage(f"{where}: {len(page)} bytes; its header describes a page of {end}")
    want = h.metadata.get(DIGEST)
    if not digest or want is None or want == _NO_DIGEST_YET:
        return
    if not want.startswith(_DIGEST_ALGO):
        raise CorruptPage(f"{where}: unknown digest {want[:20]!r}")
    if _digest(page[h.key_offset : end]) != want:
        raise CorruptPage(f"{where}: the KV data does not match the page's digest")
