"""S3-compatible object store over boto3 (AWS, MinIO, Ceph RGW, moto...).

Credentials come from boto3's standard chain (environment, shared config/credentials files
and profiles, container and instance metadata); kvfs never reads, logs or prints them, and
refuses an endpoint URL that carries any (``http://user:secret@host``). botocore makes one
attempt per call (``total_max_attempts=1``) so that the one helper in :mod:`._retry`
decides, with backoff, jitter and a deadline. Every boto3 call runs in a worker thread
under :func:`~objectstore._abc.archive_threads`, never trio's default limiter.
"""

from __future__ import annotations

import builtins
import contextlib
import email.utils
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import boto3
import botocore.config
import botocore.exceptions as bce
import trio
import urllib3.exceptions

from kvfs._errors import ArchiveAccessDenied, ArchiveUnavailable, CorruptPage

from ._abc import (
    KEY_MAX,
    ObjectNotFound,
    ObjectStore,
    archive_threads,
    check_key,
    one_error_nursery,
)
from ._retry import Backoff, retry

__all__ = ["S3Store"]

log = logging.getLogger("kvfs.archive")

T = TypeVar("T")
MiB = 1 << 20
#: seconds the abort of a failed multipart put is tried again while the server answers
#: with a temporary error (a cancelled put's caller waits for it)
ABORT_DEADLINE = 10.0
_TEMP_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "ConditionalRequestConflict",
    "OperationAborted",
    "503",
    "500",
    "502",
    "504",
}
_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "403",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "AccountProblem",
}

#: error codes S3 answers with a 4xx, which no retry changes: botocore turns a 200 whose
#: body is an error (a CompleteMultipartUpload that fails once MinIO or Ceph RGW has sent
#: its 200 and then spaces to keep the connection; AWS may too) into a 500 of that code
_CLIENT_CODES = {
    "InvalidPart",
    "InvalidPartOrder",
    "EntityTooSmall",
    "EntityTooLarge",
    "NoSuchUpload",
    "NoSuchKey",
    "NoSuchBucket",
    "InvalidArgument",
    "InvalidRequest",
    "MalformedXML",
    "PreconditionFailed",
    "InvalidStorageClass",
}

#: Refusals of the credentials themselves, whatever the request: the cause, and the two
#: places such a key is usually set (the environment, or the shared credentials file).
_WRONG_KEY = {
    "InvalidAccessKeyId": (
        "the access key id is unknown to the server (InvalidAccessKeyId)",
        "AWS_ACCESS_KEY_ID, or aws_access_key_id",
    ),
    "SignatureDoesNotMatch": (
        "the secret access key is wrong (SignatureDoesNotMatch: the request's signature "
        "does not match the access key id's secret)",
        "AWS_SECRET_ACCESS_KEY, or aws_secret_access_key",
    ),
}


def _code(e: BaseException) -> str:
    if isinstance(e, bce.ClientError):
        return str(e.response.get("Error", {}).get("Code", ""))
    return ""


#: what :attr:`S3Store._lacks` holds for a server that refuses If-None-Match on a put
_CONDITIONAL = "conditional writes"
#: ... and for one that answers ListMultipartUploads 501 (some S3 gateways)
_UPLOAD_LISTING = "listing incomplete uploads"


def _not_implemented(e: BaseException) -> bool:
    return _status(e) == 501 or _code(e) == "NotImplemented"


def _multipart_etag(parts: dict[int, str]) -> str | None:
    """The ETag S3 (and MinIO, Ceph RGW) gives the object these parts' ETags complete: the
    MD5 of their MD5s, then the count. None where a part's ETag is no MD5 (SSE-KMS)."""
    try:
        md5s = b"".join(bytes.fromhex(parts[n].strip('"')) for n in sorted(parts))
    except ValueError:
        return None
    return f"{hashlib.md5(md5s, usedforsecurity=False).hexdigest()}-{len(parts)}"


