"""``open_objectstore(url, **opts)``: one entry point for every backend.

URL forms::

    file:///var/lib/kvfs-archive          a directory (created if missing; also file://localhost/...)
    s3://bucket                           AWS S3, region and credentials from the standard chain
    s3://bucket/some/prefix?endpoint=http://127.0.0.1:9000&region=us-east-1&addressing=path

Query parameters and keyword options are the same names (keywords win): ``endpoint`` (or
``endpoint_url``), ``region``, ``addressing`` (auto/path/virtual), ``profile``,
``deadline`` (seconds the retry helper keeps trying), ``open_deadline``,
``multipart_threshold``, ``part_size``, ``sse`` (AES256, aws:kms, aws:kms:dsse) with
``sse_kms_key_id``, ``storage_class`` (of page objects), ``checksums`` (``when_required``
for a server that refuses boto3's default checksums); for ``file://``, ``create`` and
``durable`` (true/false). An unknown option is an error. Credentials never go in the URL, nor in the
endpoint's.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ._abc import ObjectStore
from ._file import FileStore
from ._retry import Backoff
from ._s3 import S3Store

__all__ = ["open_objectstore", "parse_url"]

_INT = {"multipart_threshold", "part_size", "max_connections"}
_FLOAT = {"deadline", "open_deadline", "connect_timeout", "read_timeout"}
_BOOL = {"create", "durable"}


def _bool(name: str, v: object) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"option {name} must be true or false, not {v!r}")


def parse_url(url: str) -> tuple[str, str, dict[str, Any]]:
    """``(scheme, location, options)`` of an archive URL. Raises ValueError."""
    u = urlsplit(url)
    if u.fragment or url.endswith("#"):  # (s3://b/team#1 was the archive s3://b/team)
        raise ValueError(
            f"{url!r}: an archive URL cannot hold '#' (it starts a fragment: the prefix and "
            "the options after it were dropped)"
        )
    if u.scheme == "file":
        # ``file://localhost/x`` is ``/x`` (RFC 8089), not the relative ``localhost/x``
        # that ``file://dir/x`` names
        host = "" if u.netloc.lower() == "localhost" else u.netloc
        path = unquote(host + u.path)
        if not path:
            raise ValueError(f"{url!r}: file:// needs a directory")
        return "file", path, dict(parse_qsl(u.query))
    if u.scheme == "s3":
        if u.username or u.password:
            raise ValueError(
                "credentials may not be given in the archive URL; use the "
                "standard chain (environment, ~/.aws, instance role)"
            )
        if not u.netloc:
            raise ValueError(f"{url!r}: s3:// needs a bucket")
        opts: dict[str, Any] = dict(parse_qsl(u.query))
        if "endpoint" in opts:
            opts["endpoint_url"] = opts.pop("endpoint")
        opts["prefix"] = u.path.strip("/")
        return "s3", u.netloc, opts
    raise ValueError(f"unsupported archive URL {url!r}: use file:///DIR or s3://BUCKET[/PREFIX]")


async def open_objectstore(url: str, *, verify: bool = True, **opts: Any) -> ObjectStore:
    """Open the object store at ``url``; see the module docstring for URLs and options.
    ``verify=False`` is for a process that opens a store another one has already opened
    (kvfs's upload workers): no S3 bucket check (its first request retries up to
    ``deadline`` instead), and no sweep of a ``file://`` directory's crash leftovers (which
    would remove the other process's in-flight puts).

    Raises ValueError (malformed URL or option) and ArchiveUnavailable (unreachable endpoint,
    missing bucket or directory, access denied) with the cause named.
    """
    scheme, where, qopts = parse_url(url)
    merged = {**qopts, **{k: v for k, v in opts.items() if v is not None}}
    if "endpoint" in merged:
        merged["endpoint_url"] = merged.pop("endpoint")
    for k in list(merged):
        if k in _INT or k in _FLOAT:
            try:
                merged[k] = (int if k in _INT else float)(merged[k])
            except (TypeError, ValueError):
                raise ValueError(f"option {k} must be a number, not {merged[k]!r}") from None
        elif k in _BOOL:
            merged[k] = _bool(k, merged[k])
    deadline = merged.pop("deadline", None)
    backoff = Backoff(deadline=deadline) if deadline is not None else None
    if scheme == "file":
        merged.pop("prefix", None)
        unknown = set(merged) - {"create", "durable"}
        if unknown:
            raise ValueError(f"unknown file:// option(s): {', '.join(sorted(unknown))}")
        return await FileStore.open(where, backoff=backoff, sweep=verify, **merged)
    known = {
        "prefix",
        "endpoint_url",
        "region",
        "addressing",
        "profile",
        "open_deadline",
        "connect_timeout",
        "read_timeout",
        "multipart_threshold",
        "part_size",
        "max_connections",
        "sse",
        "sse_kms_key_id",
        "storage_class",
        "checksums",
    }
    unknown = set(merged) - known
    if unknown:
        raise ValueError(f"unknown S3 option(s): {', '.join(sorted(unknown))}")
    return await S3Store.open(where, backoff=backoff, verify=verify, **merged)
