"""Engine integrations: KV caches of inference engines as kvfs pages.

The engine-neutral parts live here and need nothing beyond kvfs itself: the ``kvfs-kv/1``
page format (:class:`Geometry`, :class:`PageLayout`, :func:`parse_header`), the prefix hash
chain (:func:`chunk_names`) and the page sources (:class:`StorePages` for the object API,
:class:`DirectoryPages` for the mount or any directory, :class:`FastPathPages` for the
``gds`` fast path).

Engine modules import their engine and are imported explicitly:

* :mod:`kvfs.integrations.transformers` (``pip install kvfs[engines]``): save and load
  Hugging Face transformers caches.
"""

from ._chain import chunk_names, geometry_seed
from ._format import (
    FORMAT,
    Geometry,
    GeometryMismatch,
    PageHeader,
    PageLayout,
    parse_header,
)
from ._sources import (
    DirectoryPages,
    FastPathPages,
    PageSource,
    PageStat,
    StorePages,
    as_source,
    read_file_header,
)

__all__ = [
    "FORMAT",
    "DirectoryPages",
    "FastPathPages",
    "Geometry",
    "GeometryMismatch",
    "PageHeader",
    "PageLayout",
    "PageSource",
    "PageStat",
    "StorePages",
    "as_source",
    "chunk_names",
    "geometry_seed",
    "parse_header",
    "read_file_header",
]
