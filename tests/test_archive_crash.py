"""SIGKILL right after an index transaction that removes pages or imports them: the archive's
follow-up work (a manifest rewrite, an object to forget) must already be queued in it.

The kill lands where that work used to be queued, in a transaction of its own after the
removal's: a crash there forgot it, and the stale manifest brought deleted pages back at the
next restore (or, for an import, let another host's delete collect the objects this host
listed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvfs

# The child: open the store, make every removal's (or import's) follow-up kill the process,
# run one operation. argv: data dir, archive dir, operation.
CHILD = r"""
import os, signal, sys
import kvfs
from kvfs import _archive, _manifest

data, archive, op = sys.argv[1:4]
cfg = kvfs.StoreConfig(
    data_dirs=(data,), archive_url=f"file://{archive}",
    extra={"archive": {"interval": 0, "upload_processes": 0}},
)
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
_archive.ArchivingPolicy.pages_removed = die  # right after the removal's transaction
real_import = _manifest.ArchiveIndex.import_manifest
def import_then_die(self, *a, **k):
    real_import(self, *a, **k)
    die()
_manifest.ArchiveIndex.import_manifest = import_then_die
with kvfs.open_store_sync(cfg) as st:
    if op == "delete":
        st.delete("sess/p0")
    elif op == "rename":
        st.rename("sess/p0", "other/p0")
    elif op == "replace":
        st.put("sess/p0", b"new" * 2000, replace=True)
    elif op == "delete_session":
        st.delete_session("sess/")
    elif op == "restore":
        st.restore("sess/")
sys.exit(0)
"""


def _cfg(data: Path, archive: Path) -> kvfs.StoreConfig:
    return kvfs.StoreConfig(
        data_dirs=(data,),
        archive_url=f"file://{archive}",
        extra={"archive": {"interval": 0, "upload_processes": 0}},
    )


def _killed(data: Path, archive: Path, op: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(data), str(archive), op],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert r.returncode == -9, r.stderr  # killed where it should be, not failed before


@pytest.mark.parametrize(
    ("op", "after"),
    [
        ("delete", {"sess/p1": b"B" * 6000}),
        ("rename", {"other/p0": b"A" * 6000, "sess/p1": b"B" * 6000}),
        ("replace", {"sess/p0": b"new" * 2000, "sess/p1": b"B" * 6000}),
        ("delete_session", {}),
    ],
)
def test_a_removal_crashed_right_after_its_commit_stays_done(
    tmp_path: Path, op: str, after: dict[str, bytes]
) -> None:
    data, archive = tmp_path / "d", tmp_path / "archive"
    with kvfs.open_store_sync(_cfg(data, archive)) as st:
        st.put("sess/p0", b"A" * 6000)
        st.put("sess/p1", b"B" * 6000)
        st.spill("sess/")
        st.restore("sess/")  # local and archived: the manifest names both pages
    _killed(data, archive, op)
    for _ in range(2):  # a restore, and a restart after it, bring nothing back
        with kvfs.open_store_sync(_cfg(data, archive)) as st:
            assert not {k: v for k, v in st.fsck().items() if v}
            if op == "delete_session":
                with pytest.raises(kvfs.SessionNotFound):
                    st.restore("sess/")
            else:
                st.restore("sess/")
            got = {p.path: st.get(p.path) for p in st.list(path_prefix="")}
            assert got == after


def test_an_import_crashed_right_after_its_commit_keeps_its_pages(tmp_path: Path) -> None:
    """Host B restores host A's session and is killed right after the import: its own
    manifest must still get written, or A's delete of the session collects the objects
    that B lists (and B could not even open: "holds none of the objects")."""
    archive = tmp_path / "archive"
    a, b = tmp_path / "a", tmp_path / "b"
    pages = {f"sess/p{i}": os.urandom(50_000) for i in range(3)}
    with kvfs.open_store_sync(_cfg(a, archive)) as st:
        for k, v in pages.items():
            st.put(k, v)
        st.spill("sess/")
    with kvfs.open_store_sync(_cfg(b, archive)) as st:  # B exists before it restores
        assert st.list() == []
    _killed(b, archive, "restore")
    with kvfs.open_store_sync(_cfg(b, archive)) as st:  # its queued manifest is written
        assert {p.path for p in st.list(path_prefix="sess/")} == set(pages)
    with kvfs.open_store_sync(_cfg(a, archive)) as st:
        st.delete_session("sess/")
    with kvfs.open_store_sync(_cfg(b, archive)) as st:
        assert {p.path: st.get(p.path) for p in st.list(path_prefix="sess/")} == pages


def test_a_pin_made_after_a_spill_reaches_the_manifest(tmp_path: Path) -> None:
    """Pinning a spilled session (or a page of it) changed only the local index: its
    manifest still said unpinned, and another host retiring this one (silent for twice its
    retention) trusts the manifest: it deleted the pinned session and collected its
    objects. The rewrite is queued in the pin's own transaction."""
    import msgpack

    data, archive = tmp_path / "d", tmp_path / "archive"
    with kvfs.open_store_sync(_cfg(data, archive)) as st:
        st.put("sessions/a/p/layer-000", b"A" * 6000)
        st.put("sessions/b/p/layer-000", b"B" * 6000)
        st.spill("a")
        st.spill("b")
        st.pin_session("a")
        st.pin("sessions/b/p/layer-000")
        st.set_session_attrs("b", {"model": "m"})
        pol = st.engine.policy
        pol.call(pol.spiller.flush_pending)  # (the daemon's next background pass)

    def manifest(session: str) -> dict:
        (path,) = (archive / "manifests").glob(f"sessions%2F{session}@*")
        return msgpack.unpackb(path.read_bytes(), raw=False)

    assert manifest("a")["pinned"] is True
    assert [p["pinned"] for p in manifest("b")["pages"]] == [True]
    assert manifest("b")["attrs"] == {"model": "m"}