def _tls_hint(e: BaseException) -> str:
    """What to add to a failed TLS verification: an on-premises server's certificate is
    mostly signed by a private CA, which the system's store does not hold."""
    if not (isinstance(e, bce.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(e)):
        return ""
    return (
        " (a server whose certificate a CA of your own signed: set AWS_CA_BUNDLE to that "
        "CA's certificate, a PEM file, in the daemon's environment)"
    )


def _skew_hint(e: BaseException, cause: bool = True) -> str:
    """What to add to the error of a call the server refused because it found this host's
    clock too far from its own (S3 allows 15 minutes), ``e`` itself or (``cause``) the last
    error of calls retried until their deadline: RequestTimeTooSkewed alone says nothing of
    a clock to a reader."""
    refusal = e.__cause__ if cause else e
    if refusal is None or _code(refusal) != "RequestTimeTooSkewed":
        return ""
    return (
        " (this host's clock is more than 15 minutes from the server's, which S3 refuses: "
        "set it right, with NTP)"
    )


def _checksum_config(checksums: str | None) -> dict[str, str]:
    """botocore Config arguments for the ``checksums`` option: both directions, requests'
    checksums and the responses' validation (a GET asks for the object's checksum with a
    header of its own). A botocore before 1.36 knows neither, and sends neither."""
    if (
        checksums is None
        or "request_checksum_calculation" not in botocore.config.Config.OPTION_DEFAULTS
    ):
        return {}
    return {"request_checksum_calculation": checksums, "response_checksum_validation": checksums}


def _refuses_checksums(e: BaseException, client: Any) -> bool:
    """Whether ``e`` is a server refusing the additional checksums a client sent (400 or
    501 naming a checksum, a trailer, aws-chunked or the payload's SHA-256): Backblaze B2
    says "Unsupported header 'x-amz-checksum-crc32'", older Ceph RGW
    XAmzContentSHA256Mismatch. Not where the client already sends them only when required."""
    if _status(e) not in (400, 501):
        return False
    if getattr(client.meta.config, "request_checksum_calculation", None) == "when_required":
        return False
    text = f"{_code(e)} {_message(e)}".lower()
    return any(w in text for w in ("checksum", "trailer", "chunked", "sha256"))


def _message(e: BaseException) -> str:
    if isinstance(e, bce.ClientError):
        return str(e.response.get("Error", {}).get("Message", ""))
    return ""


def _status(e: BaseException) -> int:
    if isinstance(e, bce.ClientError):
        return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


class MalformedReply(ConnectionError):
    """A 2xx reply without what every S3 reply of its kind carries (a listing's
    ``IsTruncated``, an object's ``ContentLength``, a put's ``ETag``): cut off in its headers,
    or not from an S3 server. botocore parses such a reply into an empty result (a listing
    with no keys, an object of 0 bytes), which must never be taken as the answer: it is
    temporary, retried until the deadline, then ArchiveUnavailable."""


def _need(reply: dict[str, Any], call: str, *fields: str) -> dict[str, Any]:
    missing = [f for f in fields if f not in reply]
    if missing:
        raise MalformedReply(
            f"the reply to {call} has no {', '.join(missing)}: cut off, or not from an S3 server"
        )
    return reply


def _server_time(reply: dict[str, Any]) -> float:
    """The server's clock at ``reply`` (its ``Date`` header), else this host's."""
    date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    with contextlib.suppress(TypeError, ValueError):
        return email.utils.parsedate_to_datetime(date).timestamp()
    return time.time()


#: S3's server-side encryption modes (SSE-C, keys the client holds, is not offered: every
#: read would need the key)
SSE_MODES = ("AES256", "aws:kms", "aws:kms:dsse")
#: storage classes whose objects a GET returns at once (MinIO and Ceph name their own
#: classes: any other name is passed through, but for these)
UNREADABLE_CLASSES = ("GLACIER", "DEEP_ARCHIVE")


def _encryption(sse: str | None, kms_key: str | None) -> dict[str, str]:
    """The PutObject arguments for ``sse`` (and its KMS key). Raises ValueError."""
    if sse is None:
        if kms_key is not None:
            raise ValueError("option sse_kms_key_id needs sse=aws:kms (or aws:kms:dsse)")
        return {}
    if sse not in SSE_MODES:
        raise ValueError(f"option sse must be one of {', '.join(SSE_MODES)}, not {sse!r}")
    if kms_key is not None and not sse.startswith("aws:kms"):
        raise ValueError(f"option sse_kms_key_id needs sse=aws:kms (or aws:kms:dsse), not {sse}")
    return {"ServerSideEncryption": sse, **({"SSEKMSKeyId": kms_key} if kms_key else {})}


def _readable_class(name: str) -> str:
    """``name`` upper-cased, refused where a GET of such an object fails until it is
    restored by hand (kvfs reads its objects directly). Raises ValueError."""
    cls = name.strip().upper()
    if not cls:
        raise ValueError("option storage_class is empty")
    if cls in UNREADABLE_CLASSES:
        raise ValueError(
            f"storage_class {cls}: such objects must be restored by hand before a GET "
            "returns them, and kvfs reads its objects directly; use GLACIER_IR, "
            "STANDARD_IA, ONEZONE_IA or INTELLIGENT_TIERING"
        )
    return cls


def is_temporary(e: BaseException) -> bool:
    """Connection trouble (with the endpoint, or an HTTP proxy on the way), timeouts, 5xx
    (but 501, not implemented, and an error S3 gives with a 4xx, as in a 200's body), 408
    (a request timed out) and throttling are temporary; the rest permanent."""
    if isinstance(
        e,
        (
            bce.EndpointConnectionError,
            bce.ConnectionClosedError,
            bce.ConnectTimeoutError,
            # an HTTP proxy (HTTP_PROXY, HTTPS_PROXY) down or restarting, as the endpoint
            bce.ProxyConnectionError,
            bce.ReadTimeoutError,
            bce.HTTPClientError,
            # a response body cut off mid-stream (connection reset, short read, stall)
            bce.ResponseStreamingError,
            bce.IncompleteReadError,
            # ... or damaged on the way: its bytes do not match the checksum the server
            # stored with the object (read again, it comes whole)
            bce.FlexibleChecksumError,
            urllib3.exceptions.ProtocolError,
            urllib3.exceptions.ReadTimeoutError,
            ConnectionError,
            TimeoutError,
        ),
    ):
        return not isinstance(e, ArchiveUnavailable)
    if isinstance(e, bce.ClientError):
        if _not_implemented(e) or _code(e) in _CLIENT_CODES or _code(e) in _DENIED:
            return False  # (no retry will have it, whatever the status)
        # (408: a reverse proxy's, to a request whose body came too slowly; 429: throttling)
        return _code(e) in _TEMP_CODES or _status(e) >= 500 or _status(e) in (408, 429)
    return False


def check_endpoint(url: str) -> None:
    """Refuse an endpoint URL that is not ``http(s)://host[:port][/path]`` or that carries
    credentials: they would be printed wherever the endpoint is (errors, ``kvfs stats``),
    and botocore would not use them anyway. The message never repeats the URL."""
    try:
        u = urlsplit(url)
        u.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError as e:
        raise ValueError(f"the S3 endpoint is not a valid URL ({e})") from None
    if "@" in unquote(u.netloc):
        raise ValueError(
            "the S3 endpoint may not carry credentials (user:secret@host); use the standard "
            "chain (environment, ~/.aws, instance role)"
        )
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(
            f"the S3 endpoint must be http://HOST[:PORT] or https://HOST[:PORT], not {url!r}"
        )


class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix``. Open with :meth:`open`."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str,
        *,
        endpoint: str | None,
        backoff: Backoff,
        multipart_threshold: int,
        part_size: int,
        encryption: dict[str, str] | None = None,
        cold_class: str | None = None,
        in_flight: builtins.set[str] | None = None,
        lacks: builtins.set[str] | None = None,
    ) -> None:
        self._client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}" + (f" at {endpoint}" if endpoint else "")
        self.endpoint = endpoint
        self.backoff = backoff
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        #: PutObject / CreateMultipartUpload arguments asking for server-side encryption
        self.encryption = dict(encryption or {})
        #: the storage class of objects put ``cold`` (None: the bucket's default)
        self.cold_class = cold_class
        #: upload ids of this process's multipart puts in flight (shared with the stores
        #: at_prefix makes): never a stale upload to abort, whatever the server's clock says
        self._in_flight = in_flight if in_flight is not None else builtins.set()
        #: what this server turned out not to do ("conditional writes"; shared likewise)
        self._lacks = lacks if lacks is not None else builtins.set()

    @classmethod
    async def open(
        cls,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing: str = "auto",
        profile: str | None = None,
        backoff: Backoff | None = None,
        open_deadline: float = 15.0,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        max_connections: int = 32,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        storage_class: str | None = None,
        checksums: str | None = None,
        verify: bool = True,
    ) -> S3Store:
        """Connect and (unless not ``verify``) check that the bucket exists and is accessible.

        ``addressing`` is ``path``, ``virtual`` or ``auto``. ``checksums`` is
        ``when_required`` for a server that refuses the additional checksums boto3 sends
        by default since 1.36 (``when_supported``; None: boto3's own setting, from
        ``AWS_REQUEST_CHECKSUM_CALCULATION`` or ``~/.aws/config``). Raises
        ArchiveUnavailable naming the cause: unreachable endpoint, missing bucket, denied
        access, no credentials.
        """
        if addressing not in ("auto", "path", "virtual"):
            raise ValueError(f"addressing must be auto, path or virtual, not {addressing!r}")
        if checksums not in (None, "when_supported", "when_required"):
            raise ValueError(
                f"checksums must be when_supported or when_required, not {checksums!r}"
            )
        if part_size < 5 * MiB or multipart_threshold < part_size:
            raise ValueError("part_size must be >= 5 MiB and multipart_threshold >= part_size")
        if endpoint_url is not None:
            check_endpoint(endpoint_url)
        encryption = _encryption(sse, sse_kms_key_id)
        if storage_class is not None:
            storage_class = _readable_class(storage_class)

        def make(read_timeout: float) -> Any:
            cfg = botocore.config.Config(
                s3={"addressing_style": addressing},
                # one attempt per call: ``retry`` below is the only retry loop
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=min(connect_timeout, read_timeout),
                read_timeout=read_timeout,
                max_pool_connections=max_connections,
                **_checksum_config(checksums),
            )
            session = boto3.session.Session(profile_name=profile, region_name=region)
            return session.client("s3", endpoint_url=endpoint_url, config=cfg)

        try:
            client = await trio.to_thread.run_sync(make, read_timeout, limiter=archive_threads())
        except (bce.ProfileNotFound, ValueError) as e:
            raise ArchiveUnavailable(f"cannot configure S3 client: {e}") from e
        self = cls(
            client,
            bucket,
            prefix,
            endpoint=endpoint_url,
            backoff=backoff or Backoff(deadline=60.0),
            multipart_threshold=multipart_threshold,
            part_size=part_size,
            encryption=encryption,
            cold_class=storage_class,
        )
        if not verify:
            return self
        where = f"bucket {bucket!r}" + (f" at {endpoint_url}" if endpoint_url else "")
        # The check gives up after about ``open_deadline`` even on an endpoint that accepts
        # connections and never answers: its client waits at most that long for a reply.
        checker = client
        if open_deadline < read_timeout:
            checker = await trio.to_thread.run_sync(
                make, max(open_deadline, 0.1), limiter=archive_threads()
            )
        try:

            async def check() -> None:
                try:
                    await self._thread(checker.head_bucket, Bucket=bucket)
                except bce.ClientError as e:
                    raise await self._with_reason(e, checker) from None
                # any server answers a HEAD with 200; an S3 listing has a shape to check
                kw: dict[str, Any] = {"Bucket": bucket, "MaxKeys": 1}
                if self.prefix:
                    kw["Prefix"] = self.prefix
                await self._thread(
                    self._checked(checker.list_objects_v2, "ListObjectsV2", "IsTruncated"), **kw
                )

            await retry(
                check,
                is_temporary=is_temporary,
                what=f"checking {where}",
                backoff=Backoff(self.backoff.base, self.backoff.cap, open_deadline),
            )
        except ArchiveUnavailable as e:
            raise ArchiveUnavailable(
                f"cannot reach the S3 endpoint for {where}: {e.__cause__}{_skew_hint(e)}"
            ) from e.__cause__
        except bce.NoCredentialsError as e:
            raise ArchiveUnavailable(
                f"no credentials for {where}: none found in the standard "
                "chain (environment, config files, instance role)"
            ) from e
        except bce.ClientError as e:
            raise self._permanent(e, "checking the bucket", "s3:ListBucket") from e
        except bce.BotoCoreError as e:
            raise ArchiveUnavailable(f"cannot use {where}: {e}{_tls_hint(e)}") from e
        finally:
            if checker is not client:
                await trio.to_thread.run_sync(checker.close, limiter=archive_threads())
        return self

    def at_prefix(self, prefix: str) -> S3Store:
        """The same bucket and client (connections, credentials) under another prefix; the
        bucket was checked when this store opened."""
        return type(self)(
            self._client,
            self.bucket,
            prefix,
            endpoint=self.endpoint,
            backoff=self.backoff,
            multipart_threshold=self.multipart_threshold,
            part_size=self.part_size,
            encryption=self.encryption,
            cold_class=self.cold_class,
            in_flight=self._in_flight,
            lacks=self._lacks,
        )

    async def _with_reason(self, e: bce.ClientError, client: Any = None) -> bce.ClientError:
        """``e``, or, where ``e`` is a HEAD's 403, the error of a request that says why when
        the credentials themselves are refused. A reply to a HEAD has no body, so no error
        code: a wrong secret key or an unknown access key id read as a missing permission
        (AccessDenied). A one-key listing is refused for the same reason, with a body; any
        other answer to it (a listing, AccessDenied, no answer) leaves ``e`` as it is."""
        if _status(e) != 403 or _code(e) not in ("", "403"):
            return e
        kw: dict[str, Any] = {"Bucket": self.bucket, "MaxKeys": 1}
        if self.prefix:
            kw["Prefix"] = self.prefix
        listing = functools.partial((client or self._client).list_objects_v2, **kw)
        try:
            # a read: given up when the caller is cancelled, as the HEAD would have been
            await trio.to_thread.run_sync(
                listing, abandon_on_cancel=True, limiter=archive_threads()
            )
        except bce.ClientError as f:
            # (a wrong key, or a clock too far off: either refuses every request alike)
            return f if _code(f) in _WRONG_KEY or _code(f) == "RequestTimeTooSkewed" else e
        except Exception:  # (no better reason to give: the HEAD's answer stands)
            return e
        return e

    def _permanent(
        self, e: bce.ClientError, what: str, needs: str, key: str | None = None
    ) -> ArchiveUnavailable:
        """The error for a reply that retrying cannot change. A refusal (403) is
        ArchiveAccessDenied naming the permission ``needs`` and what it is needed on (the
        object ``key``, else the bucket): the archive answered, it is no outage. One of the
        credentials themselves (a wrong secret key, an unknown access key id) names that
        instead, and where it is set."""
        code, status = _code(e), _status(e)
        if code == "RequestTimeTooSkewed":  # (a refusal, but of the clock: no permission helps)
            return ArchiveUnavailable(f"{what} on {self.url}: {code}{_skew_hint(e, cause=False)}")
        if code in ("NoSuchBucket",) or (status == 404 and "bucket" in what.lower()):
            why = f"bucket {self.bucket!r} does not exist"
        elif code in _WRONG_KEY:
            cause, setting = _WRONG_KEY[code]
            return ArchiveAccessDenied(
                f"{what} on {self.url}: {cause}; fix {setting} in ~/.aws/credentials (in "
                "the profile that AWS_PROFILE or the archive URL's profile= names)"
            )
        elif code in _DENIED or status == 403:
            on = (
                f"s3://{self.bucket}/{self._key(key)}"
                if key is not None
                else f"bucket {self.bucket!r}"
            )
            hint = ""
            if needs == "s3:GetObject":  # S3 answers a missing object 403 without ListBucket
                hint = " (or s3:ListBucket, if the object is missing: S3 then says 403, not 404)"
            return ArchiveAccessDenied(
                f"{what} on {self.url}: access denied ({code or status}): it needs {needs} "
                f"on {on}{hint}; check the credentials and the bucket and IAM policies"
            )
        else:
            why = f"{code or status}: {_message(e)}".strip()
            text = f"{code} {_message(e)}".lower()
            if self.encryption and (status == 501 or "encrypt" in text or "kms" in text):
                why += (
                    " (the archive URL asks for server-side encryption, sse="
                    f"{self.encryption['ServerSideEncryption']}, which this server does not "
                    "do: remove the option, or set the server's encryption up (MinIO: a KMS))"
                )
            elif _refuses_checksums(e, self._client):
                why += (
                    " (this server refuses the additional checksums boto3 sends by default "
                    "since 1.36, as older S3-compatible servers do: add checksums=when_required "
                    "to the archive URL, or set AWS_REQUEST_CHECKSUM_CALCULATION=when_required)"
                )
        return ArchiveUnavailable(f"{what} on {self.url}: {why}")

    @staticmethod
    async def _thread(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await trio.to_thread.run_sync(
            functools.partial(fn, *args, **kw), limiter=archive_threads()
        )

    async def _call(
        self, what: str, fn: Callable[..., T], *args: Any, reads: bool = False, **kw: Any
    ) -> T:
        """``fn(*args, **kw)`` in a thread, retried until the deadline. A call that only
        ``reads`` (get, head, list) is given up at once when its caller is cancelled (a
        reader interrupted, a bounded cleanup's time up): on an endpoint that accepts
        connections and never answers it held the caller for the whole read timeout (60 s).
        Its thread finishes on its own, changing nothing. A call that writes or deletes is
        always waited for: given up, it could still land after a later one."""

        async def attempt() -> T:
            call = functools.partial(fn, *args, **kw)
            return await trio.to_thread.run_sync(
                call, abandon_on_cancel=reads, limiter=archive_threads()
            )

        try:
            return await retry(
                attempt,
                is_temporary=is_temporary,
                backoff=self.backoff,
                what=f"{what} on {self.url}",
            )
        except ArchiveUnavailable as e:
            if not _skew_hint(e):
                raise
            raise ArchiveUnavailable(f"{e}{_skew_hint(e)}") from e.__cause__
        except bce.NoCredentialsError as e:
            raise ArchiveUnavailable(f"{what}: no credentials in the standard chain") from e
        except bce.BotoCoreError as e:
            raise ArchiveUnavailable(f"{what} on {self.url}: {e}{_tls_hint(e)}") from e

    @staticmethod
    def _checked(fn: Callable[..., dict[str, Any]], call: str, *fields: str) -> Callable[..., Any]:
        """``fn`` whose reply must carry ``fields`` (:class:`MalformedReply` otherwise)."""

        def call_checked(*args: Any, **kw: Any) -> dict[str, Any]:
            return _need(fn(*args, **kw), call, *fields)

        return call_checked

    def _key(self, key: str) -> str:
        full = self.prefix + check_key(key)
        if len(full.encode("utf-8", "surrogateescape")) > KEY_MAX:  # (the prefix counts too)
            raise ValueError(
                f"object key {full[:60]!r}... is over {KEY_MAX} bytes with the prefix "
                f"{self.prefix!r} (S3's limit)"
            )
        return full

    async def get(self, key: str, *, into: memoryview | bytearray | None = None) -> bytes | int:
        def fetch() -> bytes:
            r = _need(
                self._client.get_object(Bucket=self.bucket, Key=self._key(key)),
                "GetObject",
                "ContentLength",
            )
            body = r["Body"]
            try:
                # A body cut off mid-stream raises here (urllib3 or botocore errors, all
                # temporary): the whole GET is retried.
                data: bytes = body.read()
            finally:
                body.close()
            if len(data) != r["ContentLength"]:
                raise MalformedReply(
                    f"GetObject {key}: {len(data)} of its {r['ContentLength']} bytes came"
                )
            return data

        try:
            data = await self._call(f"get {key}", fetch, reads=True)
        except ArchiveUnavailable as e:
            if not isinstance(e.__cause__, bce.FlexibleChecksumError):
                raise
            # Read again until the deadline, it never matched: damaged where it is stored,
            # not on the way. (As the archive down, one such object made a whole restore
            # give up on the archive.)
            raise CorruptPage(
                f"archive object {key!r} in {self.url} does not match the checksum the server "
                f"stored with it, read again until the deadline: damaged where it is stored "
                f"({e.__cause__})"
            ) from e
        except bce.ClientError as e:
            if _code(e) in ("NoSuchKey", "404") or _status(e) == 404 and _code(e) != "NoSuchBucket":
                raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
            raise self._permanent(e, f"get {key}", "s3:GetObject", key) from e
        if into is None:
            return data
        dest = memoryview(into).cast("B")
        if len(dest) < len(data):
            raise ValueError(
                f"buffer of {len(dest)} bytes is smaller than object {key!r} ({len(data)} bytes)"
            )
        dest[: len(data)] = data
        return len(data)

    async def put(
        self, key: str, data: bytes | memoryview, *, if_absent: bool = False, cold: bool = False
    ) -> bool:
        conditional = if_absent and _CONDITIONAL not in self._lacks
        try:
            return await self._put(key, data, if_absent, cold, conditional=conditional)
        except bce.ClientError as e:
            if not (conditional and _not_implemented(e)):
                raise self._permanent(e, f"put {key}", "s3:PutObject", key) from e
            refusal = _code(e) or _status(e)
        # A server without S3's conditional writes (AWS before August 2024, some gateways)
        # refuses If-None-Match: every spill failed. Put as it can take. A 501 that this put
        # meets too was not the condition's (MinIO's to sse= without a KMS), and nor is one
        # whose object was there already (the plain put was not tried): not recorded then.
        try:
            written = await self._put(key, data, if_absent, cold, conditional=False)
        except bce.ClientError as e:
            raise self._permanent(e, f"put {key}", "s3:PutObject", key) from e
        if written and _CONDITIONAL not in self._lacks:
            self._lacks.add(_CONDITIONAL)
            log.warning(
                "%s does not take conditional puts (If-None-Match: %s): objects named by "
                "their content are checked for first instead",
                self.url,
                refusal,
            )
        return written

    async def _put(
        self, key: str, data: bytes | memoryview, if_absent: bool, cold: bool, *, conditional: bool
    ) -> bool:
        """:meth:`put`, with If-None-Match where ``conditional``, else a HEAD first where
        ``if_absent``. Raises ClientError (but for a failed precondition: False)."""
        k = self._key(key)
        # (as for a multipart put: the objects put if absent are named by their content,
        # so a race between hosts stores the same bytes twice at worst)
        if if_absent and not conditional and await self.exists(key):
            return False
        cond: dict[str, Any] = {"IfNoneMatch": "*"} if conditional else {}
        # (how the object is kept: encryption, and for a page's object its storage class)
        how: dict[str, Any] = {
            **self.encryption,
            **({"StorageClass": self.cold_class} if cold and self.cold_class else {}),
        }
        try:
            if len(data) > self.multipart_threshold:
                return await self._put_multipart(key, k, memoryview(data).cast("B"), cond, how)
            await self._call(
                f"put {key}",
                self._checked(self._client.put_object, "PutObject", "ETag"),
                Bucket=self.bucket,
                Key=k,
                Body=bytes(data),
                **cond,
                **how,
            )
            return True
        except bce.ClientError as e:
            if if_absent and (_code(e) == "PreconditionFailed" or _status(e) == 412):
                return False
            raise

    async def _put_multipart(
        self, key: str, k: str, mv: memoryview, cond: dict, how: dict[str, Any]
    ) -> bool:
        if cond and await self.exists(key):
            return False
        up = await self._call(
            f"start multipart {key}",
            self._checked(
                self._client.create_multipart_upload, "CreateMultipartUpload", "UploadId"
            ),
            Bucket=self.bucket,
            Key=k,
            **how,
        )
        uid = up["UploadId"]
        self._in_flight.add(uid)
        parts: dict[int, str] = {}

        async def one(n: int, off: int) -> None:
            r = await self._call(
                f"put part {n} of {key}",
                self._checked(self._client.upload_part, "UploadPart", "ETag"),
                Bucket=self.bucket,
                Key=k,
                UploadId=uid,
                PartNumber=n,
                Body=bytes(mv[off : off + self.part_size]),
            )
            parts[n] = r["ETag"]

        try:
            limit = trio.CapacityLimiter(4)

            async def limited(n: int, off: int) -> None:
                async with limit:
                    await one(n, off)

            async with one_error_nursery() as nursery:
                for i, off in enumerate(range(0, len(mv), self.part_size)):
                    nursery.start_soon(limited, i + 1, off)
            try:
                await self._call(
                    f"complete multipart {key}",
                    self._client.complete_multipart_upload,
                    Bucket=self.bucket,
                    Key=k,
                    UploadId=uid,
                    MultipartUpload={
                        "Parts": [{"PartNumber": n, "ETag": parts[n]} for n in sorted(parts)]
                    },
                    **cond,
                )
            except bce.ClientError as e:
                # A completion whose answer was lost (a reset connection) is tried again,
                # which AWS answers as the first; MinIO and Ceph RGW, whose upload is gone
                # once completed, say NoSuchUpload: the spill failed, the object stored.
                # Ours if its ETag is the one these parts make (S3's multipart ETag).
                ours = _multipart_etag(parts)
                if _code(e) != "NoSuchUpload" or ours is None or await self._etag(key) != ours:
                    raise
            return True
        except BaseException:
            # The original error matters; what this misses, a sweep aborts a day later
            # (abort_stale_uploads), or the bucket's lifecycle rule.
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self._abort(key, k, uid)
            raise
        finally:
            self._in_flight.discard(uid)

    async def _abort(self, key: str, k: str, uid: str) -> None:
        """Abort the multipart upload ``uid`` of a put that failed, tried again for up to
        ABORT_DEADLINE while the server answers with a temporary error (503 SlowDown, 5xx):
        it is there, and the parts would be billed until a sweep. Not while it cannot be
        reached (the put's own error may be that): the put's caller would wait for nothing.
        Raises what the last attempt raised."""

        async def abort() -> None:
            await self._thread(
                self._client.abort_multipart_upload, Bucket=self.bucket, Key=k, UploadId=uid
            )

        await retry(
            abort,
            is_temporary=lambda e: isinstance(e, bce.ClientError) and is_temporary(e),
            backoff=Backoff(
                self.backoff.base, self.backoff.cap, min(self.backoff.deadline, ABORT_DEADLINE)
            ),
            what=f"abort multipart upload of {key} on {self.url}",
        )

    async def abort_stale_uploads(self, older_than: float, prefix: str = "") -> int:
        # Ages by the server's clock: its ``Date`` on the listing against each upload's
        # ``Initiated`` (this host's clock may be off; hosts sharing the bucket compare
        # nothing else either).
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        gone = 0
        if _UPLOAD_LISTING in self._lacks:
            return 0
        while True:
            try:
                r = await self._call(
                    "list incomplete multipart uploads",
                    self._client.list_multipart_uploads,
                    reads=True,
                    **kw,
                )
            except bce.ClientError as e:
                if _not_implemented(e):
                    # (some gateways: every sweep, at each start and hourly, was an error)
                    if _UPLOAD_LISTING not in self._lacks:
                        self._lacks.add(_UPLOAD_LISTING)
                        log.warning(
                            "%s does not list incomplete multipart uploads (%s): those of "
                            "killed puts are left to the bucket's lifecycle rule "
                            "(AbortIncompleteMultipartUpload: docs/archive.md), if it has one",
                            self.url,
                            _code(e) or _status(e),
                        )
                    return 0
                raise self._permanent(
                    e, "list incomplete multipart uploads", "s3:ListBucketMultipartUploads"
                ) from e
            now = _server_time(r)
            uploads = r.get("Uploads", ())
            for up in uploads:
                if now - up["Initiated"].timestamp() <= older_than:
                    continue
                if up["UploadId"] in self._in_flight:  # (its server's clock is wrong)
                    continue
                key = up["Key"][len(self.prefix) :]
                try:
                    await self._call(
                        f"abort multipart upload of {key}",
                        self._client.abort_multipart_upload,
                        Bucket=self.bucket,
                        Key=up["Key"],
                        UploadId=up["UploadId"],
                    )
                except bce.ClientError as e:
                    if _code(e) == "NoSuchUpload" or _status(e) == 404:
                        continue  # completed or aborted meanwhile, by its host or another
                    raise self._permanent(
                        e, f"abort multipart upload of {key}", "s3:AbortMultipartUpload", key
                    ) from e
                gone += 1
            if not r.get("IsTruncated"):
                return gone
            # The next page starts after the markers the server names; one that names none
            # (a KeyError ended the sweep) after the last upload listed. A server whose
            # markers do not move on would be asked for the same page for ever.
            last = uploads[-1] if uploads else {}
            after = (
                r.get("NextKeyMarker") or last.get("Key"),
                r.get("NextUploadIdMarker") or last.get("UploadId"),
            )
            if not after[0] or after == (kw.get("KeyMarker"), kw.get("UploadIdMarker")):
                log.warning(
                    "%s listed incomplete multipart uploads truncated, with nowhere to go on "
                    "from (after %s): the rest are left to the next sweep",
                    self.url,
                    after[0] or "nothing",
                )
                return gone
            kw["KeyMarker"] = after[0]
            if after[1]:
                kw["UploadIdMarker"] = after[1]
            else:  # (the key's other uploads, if any, are left to the next sweep)
                kw.pop("UploadIdMarker", None)

    async def exists(self, key: str) -> bool:
        return await self.modified(key) is not None

    async def _etag(self, key: str) -> str | None:
        """The object's ETag (unquoted), None when it is missing or has none."""
        r = await self._head(key)
        return None if r is None else str(r.get("ETag", "")).strip('"') or None

    async def modified(self, key: str) -> float | None:
        r = await self._head(key)
        return None if r is None else float(r["LastModified"].timestamp())

    async def _head(self, key: str) -> dict[str, Any] | None:
        """The object's HEAD, None when it is missing. Raises ArchiveUnavailable."""
        try:
            r: dict[str, Any] = await self._call(
                f"head {key}",
                self._checked(self._client.head_object, "HeadObject", "LastModified"),
                Bucket=self.bucket,
                Key=self._key(key),
                reads=True,
            )
        except bce.ClientError as e:
            if _status(e) == 404 or _code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            why = await self._with_reason(e)
            raise self._permanent(why, f"head {key}", "s3:GetObject", key) from why
        return r

    async def delete(self, key: str) -> None:
        try:
            await self._call(
                f"delete {key}", self._client.delete_object, Bucket=self.bucket, Key=self._key(key)
            )
        except bce.ClientError as e:
            if _status(e) != 404 or _code(e) == "NoSuchBucket":
                raise self._permanent(e, f"delete {key}", "s3:DeleteObject", key) from e

    async def list(self, prefix: str = "") -> AsyncIterator[str]:  # type: ignore[override]
        async for obj in self._listing(prefix):
            yield obj["Key"][len(self.prefix) :]

    async def list_versions(self, prefix: str = "") -> builtins.list[tuple[str, str]]:
        # An ETag changes with the content (single-part: its MD5; multipart: per part).
        return [(o["Key"][len(self.prefix) :], str(o["ETag"])) async for o in self._listing(prefix)]

    async def _listing(self, prefix: str) -> AsyncIterator[dict[str, Any]]:
        token: str | None = None
        full = self.prefix + prefix
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                kw["ContinuationToken"] = token
            try:
                r = await self._call(
                    f"list {prefix or '(all)'}",
                    self._checked(self._client.list_objects_v2, "ListObjectsV2", "IsTruncated"),
                    reads=True,
                    **kw,
                )
            except bce.ClientError as e:
                raise self._permanent(e, f"list {prefix or '(all)'}", "s3:ListBucket") from e
            for obj in r.get("Contents", ()):
                yield obj
            if not r.get("IsTruncated"):
                return
            last, token = token, r.get("NextContinuationToken")
            if not token or token == last:
                # (a server without ListObjectsV2 answers as ListObjects does: a KeyError
                # escaped, and one that repeats its token would be listed for ever)
                raise ArchiveUnavailable(
                    f"list {prefix or '(all)'} on {self.url}: the server says the listing "
                    "goes on but gives no new continuation token: it does not do "
                    "ListObjectsV2, which kvfs needs"
                )

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await trio.to_thread.run_sync(client.close, limiter=archive_threads())
