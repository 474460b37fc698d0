"""Hugging Face transformers KV caches as kvfs pages.

::

    kv = TransformersKV(store, model, model_id="meta-llama/Llama-3.1-8B@main")
    kv.save("agent-42", input_ids, out.past_key_values)          # after a prefill (5.24+: out.cache)
    hit = kv.load("agent-43", new_input_ids, max_tokens=len(new_input_ids) - 1)
    rest = torch.tensor([new_input_ids[hit.tokens:]])             # what is not cached (1 x n)
    out = model(input_ids=rest, past_key_values=hit.cache)        # 5.24+: cache=

    with kv.load_layers("agent-43", new_input_ids) as layers:    # layer by layer
        for i, k, v in layers:                                     # i+1.. still in flight
            ...

A cache is cut into chunks of ``chunk_tokens`` tokens (256 by default); each (chunk, layer)
is one page ``sessions/<session>/<chunk name>/layer-NNN`` in the ``kvfs-kv/1`` format
(:mod:`kvfs.integrations._format`), where the chunk name is a hash chain over the tokens
seeded by the model geometry (:mod:`kvfs.integrations._chain`). Only full chunks are
stored. Every page is also published under a shared session (``prefix-cache`` unless told
otherwise) so that another session with the same prefix finds it; kvfs deduplicates the
identical bytes, so the second name costs an index row, not a copy (a plain directory
that is not a kvfs mount holds a second copy).

``store`` may be a kvfs store (object API), a directory (plain files: the kvfs mount or any
directory), or any :class:`~kvfs.integrations.PageSource`. Batch size 1 and full-attention
layers only (a sliding-window layer does not hold the whole prefix).
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from gds import LayerLoader

from .._aligned import aligned_buffer, round_up
from .._errors import CorruptPage, InvalidKey, PageNotFound, StoreClosed
from .._keys import PageKey, _check_part
from ._chain import chunk_names
from ._format import (
    FORMAT,
    Geometry,
    GeometryMismatch,
    PageLayout,
    check_page,
    parse_header,
)
from ._hfcompat import cache_of, forward
from ._sources import PageSource, as_source
from ._tcache import build_cache, cache_tensors

log = logging.getLogger("kvfs.integrations")

__all__ = [
    "LayerwiseLoad",
    "LoadResult",
    "PrefillResult",
    "SaveResult",
    "TransformersKV",
    "build_cache",
    "geometry_of",
]

T = TypeVar("T")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHARED_SESSION = "prefix-cache"


def geometry_of(model: Any, model_id: str, chunk_tokens: int = 256) -> Geometry:
    """The KV geometry of a transformers model (decoder config, parameter dtype). Raises
    ValueError for multi-head latent attention (DeepSeek-V2/V3: ``kv_lora_rank``), whose
    keys and values differ in size."""
    cfg = model.config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    if getattr(cfg, "kv_lora_rank", None):
        raise ValueError(
            f"{type(cfg).__name__} uses multi-head latent attention (kv_lora_rank "
            f"{cfg.kv_lora_rank}): its keys and values differ in size, and kvfs pages hold "
            "one head size for both"
        )
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    # (Falcon has no num_key_value_heads: it caches one KV head when multi_query without the
    # new decoder architecture, else every attention head, its num_kv_heads expanded)
    if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
        kv_heads = 1
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = str(model.dtype).removeprefix("torch.")
    return Geometry(
        model_id=model_id,
        layers=cfg.num_hidden_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
    )


@dataclass(frozen=True)
class SaveResult:
    chunks: int  #: full chunks in the cache
    pages_written: int  #: new pages (session and shared names)
    pages_present: int  #: pages that existed already (write-once: skipped)
    bytes_written: int
    seconds: float


@dataclass(frozen=True)
class LoadResult:
    """The longest cached prefix: ``cache`` holds KV of ``tokens`` tokens (None if 0)."""

    cache: Any
    tokens: int
    chunks: int
    bytes_read: int
    seconds: float
    #: session each loaded chunk came from (own session or the shared one)
    sources: tuple[str, ...] = ()
    #: why loading stopped early at a page that was listed (gone, corrupt), if it did
    note: str = ""


@dataclass(frozen=True)
class PrefillResult:
    logits: torch.Tensor  #: logits of the last input token, shape [vocab]
    cache: Any
    reused_tokens: int
    computed_tokens: int
    load_seconds: float
    compute_seconds: float
    save: SaveResult | None = None
    sources: tuple[str, ...] = field(default=())
    #: why the cached prefix was cut short or could not be read at all (the load's note,
    #: its error), and why the cache was not saved though asked to be (no room, a mount
    #: gone), if any of those happened
    note: str = ""


class TransformersKV:
    """Save and load one model's KV caches in kvfs. Thread-safe; reuse one per model."""

    def __init__(
        self,
        store: object,
        model: Any,
        *,
        model_id: str,
        chunk_tokens: int = 256,
        shared_session: str | None = SHARED_SESSION,
        threads: int = 8,
    ) -> None:
        if shared_session is not None:  # (refused here, not at every save)
            _check_part(shared_session, "shared_session")
        self.source: PageSource = as_source(store)
        self.model = model
        self.geometry = geometry_of(model, model_id, chunk_tokens)
        self.shared_session = shared_session
        self.dtype = TORCH_DTYPES[self.geometry.dtype]
        #: Where loaded caches are placed: the model's device. Pages are staged in host
        #: memory and copied per chunk (a CUDA model gets host-to-device copies; the GDS
        #: path straight into device memory is the fast path's).
        self.device = next(iter(model.parameters())).device
        split = {  # (accelerate writes a GPU as its index: 0 is "cuda:0")
            f"cuda:{v}" if isinstance(v, int) else "cuda:0" if v == "cuda" else str(v)
            for v in (getattr(model, "hf_device_map", None) or {}).values()
        }
        if len(split) > 1:  # its layers' KV would all go to the first device: a device error
            raise ValueError(
                f"this model is split over several devices ({', '.join(sorted(split))}); "
                f"kvfs places a loaded cache on one device: load it on one (device_map)"
            )
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfs-kv")
        self._closed = False
        self._local = threading.local()
        #: paths of pages a load found damaged: the next save that has their KV rewrites
        #: them (where the source can: ``rewrite``), so the prefix does not stay cut there
        self._damaged: set[str] = set()
        build_cache(model.config, [])  # raises early on caches kvfs cannot hold (sliding window)

    def close(self) -> None:
        """Wait for the page reads and writes running, then refuse every call (StoreClosed),
        a layer-wise load begun before included at the next layer it would start.
        Idempotent."""
        self._closed = True
        self._pool.shutdown()

    def _begin(self, session: str) -> None:
        """Refuse a call after :meth:`close` (StoreClosed) or on a session name that is no
        valid key part (InvalidKey), whether or not a chunk of its prompt is looked up."""
        if self._closed:
            raise StoreClosed("this TransformersKV was closed")
        _check_part(session, "session")

    def _submit_each(
        self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]]
    ) -> list[Future[T]]:
        """Start ``fn(*args)`` in the pool for each args of ``calls``. Raises StoreClosed
        once :meth:`close` ran (in another thread too), after cancelling the calls it had
        started and waiting for those running."""
        futs: list[Future[T]] = []
        try:
            for args in calls:
                futs.append(self._pool.submit(fn, *args))
        except RuntimeError as e:  # ("cannot schedule new futures after shutdown")
            _stop(futs)
            if self._closed:
                raise StoreClosed("this TransformersKV was closed") from e
            raise
        return futs

    def __enter__(self) -> TransformersKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- naming -----------------------------------------------------------------------
    def _search_order(self, session: str) -> list[str]:
        return [session] + (
            [self.shared_session] if self.shared_session not in (None, session) else []
        )  # type: ignore[list-item]

    def _check_session(self, session: str) -> None:
        """Refuse a session whose pages belong to another model or geometry."""
        attrs = self.source.sample_attrs(session)
        if attrs is None:
            return
        if attrs.get("format") != FORMAT:
            raise GeometryMismatch(
                f"session {session!r} holds pages that are not {FORMAT} "
                f"KV pages; use another session name"
            )
        self.geometry.check_same(Geometry.from_attrs(attrs), f"session {session!r}")

    # -- save -------------------------------------------------------------------------
    def save(self, session: str, tokens: Sequence[int] | torch.Tensor, cache: Any) -> SaveResult:
        """Store the full chunks of ``cache``, which holds the KV of ``tokens`` (or of the
        first ``cache length`` of them). Pages that exist already are skipped.

        An empty cache (no tokens yet) stores nothing. Raises GeometryMismatch if the
        cache or the session is of another geometry;
        ValueError on a batch size other than 1 or a cache longer than ``tokens``;
        InvalidKey on a session name that is no valid key part (``a/b``, empty).
        Each page is atomic; a crash leaves some chunks stored, which later loads use.
        An error writing a page (no room: CapacityExceeded, ENOSPC) is raised once the
        writes already running are done and none is started after it: the pages written
        stay, and nothing of the save writes after it raised.
        """
        self._begin(session)
        t0 = time.perf_counter()
        g = self.geometry
        toks = _token_list(tokens)
        seq_length = getattr(cache, "get_seq_length", None)
        if callable(seq_length) and int(seq_length()) == 0:
            # nothing to store; its layers hold no tensors yet (and a cache built without
            # the model's config has no layers), which looked like another geometry
            return SaveResult(0, 0, 0, 0, time.perf_counter() - t0)
        kvs = cache_tensors(cache)
        self._check_tensors(kvs)
        length = kvs[0][0].shape[2]
        if callable(seq_length):  # a static cache is allocated longer than what it holds
            held = int(seq_length())
            if held > length:  # its tensors are not all of its tokens' KV
                raise ValueError(
                    f"the cache says it holds {held} tokens but its tensors hold {length}: "
                    f"they are not the KV of the whole prefix"
                )
            length = held
        if length > len(toks):
            raise ValueError(
                f"the cache holds {length} tokens but only {len(toks)} token ids were given"
            )
        names = chunk_names(toks[:length], g)
        if names and self.source.stat(PageKey.semantic(session, names[0], 0)) is None:
            self._check_session(session)
        jobs = [(c, layer) for c in range(len(names)) for layer in range(g.layers)]

        def one(job: tuple[int, int]) -> tuple[int, int, int]:
            c, layer = job
            meta = {
                **g.to_attrs(),
                "chunk": str(c),
                "prefix": names[c],
                "parent": names[c - 1] if c else "",
                "layer": str(layer),
                "token_start": str(c * g.chunk_tokens),
                "token_end": str((c + 1) * g.chunk_tokens),
            }
            targets = [PageKey.semantic(s, names[c], layer) for s in self._search_order(session)]
            rewrite = getattr(self.source, "rewrite", None)
            bad = [k for k in targets if k.path in self._damaged] if rewrite else []
            missing = [k for k in targets if k not in bad and self.source.stat(k) is None]
            if not missing and not bad:
                return 0, len(targets), 0
            lay = PageLayout.build(g, g.chunk_tokens, meta)
            buf = lay.buffer()
            sl = slice(c * g.chunk_tokens, (c + 1) * g.chunk_tokens)
            k, v = kvs[layer]
            self._view(buf, lay.key_offset).copy_(k[0, :, sl, :])
            self._view(buf, lay.value_offset).copy_(v[0, :, sl, :])
            meta = lay.seal(buf)  # the data's digest, into the header and the attrs
            wrote = sum(self.source.write(key, buf, meta) for key in missing)
            for key in bad:
                assert rewrite is not None
                wrote += bool(rewrite(key, buf, meta))
                self._damaged.discard(key.path)
            return wrote, len(targets) - wrote, wrote * lay.size

        done = _results(self._submit_each(one, [(job,) for job in jobs]))
        return SaveResult(
            chunks=len(names),
            pages_written=sum(d[0] for d in done),
            pages_present=sum(d[1] for d in done),
            bytes_written=sum(d[2] for d in done),
            seconds=time.perf_counter() - t0,
        )

    def _check_tensors(self, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        g = self.geometry
        if len(kvs) != g.layers:
            raise GeometryMismatch(
                f"the cache has {len(kvs)} layers; {g.describe()} has {g.layers}"
            )
        for i, (k, v) in enumerate(kvs):
            want = (g.kv_heads, g.head_dim)
            if k.dim() != 4 or k.shape != v.shape or (k.shape[1], k.shape[3]) != want:
                raise GeometryMismatch(
                    f"layer {i}: KV of shape {tuple(k.shape)} does not fit {g.describe()}"
                )
            if k.shape[0] != 1:
                raise ValueError(f"batch size {k.shape[0]}: kvfs stores one sequence per cache")
            if k.dtype != self.dtype or v.dtype != self.dtype:
                raise GeometryMismatch(f"layer {i}: KV dtype {k.dtype}; {g.describe()}")
            if k.shape[2] != kvs[0][0].shape[2]:
                raise ValueError("layers hold different token counts (sliding window?)")

    def _view(self, buf: memoryview, offset: int) -> torch.Tensor:
        g = self.geometry
        count = g.kv_heads * g.chunk_tokens * g.head_dim
        return torch.frombuffer(buf, dtype=self.dtype, count=count, offset=offset).view(
            g.kv_heads, g.chunk_tokens, g.head_dim
        )

    # -- load -------------------------------------------------------------------------
    def lookup(self, session: str, tokens: Sequence[int] | torch.Tensor) -> list[str]:
        """Where each cached chunk of the longest cached prefix is (session names)."""
        self._begin(session)
        return [s for s, _sizes in self._plan(session, _token_list(tokens), None)]

    def _plan(
        self, session: str, toks: list[int], max_chunks: int | None
    ) -> list[tuple[str, list[int]]]:
        g = self.geometry
        plan: list[tuple[str, list[int]]] = []
        for name in chunk_names(toks, g, max_chunks):
            for s in self._search_order(session):
                first = self.source.stat(PageKey.semantic(s, name, 0))
                if first is None:
                    continue  # the common miss costs one lookup, not one per layer
                stats = [first] + [
                    self.source.stat(PageKey.semantic(s, name, layer))
                    for layer in range(1, g.layers)
                ]
                if all(st is not None for st in stats):
                    for st in stats:
                        if st is not None and st.attrs is not None:
                            g.check_same(Geometry.from_attrs(st.attrs), f"session {s!r}")
                    plan.append((s, [st.size for st in stats if st is not None]))
                    break
            else:
                break
        if not any(s == session for s, _ in plan):  # (its own pages were checked above)
            self._check_session(session)
        return plan

    def _start(
        self, session: str, tokens: Sequence[int] | torch.Tensor, max_tokens: int | None
    ) -> _Reads | None:
        """Plan the longest cached prefix and allocate its tensors (None: nothing cached)."""
        self._begin(session)
        g, C = self.geometry, self.geometry.chunk_tokens
        toks = _token_list(tokens)
        limit = len(toks) if max_tokens is None else max(0, min(max_tokens, len(toks)))
        plan = self._plan(session, toks, -(-limit // C))
        ntok = min(limit, len(plan) * C)
        if ntok == 0:
            return None
        return _Reads(self, plan, chunk_names(toks, g, len(plan)), ntok)

    def load(
        self, session: str, tokens: Sequence[int] | torch.Tensor, *, max_tokens: int | None = None
    ) -> LoadResult:
        """Load the longest cached prefix of ``tokens`` (at most ``max_tokens`` of them).

        Looks in ``session``, then in the shared session. Returns a cache the model
        continues from (``cache=None`` when nothing is cached). Raises GeometryMismatch if
        ``session`` holds KV of another model or geometry (whether or not the shared
        session has the prefix), InvalidKey as :meth:`save` does. A page that vanished,
        failed its checksum, or whose header is damaged or names another chunk, layer or
        geometry, between lookup and read ends the prefix there (``note`` says so);
        corrupt data is never loaded.

        The same reads as :meth:`load_layers`, all started at once, the cache built when
        every page is in. Any other error of a read (ArchiveUnavailable...) is raised once
        the reads already running are done; the others are not started.
        """
        t0 = time.perf_counter()
        reads = self._start(session, tokens, max_tokens)
        if reads is None:
            return LoadResult(None, 0, 0, 0, time.perf_counter() - t0)
        C, plan, ntok = self.geometry.chunk_tokens, reads.plan, reads.tokens
        pages: list[tuple[Future[int], list[Future[int]]]] = []
        bad_chunk, note, per_chunk = len(plan), "", [0] * len(plan)
        try:
            for layer in range(self.geometry.layers):
                pages.append(reads.submit(layer))
            for layer, (_done, futs) in enumerate(pages):
                for c, f in enumerate(futs):
                    try:
                        per_chunk[c] += f.result()
                    except (PageNotFound, CorruptPage) as e:
                        if c < bad_chunk:
                            bad_chunk, note = c, f"stopped at chunk {c} (layer {layer}): {e}"
        except BaseException:
            _stop([f for _done, futs in pages for f in futs])
            raise
        nbytes = sum(per_chunk[:bad_chunk])  # (the chunks kept)
        ks, vs = [k for k, _ in reads.layers], [v for _, v in reads.layers]
        if bad_chunk < len(plan):
            ntok = min(ntok, bad_chunk * C)
            if ntok == 0:
                return LoadResult(None, 0, 0, 0, time.perf_counter() - t0, note=note)
            ks = [k[:, :, :ntok].contiguous() for k in ks]
            vs = [v[:, :, :ntok].contiguous() for v in vs]
            plan = plan[:bad_chunk]
        cache = build_cache(self.model.config, list(zip(ks, vs, strict=True)))
        return LoadResult(
            cache=cache,
            tokens=ntok,
            chunks=len(plan),
            bytes_read=nbytes,
            seconds=time.perf_counter() - t0,
            sources=tuple(s for s, _ in plan),
            note=note,
        )

    def load_layers(
        self,
        session: str,
        tokens: Sequence[int] | torch.Tensor,
        *,
        max_tokens: int | None = None,
        ahead: int | None = None,
    ) -> LayerwiseLoad:
        """Load the longest cached prefix of ``tokens`` layer by layer.

        Returns a :class:`LayerwiseLoad`: iterate it (``for`` or ``async for``) for
        ``(layer, key, value)`` in layer order, each ``[1, kv_heads, tokens, head_dim]`` on
        the model's device, yielded as soon as every page of that layer is in while the
        pages of the next ``ahead`` layers are read (None: all layers at once, in layer
        order). A model can run layer 0 while the rest arrives.

        Raises GeometryMismatch as :meth:`load` does, before any read. Unlike :meth:`load`,
        a page that vanished or failed its checksum cannot shorten a prefix whose earlier
        layers were already handed out: iteration raises PageNotFound or CorruptPage at
        that layer's turn. Use it as a context manager: leaving the block waits for the
        reads in flight, so nothing writes into the tensors afterwards.
        """
        reads = self._start(session, tokens, max_tokens)
        return LayerwiseLoad(reads, ahead)

    # -- the whole step ---------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, session: str, input_ids: Sequence[int] | torch.Tensor, *, save: bool = True
    ) -> PrefillResult:
        """Prefill ``input_ids`` reusing the longest cached prefix, then save the cache.

        At least the last token is computed (its logits are the result). Returns the logits
        of the last token and the cache, ready for decoding. The cache is a cache: a load
        that fails (the archive unreachable, the mount's daemon gone: any ``OSError``) is a
        miss, everything is computed; a save that fails (no room: ``CapacityExceeded``,
        ENOSPC; the mount gone) leaves ``save=None``. Either is logged and said in
        ``note``, as is a prefix the load cut short: the prefill's result stands. Raises
        GeometryMismatch (see :meth:`load`) before anything is computed.
        """
        toks = _token_list(input_ids)
        if not toks:
            raise ValueError("nothing to prefill")
        notes = []
        try:
            hit = self.load(session, toks, max_tokens=len(toks) - 1)
        except OSError as e:  # ArchiveUnavailable, ENOTCONN: computed instead, as a miss
            notes.append(f"cache not read: {e}")
            log.warning("session %r: the KV cache was %s", session, notes[-1])
            hit = LoadResult(None, 0, 0, 0, 0.0)
        if hit.note:
            notes.append(hit.note)
        t0 = time.perf_counter()
        cache = hit.cache if hit.cache is not None else build_cache(self.model.config, [])
        ids = torch.tensor([toks[hit.tokens :]], dtype=torch.long, device=self.device)
        out = forward(self.model, ids, cache)
        compute = time.perf_counter() - t0
        saved = None
        if save:
            try:
                saved = self.save(session, toks, cache_of(out))
            except OSError as e:  # CapacityExceeded, a full directory: the work is not lost
                notes.append(f"not saved: {e}")
                log.warning("session %r: the prefilled KV cache was %s", session, notes[-1])
        return PrefillResult(
            logits=out.logits[0, -1],
            cache=cache_of(out),
            reused_tokens=hit.tokens,
            computed_tokens=len(toks) - hit.tokens,
            load_seconds=hit.seconds,
            compute_seconds=compute,
            save=saved,
            sources=hit.sources,
            note="; ".join(notes),
        )


def _stop(futs: list[Future[Any]]) -> None:
    """Cancel the calls of ``futs`` not started and wait for the running ones."""
    for f in futs:
        f.cancel()
    wait(futs)


def _results(futs: list[Future[T]]) -> list[T]:
    """The results of ``futs``, in order. On the first error the calls not started are
    cancelled and the running ones waited for before it is raised: a save that raised had
    writes still running, which a caller freeing room after it (deleting the session,
    closing the store) found behind it."""
    try:
        return [f.result() for f in futs]
    except BaseException:
        _stop(futs)
        raise


def _token_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """The token ids as ints. Raises ValueError for a batch of more than one, or ids that
    are no integers (``int()`` took 1.5 as 1: two prompts, one cached prefix)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 2:
            if tokens.shape[0] != 1:
                raise ValueError("batch size must be 1")
            tokens = tokens[0]
        tokens = tokens.tolist()
    try:
        return [operator.index(t) for t in tokens]
    except TypeError as e:
        raise ValueError(f"token ids must be integers: {e}") from None


class _Reads:
    """The page reads of one planned prefix, into freshly allocated per-layer tensors."""

    def __init__(
        self, kv: TransformersKV, plan: list[tuple[str, list[int]]], names: list[str], ntok: int
    ) -> None:
        g = kv.geometry
        self.kv, self.plan, self.names, self.tokens = kv, plan, names, ntok
        shape = (1, g.kv_heads, ntok, g.head_dim)
        self.layers = [
            (
                torch.empty(shape, dtype=kv.dtype, device=kv.device),
                torch.empty(shape, dtype=kv.dtype, device=kv.device),
            )
            for _ in range(g.layers)
        ]
        self.stage = round_up(max(max(sizes) for _s, sizes in plan))
        # The caller's inference mode is per thread: copy it, or in-place writes into
        # tensors created under it fail in the workers.
        self.mode = torch.is_inference_mode_enabled()

    def submit(self, layer: int) -> tuple[Future[int], list[Future[int]]]:
        """Start reading every chunk of ``layer``. Returns a future that resolves once all
        of them are done (to the bytes read, or to the first failed chunk's error) and the
        per-chunk futures."""
        futs = self.kv._submit_each(self._one, [(layer, c) for c in range(len(self.plan))])
        done: Future[int] = Future()
        left = [len(futs)]
        lock = threading.Lock()

        def settle(_: Future[int]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            err = next((f.exception() for f in futs if f.exception() is not None), None)
            if err is not None:
                done.set_exception(err)
            else:
                done.set_result(sum(f.result() for f in futs))

        for f in futs:
            f.add_done_callback(settle)
        return done, futs

    def _one(self, layer: int, c: int) -> int:
        with torch.inference_mode(self.mode):
            return self._read(layer, c)

    def _read(self, layer: int, c: int) -> int:
        key = PageKey.semantic(self.plan[c][0], self.names[c], layer)
        try:
            return self._read_page(key, layer, c)
        except CorruptPage:
            self.kv._damaged.add(key.path)  # (rewritten by the next save that has it)
            raise

    def _read_page(self, key: PageKey, layer: int, c: int) -> int:
        kv, g, C = self.kv, self.kv.geometry, self.kv.geometry.chunk_tokens
        buf = getattr(kv._local, "buf", None)
        if buf is None or len(buf) < self.stage:
            buf = kv._local.buf = aligned_buffer(self.stage)
        try:
            n = kv.source.read_into(key, buf)
        except InvalidKey:
            raise
        except ValueError as e:  # the buffer holds the page as the lookup sized it
            raise PageNotFound(f"{key.path} changed after the lookup (it grew): {e}") from e
        try:
            h = parse_header(buf[:n], key.path)
            g.check_same(Geometry.from_attrs(h.metadata), key.path)
        except GeometryMismatch as e:  # its name is this geometry's: damage, not a model
            raise CorruptPage(f"{key.path}: the page's header is not this name's: {e}") from e
        if (
            h.shape != (g.kv_heads, C, g.head_dim)
            or h.dtype != g.dtype
            or h.metadata.get("prefix") != self.names[c]
            or h.metadata.get("layer") != str(layer)
        ):
            raise CorruptPage(f"{key.path}: the page's header names another chunk or layer")
        # The whole page, and (where the source does not verify its reads) its digest: a
        # truncated file would leave the buffer's previous page in place of this one.
        check_page(h, buf[:n], key.path, digest=not getattr(kv.source, "verifies", False))
        take = min(C, self.tokens - c * C)
        dst = slice(c * C, c * C + take)
        k, v = self.layers[layer]
        k[0, :, dst, :] = kv._view(buf, h.key_offset)[:, :take, :]
        v[0, :, dst, :] = kv._view(buf, h.value_offset)[:, :take, :]
        return n


class LayerwiseLoad:
    """A prefix being loaded layer by layer (from :meth:`TransformersKV.load_layers`).

    Iterate (``for`` in threads, ``async for`` in trio) for ``(layer, key, value)`` in
    layer order; a layer is yielded once all its pages are in and checked. ``tokens``,
    ``chunks`` and ``sources`` are known before the first read; ``bytes_read`` counts the
    layers yielded so far. Leaving the ``with`` block (or :meth:`close`) waits for reads
    in flight and starts no more.
    """

    def __init__(self, reads: _Reads | None, ahead: int | None) -> None:
        self._reads = reads
        self.tokens = reads.tokens if reads else 0
        self.chunks = len(reads.plan) if reads else 0
        self.sources: tuple[str, ...] = tuple(s for s, _ in reads.plan) if reads else ()
        self.bytes_read = 0
        self._loader: LayerLoader[tuple[torch.Tensor, torch.Tensor]] = LayerLoader(
            self._submit, reads.layers if reads else [], ahead
        )

    def _submit(self, layer: int) -> Future[int]:
        assert self._reads is not None
        done, _chunks = self._reads.submit(layer)
        return done

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for i, (k, v) in self._loader:
            self.bytes_read += self._loader.future(i).result()
            yield i, k, v

    async def __aiter__(self) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
        async for i, (k, v) in self._loader:
            self.bytes_read += self._loader.future(i).result()
            yield i, k, v

    def close(self) -> None:
        self._loader.close()

    async def aclose(self) -> None:
        await self._loader.aclose()

    def __enter__(self) -> LayerwiseLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> LayerwiseLoad:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
