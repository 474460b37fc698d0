"""Pages sharing one archived content (dedup) while pages holding it are deleted, put again,
spilled and evicted: every page stays named by a manifest, and the object goes with the
last page that needs it. File and S3 archives."""

from __future__ import annotations

from collections.abc import Callable

import kvfs
from kvfs import PageKey
from tests.test_archive import archive_url, archived_cfg, kv_page  # noqa: F401 - fixture

__all__ = ["archive_url"]


def blob_objects(s: kvfs.SyncStore) -> list[str]:
    policy = s.engine.policy  # type: ignore[attr-defined]
    return policy.call(policy.store.list_all, "blobs/")


def test_a_page_put_beside_a_named_one_with_the_same_bytes_is_named_before_its_copy_goes(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """A session spilled, then a page put into it with the bytes of a page its manifest
    names: the eviction found the content named (by the older page) and dropped the local
    copy without writing the manifest again, so the new page, held by the archive alone,
    was in no manifest: a second host restoring the session did not see it."""
    same = kv_page(5)
    k0, k1 = PageKey.semantic("a", "p", 0), PageKey.semantic("a", "p", 1)
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-a")) as a:
        a.put(k0, same)
        a.spill("a")
        a.put(k1, same)
        a.evict(session="a")
        assert {i.path: i.tier for i in a.list(session="a")} == {
            k0.path: "archive",
            k1.path: "archive",
        }
    with kvfs.open_store_sync(archived_cfg(make_config, archive_url, name="host-b")) as b:
        b.restore("a")
        assert sorted(i.path for i in b.list(session="a")) == [k0.path, k1.path]
        assert b.get(k1) == same


def test_an_object_whose_bytes_were_put_again_before_its_collection_goes_with_them(
    make_config: Callable[..., kvfs.StoreConfig],
    archive_url: str,  # noqa: F811
) -> None:
    """The last page of an archived content is deleted (its object queued for collection)
    and the same bytes are put again, as a new page, before the collection runs. The
    collection kept the object for the new page, whose data the archive does not hold (its
    blob is new); deleting that page queued nothing, and the object stayed in the bucket
    for good."""
    same, other = kv_page(6), kv_page(60)
    ka, kb, kc = (PageKey.semantic(s, "p", 0) for s in ("a", "b", "c"))
    online = archived_cfg(make_config, archive_url)
    offline = make_config(ndev=2)  # the same directories, no archive: a delete only queues
    with kvfs.open_store_sync(online) as s:
        s.put(ka, same)
        s.put(kc, other)
        s.spill("a")
        assert len(blob_objects(s)) == 1
    with kvfs.open_store_sync(offline) as s:
        s.delete(ka)  # the object is queued for collection ...
        s.put(kb, same)  # ... and the same bytes are held again, as data not archived
    with kvfs.open_store_sync(online) as s:
        s.delete(kc)  # the queued collection runs while b's page holds the bytes
        assert s.get(kb) == same
        s.delete(kb)
        assert blob_objects(s) == []
