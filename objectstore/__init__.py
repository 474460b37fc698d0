"""Archive object stores: one small async interface (:class:`ObjectStore`), an
S3-compatible implementation (:class:`S3Store`) and a directory one (:class:`FileStore`)."""

from ._abc import ObjectNotFound, ObjectStore, check_key
from ._file import FileStore
from ._open import open_objectstore, parse_url
from ._retry import Backoff, retry
from ._s3 import S3Store

__all__ = [
    "Backoff",
    "FileStore",
    "ObjectNotFound",
    "ObjectStore",
    "S3Store",
    "check_key",
    "open_objectstore",
    "parse_url",
    "retry",
]
