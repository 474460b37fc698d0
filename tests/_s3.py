"""A real S3-compatible server for tests: moto's HTTP server on loopback, plus a TCP proxy
in front of it that a test can take down (connections refused), bring back, or slow down.

Used by the session fixture ``s3_server`` in conftest.py. Nothing here patches a client:
every request the code under test makes is HTTP over a socket.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import http.server
import json
import os
import random
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import boto3
from moto.server import ThreadedMotoServer

__all__ = [
    "OlderS3Server",
    "S3Server",
    "SilentServer",
    "TcpProxy",
    "iam_credentials",
    "running_moto",
]

#: Fake credentials moto accepts; set in the environment so the standard chain finds them.
FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class S3Server:
    endpoint: str

    def client(self, endpoint: str | None = None):  # noqa: ANN201 - boto3 client type
        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"kvfs-test-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        out: list[str] = []
        for page in (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        ):
            out += [o["Key"] for o in page.get("Contents", ())]
        return sorted(out)


@contextmanager
def running_moto() -> Iterator[S3Server]:
    old = {k: os.environ.get(k) for k in FAKE_ENV}
    os.environ.update(FAKE_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def iam_credentials(server: S3Server, statements: list[dict]) -> Iterator[None]:
    """Run the block as a new IAM user whose policy is ``statements``, with moto checking
    every request's credentials and permissions (a refusal is a real 403 over HTTP). The
    user's keys are in the environment meanwhile, for the standard chain (and the upload
    workers started then); the test's own ``testing`` keys are unknown to IAM, so a call
    with them is refused too until the block ends."""
    from moto.core.authorization import enable_iam_authentication

    from kvfs._uploader import shutdown_workers

    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1")
    user = f"kvfs-test-{uuid.uuid4().hex[:12]}"
    iam.create_user(UserName=user)
    policy = {"Version": "2012-10-17", "Statement": statements}
    iam.put_user_policy(UserName=user, PolicyName="kvfs", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    old = {k: os.environ.get(k) for k in names}
    shutdown_workers()  # workers started before run with the old keys
    os.environ.update(dict(zip(names, (key["AccessKeyId"], key["SecretAccessKey"]), strict=True)))
    try:
        with enable_iam_authentication():
            yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutdown_workers()  # nor may later tests' uploads run with this user's keys


class SilentServer:
    """An endpoint that accepts connections, reads each request's head and never answers
    (a hung server, a black-holed load balancer). ``requests`` counts the heads read, and
    ``lines`` holds their request lines (``GET /bucket/key HTTP/1.1``); ``close()`` resets
    every connection, so the clients waiting on it give up."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self.requests = 0
        self.lines: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(c)
            threading.Thread(target=self._read_head, args=(c,), daemon=True).start()

    def _read_head(self, c: socket.socket) -> None:
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head:
                data = c.recv(65536)
                if not data:
                    return
                head += data
            with self._lock:
                self.requests += 1
                self.lines.append(head.split(b"\r\n", 1)[0].decode("latin-1"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


def _port_outside_ephemeral_range() -> int:
    """A free loopback port below the kernel's ephemeral range. While the proxy is down,
    clients retrying against a port inside that range could be given that very port as
    their own local port (a TCP self-connect), and ``up()`` would then fail with
    EADDRINUSE."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low <= 2048:  # no room below the range: any free port
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        probe.close()
        return port
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1025, low // 2), low)
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            probe.close()
    raise RuntimeError("no free loopback port below the ephemeral range")


class TcpProxy:
    """Forward 127.0.0.1:<port> to a target; ``down()`` refuses and cuts connections,
    ``up()`` serves again on the same port, ``delay`` sleeps per forwarded chunk;
    ``sent`` counts the bytes forwarded from clients to the target; ``cut_responses(n,
    times)`` closes the next ``times`` connections whose response passes ``n`` bytes right
    there (a body dropped mid-stream); ``corrupt_responses(n, times)`` flips every bit of
    byte ``n`` of the next ``times`` connections' responses (damaged on the way)."""

    def __init__(self, target: tuple[str, int], delay: float = 0.0) -> None:
        self.target = target
        self.delay = delay
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.sent = 0
        self._cut = (0, 0)  # (after this many response bytes, this many more times)
        self._flip = (0, 0)  # (the response byte at this offset, this many more times)
        self.port = _port_outside_ephemeral_range()
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def cut_responses(self, after: int, times: int = 1) -> None:
        with self._lock:
            self._cut = (after, times)

    def corrupt_responses(self, at: int, times: int = 1) -> None:
        with self._lock:
            self._flip = (at, times)

    def down(self) -> None:
        with self._lock:
            s, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if s is not None:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            s.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(self.target)
            except OSError:
                c.close()
                continue
            with self._lock:
                if self._listener is not s:
                    c.close()
                    u.close()
                    return
                self._conns += [c, u]
            threading.Thread(target=self._pipe, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, upstream: bool = False) -> None:
        forwarded = 0
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                if self.delay:
                    time.sleep(self.delay)
                if not upstream:
                    with self._lock:
                        at, left = self._flip
                        flip = left > 0 and forwarded <= at < forwarded + len(data)
                        if flip:
                            self._flip = (at, left - 1)
                    if flip:
                        i = at - forwarded
                        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
                    with self._lock:
                        after, times = self._cut
                        cut = times > 0 and forwarded + len(data) > after
                        if cut:
                            self._cut = (after, times - 1)
                    if cut:
                        b.sendall(data[: after - forwarded])
                        break
                    forwarded += len(data)
                b.sendall(data)
                if upstream:
                    with self._lock:
                        self.sent += len(data)
        except OSError:
            pass
        finally:
            for x in (a, b):
                with contextlib.suppress(OSError):
                    x.shutdown(socket.SHUT_RDWR)
            # Each socket is the source of exactly one pipe: that pipe closes it.
            a.close()
            with self._lock:
                if a in self._conns:
                    self._conns.remove(a)

    def close(self) -> None:
        self.down()


#: (status, S3 error code, message) of an answer that refuses a request
Answer = tuple[int, str, str]

#: the request headers of the integrity checksums boto3 sends by default since 1.36
_CHECKSUM_HEADERS = ("x-amz-checksum-", "x-amz-sdk-checksum-", "x-amz-trailer")


def _refuse_checksums(method: str, path: str, headers: list[str]) -> Answer | None:
    """Backblaze B2's answer to a request with S3's additional checksums."""
    bad = [h for h in headers if h.startswith(_CHECKSUM_HEADERS)]
    if bad:
        return 400, "InvalidArgument", f"Unsupported header '{bad[0]}' received for this API call."
    return None


def _refuse_conditional(method: str, path: str, headers: list[str]) -> Answer | None:
    """AWS's answer to a conditional put before August 2024 (some gateways' still)."""
    if "if-none-match" in headers:
        return (
            501,
            "NotImplemented",
            "A header you provided implies functionality that is not implemented",
        )
    return None


def _refuse_upload_listing(method: str, path: str, headers: list[str]) -> Answer | None:
    """Some S3 gateways' answer to ListMultipartUploads (``GET /bucket?uploads``)."""
    if method == "GET" and "uploads" in parse_qs(urlsplit(path).query, keep_blank_values=True):
        return 501, "NotImplemented", "ListMultipartUploads is not implemented"
    return None


def _refuse_encryption(method: str, path: str, headers: list[str]) -> Answer | None:
    """MinIO's answer to a request for server-side encryption when it has no KMS."""
    if "x-amz-server-side-encryption" in headers:
        return 501, "NotImplemented", "Server side encryption specified but KMS is not configured"
    return None


def _refuse_completion(method: str, path: str, headers: list[str]) -> Answer | None:
    """A CompleteMultipartUpload (``POST ...?uploadId=``) that fails after the server has
    answered 200 (MinIO and Ceph RGW send the status at once, then spaces to keep the
    connection while they assemble the parts; AWS may too): the error is in the body."""
    if method == "POST" and "uploadId" in parse_qs(urlsplit(path).query):
        return (
            200,
            "InvalidPart",
            "One or more of the specified parts could not be found. The part may not have "
            "been uploaded, or the specified entity tag may not have matched the part's "
            "entity tag.",
        )
    return None


class _SlowAborts:
    """Every CompleteMultipartUpload refused as ``completion`` does, and the first
    AbortMultipartUpload (``DELETE ...?uploadId=``) of each upload answered 503 SlowDown,
    as S3 answers any request while it sheds load. One per server: it remembers the
    uploads."""

    def __init__(self) -> None:
        self.slowed: set[str] = set()

    def __call__(self, method: str, path: str, headers: list[str]) -> Answer | None:
        upload = parse_qs(urlsplit(path).query).get("uploadId", [""])[0]
        if method != "DELETE" or not upload:
            return _refuse_completion(method, path, headers)
        if upload in self.slowed:
            return None
        self.slowed.add(upload)
        return 503, "SlowDown", "Please reduce your request rate."


class _FirstPutTimedOut:
    """The first PUT answered 408 Request Timeout, as a reverse proxy in front of MinIO
    or Ceph RGW (nginx, HAProxy, a cloud load balancer) answers a request whose body came
    too slowly; the others forwarded. One per server: it remembers the first."""

    def __init__(self) -> None:
        self.answered = False

    def __call__(self, method: str, path: str, headers: list[str]) -> Answer | None:
        if method != "PUT" or self.answered:
            return None
        self.answered = True
        return 408, "", "Request Time-out"


def _listing_v1(method: str, path: str, headers: list[str]) -> str | None:
    """A server that does not do ListObjectsV2 (Ceph RGW before Luminous, some gateways):
    it ignores ``list-type=2`` and its continuation token and answers as ListObjects does,
    with no continuation token. Returns the path forwarded instead."""
    u = urlsplit(path)
    q = parse_qs(u.query, keep_blank_values=True)
    if method != "GET" or q.get("list-type") != ["2"]:
        return None
    kept = [
        (k, v) for k, vs in q.items() for v in vs if k not in ("list-type", "continuation-token")
    ]
    return u.path + ("?" + urlencode(kept) if kept else "")


def _refuse_skewed(method: str, path: str, headers: list[str]) -> Answer | None:
    """S3's answer to every request of a host whose clock is more than 15 minutes off."""
    return (
        403,
        "RequestTimeTooSkewed",
        "The difference between the request time and the current time is too large.",
    )


#: what a kind answers for a request forwarded and then left unanswered (its connection
#: closed: the answer lost on the way back)
LOSE_REPLY = "lose the reply"


def _lose_completion_reply(method: str, path: str, headers: list[str]) -> str | None:
    """A CompleteMultipartUpload carried out, its answer lost (a connection reset)."""
    if method == "POST" and "uploadId" in parse_qs(urlsplit(path).query):
        return LOSE_REPLY
    return None


def _refuse_nothing(method: str, path: str, headers: list[str]) -> None:
    return None


_S3_XML = "http://s3.amazonaws.com/doc/2006-03-01/"
#: uploads per page of a ListMultipartUploads answered in pages (AWS's are 1,000)
UPLOADS_PAGE = 2


def _page_uploads(
    method: str, path: str, payload: bytes, *, markers: bool, stuck: bool = False
) -> bytes | None:
    """ListMultipartUploads answered in pages of UPLOADS_PAGE, as S3 does past 1,000
    uploads (moto lists every one at once and ignores the markers): the uploads after the
    request's ``key-marker`` (and ``upload-id-marker``; with ``stuck``, the first page
    whatever they say), truncated, with the next page's markers unless ``markers`` is
    false. None for other requests: their answer stands."""
    q = parse_qs(urlsplit(path).query, keep_blank_values=True)
    if method != "GET" or "uploads" not in q:
        return None
    import xml.etree.ElementTree as ET

    ET.register_namespace("", _S3_XML)
    root = ET.fromstring(payload)
    ns = {"s3": _S3_XML}

    def order(e: ET.Element) -> tuple[str, str]:
        return e.findtext("s3:Key", "", ns), e.findtext("s3:UploadId", "", ns)

    uploads = sorted(root.findall("s3:Upload", ns), key=order)
    for e in uploads:
        root.remove(e)
    key, uid = q.get("key-marker", [""])[0], q.get("upload-id-marker", [""])[0]
    # (a key marker alone: the uploads of later keys; with an id: of that key too)
    if key and not stuck:
        uploads = [e for e in uploads if order(e) > (key, uid) and (uid or order(e)[0] > key)]
    page, rest = uploads[:UPLOADS_PAGE], uploads[UPLOADS_PAGE:]
    root.extend(page)
    truncated = root.find("s3:IsTruncated", ns)
    if truncated is None:
        truncated = ET.SubElement(root, f"{{{_S3_XML}}}IsTruncated")
    truncated.text = "true" if rest else "false"
    if rest and markers:
        last_key, last_uid = order(page[-1])
        ET.SubElement(root, f"{{{_S3_XML}}}NextKeyMarker").text = last_key
        ET.SubElement(root, f"{{{_S3_XML}}}NextUploadIdMarker").text = last_uid
    return ET.tostring(root, xml_declaration=True, encoding="UTF-8")


#: kinds that forward every request and rewrite some answers: (method, path, answer body)
#: -> the body sent instead, or None to send it as it is
_REWRITES: dict[str, Callable[[str, str, bytes], bytes | None]] = {
    "upload listing in pages": functools.partial(_page_uploads, markers=True),
    "upload listing in pages, no markers": functools.partial(_page_uploads, markers=False),
    "upload listing in pages, stuck": functools.partial(_page_uploads, markers=True, stuck=True),
}


#: kinds that remember what they were asked: a fresh refusal per server
_STATEFUL: dict[str, Callable[[], Callable[[str, str, list[str]], Answer | None]]] = {
    "completion, first abort slowed down": _SlowAborts,
    "first put timed out by a proxy": _FirstPutTimedOut,
}


_REFUSALS: dict[str, Callable[[str, str, list[str]], Answer | str | None]] = {
    "nothing": _refuse_nothing,
    "checksums": _refuse_checksums,
    "conditional": _refuse_conditional,
    "upload listing": _refuse_upload_listing,
    "completion": _refuse_completion,
    "encryption": _refuse_encryption,
    "listing v1": _listing_v1,
    "completion reply lost": _lose_completion_reply,
    "clock skew": _refuse_skewed,
}


class OlderS3Server:
    """An S3-compatible server that lacks something boto3 or kvfs may use: moto behind an
    HTTP proxy that refuses every request of the kind ``refuses`` names with the answer
    real servers give, and forwards the others. The kinds:

    * ``checksums``: S3's additional checksums, refused as Backblaze B2 does (older Ceph
      RGW and MinIO releases and several clouds' gateways refuse them too);
    * ``conditional``: a put with ``If-None-Match``, as AWS did before August 2024;
    * ``upload listing``: ListMultipartUploads, as some gateways do;
    * ``upload listing in pages``: ListMultipartUploads answered UPLOADS_PAGE uploads at a
      time, as S3 does past 1,000 (``..., no markers``: without the next page's markers;
      ``..., stuck``: the first page whatever the markers asked);
    * ``completion``: every CompleteMultipartUpload, with the error in a 200's body, as
      MinIO and Ceph RGW answer one that fails (``completion, first abort slowed down``:
      and the first abort of each upload answered 503 SlowDown);
    * ``completion reply lost``: the first CompleteMultipartUpload is carried out and its
      connection closed before the answer, as a reset would, and a retry of it answered
      NoSuchUpload, as MinIO and Ceph RGW do (AWS and moto answer it as the first);
    * ``first put timed out by a proxy``: the first PUT answered 408, as a reverse proxy
      does;
    * ``encryption``: a request for server-side encryption, as MinIO without a KMS does;
    * ``listing v1``: a ListObjectsV2 answered as ListObjects (V1), as servers without V2
      do;
    * ``clock skew``: every request, as S3 answers a host whose clock is more than 15
      minutes off;
    * ``nothing``: none (a server of its own, HTTPS with ``tls``).

    ``refused`` holds the request lines it refused (or rewrote, or answered not),
    ``forwarded`` counts the others."""

    def __init__(self, target: str, refuses: str, tls: Path | None = None) -> None:
        host, port = target.removeprefix("http://").split(":")
        refuse: Callable[[str, str, list[str]], Answer | str | None]
        refuse = (
            _STATEFUL[refuses]()
            if refuses in _STATEFUL
            else _REFUSALS.get(refuses, _refuse_nothing)
        )
        known = refuses in _REFUSALS or refuses in _STATEFUL
        rewrite = _REWRITES[refuses] if not known else None
        outer = self
        self.refused: list[str] = []
        self.forwarded = 0
        self.lost: set[str] = set()  # the uploads whose completion's answer was lost

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                """Nothing: http.server would write a line per request to stderr."""

            def _any(self) -> None:
                answer = refuse(self.command, self.path, [h.lower() for h in self.headers])
                path, lose = self.path, False
                if answer == LOSE_REPLY:
                    upload = parse_qs(urlsplit(path).query).get("uploadId", [""])[0]
                    lose = not outer.refused  # (the first time only)
                    answer = None
                    if lose:
                        outer.refused.append(self.requestline)
                        outer.lost.add(upload)
                    elif upload in outer.lost:  # (done: gone, as MinIO and Ceph RGW say)
                        answer = (404, "NoSuchUpload", "The specified upload does not exist.")
                elif isinstance(answer, str):  # (a request forwarded as another)
                    outer.refused.append(self.requestline)
                    path, answer = answer, None
                if answer is not None:
                    outer.refused.append(self.requestline)
                    status, code, message = answer
                    body = (
                        '<?xml version="1.0" encoding="UTF-8"?><Error><Code>'
                        f"{code}</Code><Message>{message}</Message></Error>"
                    ).encode()
                    kind = "application/xml"
                    if not code:  # (not the server's answer: a proxy's page)
                        body = f"<html><body><h1>{status} {message}</h1></body></html>".encode()
                        kind = "text/html"
                    self.send_response(status)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(body)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(body)
                    self.close_connection = True
                    return
                n = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(n) if n else None
                up = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    up.request(self.command, path, body=data, headers=dict(self.headers))
                    r = up.getresponse()
                    payload = r.read()
                finally:
                    up.close()
                outer.forwarded += 1
                if lose:
                    self.close_connection = True
                    return
                if rewrite is not None and r.status == 200:
                    new = rewrite(self.command, path, payload)
                    if new is not None:
                        outer.refused.append(self.requestline)
                        payload = new
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = r.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:  # (HTTPS, its certificate signed by a CA of its own: tls/ca.pem)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*_self_signed(tls))
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OlderS3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _self_signed(d: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 that is its own CA, and its key, written in ``d`` as
    ca.pem and key.pem (a private CA's server, as on-premises MinIO and Ceph often are)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvfs test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (d / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(d / "ca.pem"), str(d / "key.pem")
