"""Every store command on a stopped data directory (no daemon), in-process, plus bad
arguments and exit codes through a real ``python -m cli`` process."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvfs

if sys.version_info < (3, 11):  # (the backport trio depends on there)
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

Run = Callable[..., tuple[int, str, str]]


def data(tmp_path: Path, archive: bool = False) -> list[str]:
    return [
        "--data",
        f"{tmp_path}/d0,{tmp_path}/d1",
        "--archive",
        f"file://{tmp_path}/arch" if archive else "",
    ]


def one_page(run: Run, tmp_path: Path, payload: bytes, archive: bool = False) -> list[str]:
    """``payload`` stored as sessions/a/p/layer-000 (from the file ``f``); the data options."""
    d = data(tmp_path, archive)
    (tmp_path / "f").write_bytes(payload)
    assert run("put", "f", "sessions/a/p/layer-000", *d)[0] == 0
    return d


def damage_the_page(tmp_path: Path) -> None:
    """Flip three bytes of sessions/a/p/layer-000's local copy (the store is closed)."""
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(tmp_path / "d0", tmp_path / "d1"))) as s:
        ext = s.stat("sessions/a/p/layer-000").extents[0]
    with open(ext.path, "r+b") as f:
        f.seek(ext.offset + 10)
        f.write(b"\xff\xfe\xfd")


def tier(run: Run, d: list[str]) -> str:
    """The tier ``ls`` shows for session a's first page."""
    return json.loads(run("ls", "a", "--json", *d)[1])[0]["tier"]


def test_put_ls_get_roundtrip(run: Run, tmp_path: Path) -> None:
    d = data(tmp_path)
    payload = os.urandom(300_000)
    (tmp_path / "in.bin").write_bytes(payload)
    rc, out, _ = run("put", "in.bin", "sessions/s1/p/layer-000", "--attr", "model=m1", *d)
    assert rc == 0 and "stored" in out
    assert run("put", "in.bin", "sessions/s1/p/layer-001", "--pin", *d)[0] == 0
    (tmp_path / "small").write_bytes(b"x" * 10)
    assert run("put", "small", "sessions/s2/p/layer-000", *d)[0] == 0
    rc, out, _ = run("ls", *d)
    assert rc == 0 and out.splitlines()[0].split()[:3] == ["SESSION", "PAGES", "SIZE"]
    assert "s1" in out and "s2" in out
    rc, out, _ = run("ls", "--json", "--sort", "size", *d)
    sessions = json.loads(out)
    assert [s["session"] for s in sessions] == ["s1", "s2"] and sessions[0]["pages"] == 2
    rc, out, _ = run("ls", "s1", "-l", "--json", *d)
    pages = json.loads(out)
    assert [p["path"] for p in pages] == ["sessions/s1/p/layer-000", "sessions/s1/p/layer-001"]
    assert (
        pages[0]["attrs"] == {"model": "m1"} and pages[1]["pinned"] and pages[0]["tier"] == "local"
    )
    rc, out, _ = run("ls", "s1", "-l", *d)
    assert "model=m1" in out and "CHECKSUM" in out
    rc, out, _ = run("ls", "sessions/s1/p/layer-000", "--json", *d)
    assert json.loads(out)[0]["size"] == 300_000
    rc, out, _ = run("get", "sessions/s1/p/layer-000", "out.bin", *d)
    assert rc == 0 and (tmp_path / "out.bin").read_bytes() == payload


def test_get_holds_a_large_page_once(run: Run, tmp_path: Path) -> None:
    """`kvfs get` wrote a bytes made of the read buffer: the page twice at its peak.
    Measured with tracemalloc, which does not see the read buffer (an anonymous mapping):
    the bytes made of it were the whole page."""
    import tracemalloc

    size = 32 << 20
    payload = os.urandom(size)
    d = one_page(run, tmp_path, payload)
    tracemalloc.start()
    try:
        rc, _, err = run("get", "sessions/a/p/layer-000", "out.bin", *d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 0, err
    assert (tmp_path / "out.bin").read_bytes() == payload
    assert peak < 0.2 * size, peak / size  # (before: 1.0)


def test_positionals_may_stand_after_flags(run: Run, tmp_path: Path) -> None:
    """`kvfs get PATH --json FILE` was refused (unrecognized arguments: FILE), as was
    `kvfs rm A --json B`: argparse took the positionals it found together, so one after a
    flag was no positional. A "--" still ends the flags."""
    d = one_page(run, tmp_path, b"q" * 1000)
    rc, out, _ = run("get", "sessions/a/p/layer-000", "--json", "out.bin", *d)
    assert rc == 0 and json.loads(out)["file"] == "out.bin"
    assert (tmp_path / "out.bin").read_bytes() == b"q" * 1000
    rc, out, _ = run("get", *d[:2], "sessions/a/p/layer-000", *d[2:], "two.bin")
    assert rc == 0 and (tmp_path / "two.bin").read_bytes() == b"q" * 1000
    rc, out, _ = run("get", "--json", *d, "--", "sessions/a/p/layer-000", "three.bin")
    assert rc == 0 and (tmp_path / "three.bin").read_bytes() == b"q" * 1000
    assert run("put", "f", "--pin", "sessions/b/p/layer-000", *d)[0] == 0
    rc, out, _ = run("rm", "a", "--json", "b", *d)
    assert rc == 0 and [r["target"] for r in json.loads(out)] == ["a", "b"]
    assert json.loads(run("ls", "--json", *d)[1]) == []


def test_stats_table_and_json(run: Run, tmp_path: Path) -> None:
    d = one_page(run, tmp_path, b"y" * 5000, archive=True)
    rc, out, _ = run("stats", *d)
    assert rc == 0 and "DEVICE" in out and "HIT RATE" in out and "spill queue" in out
    assert "evictions:" in out and "retention: keep" in out
    assert "; 1 page in 1 session; 1 distinct content (" in out  # (was "1 pages in 1 sessions")
    rc, out, _ = run("stats", "--json", *d)
    st = json.loads(out)
    assert st["pages"] == 1 and len(st["devices"]) == 2 and "archive" in st["extra"]
    rc, out, _ = run("stats", "--watch", "0.01", "--count", "2", *d)
    assert rc == 0 and out.count("DEVICE") == 2
    rc, out, _ = run("stats", "--watch", "0.01", "--count", "2", "--json", *d)
    lines = out.splitlines()  # JSON Lines (back-to-back indented objects parsed as neither)
    assert rc == 0 and len(lines) == 2 and all(json.loads(x)["pages"] == 1 for x in lines)


def test_stats_tiers_say_what_they_count() -> None:
    """Archive hits are pages restored and misses restores refused (a corrupt object);
    background failures are their own figure; counts of a command with no daemon say so."""
    from cli._store_cmds import render_stats

    st = kvfs.StoreStatistics(
        capacity_bytes=0, used_bytes=0, reserved_bytes=0, pages=0, sessions=0, local_blobs=0,
        local_bytes=0, logical_bytes=0, puts=0, dedup_puts=0, gets=4, hits=1, misses=3,
        corrupt_reads=1, bytes_written=0, bytes_read=0,
        extra={"archive": {"url": "file:///a", "blobs_restored": 3, "corrupt_objects": 1,
                           "errors": 5, "bytes_restored": 3 << 20}},
    )  # fmt: skip
    rows = {x.split()[0]: x.split()[1:] for x in render_stats(st).splitlines() if ":" not in x}
    assert rows["local"][:3] == ["1", "3", "25.0%"]
    assert rows["archive"][:5] == ["3", "1", "75.0%", "3.0", "MiB"]
    assert "background errors 5" in render_stats(st)
    assert "this command's own counts" not in render_stats(st)
    assert "this command's own counts" in render_stats(st, own_counters=True)


def test_pin_unpin_rm(run: Run, tmp_path: Path) -> None:
    d = data(tmp_path)
    (tmp_path / "f").write_bytes(b"z" * 100)
    run("put", "f", "sessions/a/p/layer-000", *d)
    run("put", "f", "sessions/b/p/layer-000", *d)
    assert run("pin", "a", "sessions/b/p/layer-000", *d)[0] == 0
    sessions = {s["session"]: s for s in json.loads(run("ls", "--json", *d)[1])}
    assert sessions["a"]["pinned"]
    assert json.loads(run("ls", "b", "--json", *d)[1])[0]["pinned"]
    assert run("unpin", "a", *d)[0] == 0
    assert not {s["session"]: s for s in json.loads(run("ls", "--json", *d)[1])}["a"]["pinned"]
    rc, out, _ = run("rm", "a", "--json", *d)
    assert rc == 0 and json.loads(out) == [
        {"target": "a", "kind": "session", "pages": 1, "result": 1}
    ]
    assert run("rm", "sessions/b/p/layer-000", *d)[0] == 0
    assert json.loads(run("ls", "--json", *d)[1]) == []
    rc, _, err = run("rm", "nothing", *d)
    assert rc == 3 and "no page or session 'nothing'" in err
    rc, out, _ = run("ls", "sessions", "--json", *d)  # no sessions: empty, not "no such"
    assert rc == 0 and json.loads(out) == []


def test_pin_and_unpin_of_a_session_count_its_pages(run: Run, tmp_path: Path) -> None:
    """`kvfs pin SESSION` printed "pinned session a (None pages)", then nothing of a count,
    and its --json said "pages": null (the store call returns none), where rm and a
    directory's pin count them; and one page was "(1 pages)"."""
    d = one_page(run, tmp_path, b"x" * 100)
    assert run("pin", "a", *d)[1] == "pinned session a (1 page)\n"
    assert run("unpin", "a", *d)[1] == "unpinned session a (1 page)\n"
    (r,) = json.loads(run("pin", "a", "--json", *d)[1])
    assert r["kind"] == "session" and r["pages"] == 1
    assert run("rm", "a", *d)[1] == "deleted session a (1 page)\n"


def test_a_directory_and_a_session_of_the_same_name_stay_apart(run: Run, tmp_path: Path) -> None:
    """`kvfs pin bar/` resolved the directory bar's session, then pinned it by its bare
    name, which means sessions/bar when that exists."""
    d = data(tmp_path)
    (tmp_path / "f").write_bytes(b"z" * 100)
    run("put", "f", "sessions/bar/p/layer-000", *d)
    run("put", "f", "bar/engine-file", *d)
    assert run("pin", "bar/", *d)[0] == 0
    pinned = {s["dir"]: s["pinned"] for s in json.loads(run("ls", "--json", *d)[1])}
    assert pinned == {"bar": True, "sessions/bar": False}
    assert run("rm", "bar/", *d)[0] == 0
    assert [s["dir"] for s in json.loads(run("ls", "--json", *d)[1])] == ["sessions/bar"]


def test_ls_shows_the_pages_a_session_pin_keeps(run: Run, tmp_path: Path) -> None:
    """`kvfs ls SESSION` showed PINNED blank (and "pinned": false) for the pages of a pinned
    session, which user.kvfs.pinned on the mount says are pinned."""
    d = one_page(run, tmp_path, b"x" * 100)
    assert (
        run("put", "f", "vllm/x", *d)[0] == 0 and run("put", "f", "sessions/vllm/p/l", *d)[0] == 0
    )
    assert run("pin", "a", *d)[0] == 0 and run("pin", "vllm/", *d)[0] == 0
    rc, out, _ = run("ls", "a", *d)
    assert rc == 0 and out.splitlines()[2].split()[4] == "session", out
    for target, want in (("vllm/", True), ("sessions/vllm/p/l", False)):
        (p,) = json.loads(run("ls", target, "--json", *d)[1])
        assert (p["pinned"], p["session_pinned"]) == (False, want), target


def test_pin_rm_and_evict_take_a_prefix_directory(run: Run, tmp_path: Path) -> None:
    """`kvfs ls /mnt/sessions/s/p0` worked and `kvfs pin` of the same path said "no page or
    session": a prefix's directory is neither."""
    d = data(tmp_path, archive=True)
    for p in ("p0", "p1"):
        for layer in range(2):
            (tmp_path / "f").write_bytes(os.urandom(9000))  # no data shared with a pin
            assert run("put", "f", f"sessions/s/{p}/layer-00{layer}", *d)[0] == 0
    rc, out, _ = run("pin", "sessions/s/p0", "--json", *d)
    assert rc == 0 and json.loads(out) == [
        {"target": "sessions/s/p0", "kind": "directory", "pages": 2, "result": 2}
    ]
    pinned = {p["path"]: p["pinned"] for p in json.loads(run("ls", "s", "--json", *d)[1])}
    assert [k for k, v in pinned.items() if v] == [
        "sessions/s/p0/layer-000",
        "sessions/s/p0/layer-001",
    ]
    rc, out, _ = run("evict", "sessions/s/p1/", "--json", *d)
    assert rc == 0 and json.loads(out)[0]["kind"] == "directory"
    tiers = {p["path"]: p["tier"] for p in json.loads(run("ls", "s", "--json", *d)[1])}
    assert [tiers[f"sessions/s/p1/layer-00{i}"] for i in range(2)] == ["archive"] * 2
    assert run("rm", "sessions/s/p1", *d)[0] == 0
    assert [p["path"] for p in json.loads(run("ls", "s", "--json", *d)[1])] == list(pinned)[:2]
    assert run("pin", "sessions/s/p9", *d)[0] == 3  # still: nothing there


def test_a_typo_in_the_device_list_changes_nothing(run: Run, tmp_path: Path) -> None:
    """`kvfs ls --data d0,d0-typo` made d0-typo a device of the store for good: every later
    open with d0 alone failed. The wrong order said only that d0-typo held no store."""
    d0, typo = tmp_path / "d0", tmp_path / "d0-typo"
    (tmp_path / "f").write_bytes(b"z" * 100)
    assert run("put", "f", "sessions/a/p/layer-000", "--data", str(d0), "--archive", "")[0] == 0
    for cmd in (["ls"], ["put", "f", "sessions/a/p/layer-001"]):
        rc, _, err = run(*cmd, "--data", f"{d0},{typo}", "--archive", "")
        assert rc == 2 and f"{typo}: not a data directory of the store" in err, err
        assert not typo.exists()
    rc, out, _ = run("ls", "--json", "--data", str(d0), "--archive", "")
    assert rc == 0 and [s["pages"] for s in json.loads(out)] == [1]
    rc, _, err = run("ls", "--data", f"{typo},{d0}", "--archive", "")
    assert rc == 3 and f"{d0} is a data directory of one" in err and "original order" in err


def test_a_restore_that_cannot_reach_the_archive_leaves_no_store(run: Run, tmp_path: Path) -> None:
    """On a fresh host, `kvfs restore` with the archive unreachable exited 8 and left a new,
    empty store behind (index, lock, blobs/): the docs say nothing changed."""
    (tmp_path / "was-empty").mkdir()
    for dirs in (f"{tmp_path}/new/x/d0,{tmp_path}/new/x/d1", f"{tmp_path}/was-empty"):
        url = "s3://b?endpoint=http://127.0.0.1:1&open_deadline=0.5&deadline=0.5"
        rc, _, err = run("restore", "s1", "--data", dirs, "--archive", url)
        assert rc == 8, err
    assert not (tmp_path / "new").exists()
    assert list((tmp_path / "was-empty").iterdir()) == []


def test_evict_refuses_the_only_copy_without_force(run: Run, tmp_path: Path) -> None:
    d = one_page(run, tmp_path, os.urandom(8192))
    rc, _, err = run("evict", "a", *d)
    assert rc == 9 and "--force" in err and err.count("\n") == 1
    assert tier(run, d) == "local"
    rc, out, _ = run("evict", "a", "--force", "--json", *d)
    assert rc == 0 and json.loads(out)[0]["freed_bytes"] > 0


def test_evict_without_the_archive_refuses_archived_pages_too(run: Run, tmp_path: Path) -> None:
    """Opened without its archive, an evict deletes: a page archived before (local+archive)
    was taken as safe, and was deleted here and, at the next open with the archive, there."""
    d = one_page(run, tmp_path, os.urandom(8192), archive=True)
    assert run("spill", "a", *d)[0] == 0 and run("restore", "a", *d)[0] == 0
    assert tier(run, d) == "local+archive"
    rc, _, err = run("evict", "a", *data(tmp_path))
    assert rc == 9 and "1 page(s) (1 of them archived before" in err and "--archive" in err
    assert tier(run, d) == "local+archive"
    assert run("evict", "a", *d)[0] == 0 and tier(run, d) == "archive"


def test_evict_force_deletes_the_target_not_what_shares_its_data(run: Run, tmp_path: Path) -> None:
    """Without an archive, `evict a --force` deleted every page sharing a's data: session b
    with the same bytes was gone too."""
    d = one_page(run, tmp_path, os.urandom(8192))
    assert run("put", "f", "sessions/b/p/layer-000", *d)[0] == 0
    rc, _, err = run("evict", "a", *d)
    assert rc == 9 and "would delete 1 page(s) (--force" in err
    rc, out, _ = run("evict", "a", "--force", "--json", *d)
    assert rc == 0 and json.loads(out)[0]["freed_bytes"] == 0  # b still holds the data
    assert [s["session"] for s in json.loads(run("ls", "--json", *d)[1])] == ["b"]
    assert run("get", "sessions/b/p/layer-000", "back", *d)[0] == 0
    assert (tmp_path / "back").read_bytes() == (tmp_path / "f").read_bytes()
    rc, out, _ = run("evict", "b", "--force", "--json", *d)
    assert rc == 0 and json.loads(out)[0]["freed_bytes"] > 0
    # a pin on the session sharing the data does not keep the page named (--force said
    # "0 B freed" and deleted nothing)
    assert run("put", "f", "sessions/c/p/layer-000", *d)[0] == 0
    assert run("put", "f", "sessions/e/p/layer-000", *d)[0] == 0
    assert run("pin", "e", *d)[0] == 0
    assert run("evict", "c", "--force", *d)[0] == 0
    assert [s["session"] for s in json.loads(run("ls", "--json", *d)[1])] == ["e"]


def test_evict_with_an_archive_keeps_the_page(run: Run, tmp_path: Path) -> None:
    d = one_page(run, tmp_path, os.urandom(8192), archive=True)
    rc, out, _ = run("evict", "sessions/a/p/layer-000", "--json", *d)
    assert rc == 0 and json.loads(out)[0]["freed_bytes"] > 0
    assert tier(run, d) == "archive"
    rc, out, _ = run("get", "sessions/a/p/layer-000", "back", *d)
    assert rc == 0 and (tmp_path / "back").read_bytes() == (tmp_path / "f").read_bytes()


def test_evict_of_a_pinned_session_says_what_it_kept(run: Run, tmp_path: Path) -> None:
    """It printed "0 B freed" and no reason."""
    d = one_page(run, tmp_path, os.urandom(8192), archive=True)
    assert run("pin", "a", *d)[0] == 0
    rc, out, _ = run("evict", "a", *d)
    assert rc == 0 and "0 B freed (1 pinned page(s) kept: kvfs unpin first)" in out, out
    rc, out, _ = run("evict", "a", "--json", *d)
    assert json.loads(out)[0]["pinned_kept"] == 1 and tier(run, d) == "local"


def test_spill_and_restore(run: Run, tmp_path: Path) -> None:
    d = one_page(run, tmp_path, os.urandom(20000), archive=True)
    rc, out, _ = run("spill", "a", "--json", *d)
    spilled = json.loads(out)[0]  # page bytes, as a restore counts; the upload beside them
    assert rc == 0 and spilled["bytes"] == 20000 and spilled["uploaded_bytes"] > 0
    assert tier(run, d) == "archive"
    rc, out, _ = run("ls", "--archived", "--json", *d)
    assert [(x["session"], x["hosts"]) for x in json.loads(out)] == [("a", 1)]
    header, _rule, row = run("ls", "--archived", *d)[1].splitlines()[:3]
    assert header.split() == ["SESSION", "PAGES", "SIZE", "SPILLED", "STORE", "HOSTS"]
    assert row.split()[0] == "a" and row.split()[-1] == "1"
    rc, out, _ = run("restore", "a", *d)
    assert rc == 0 and "restored a: 19.5 KiB" in out
    assert tier(run, d) == "local+archive"
    rc, out, _ = run("spill", "a", *d)  # again: nothing to upload, the local copy goes
    assert rc == 0 and "spilled a: 19.5 KiB" in out and "(0 B uploaded)" in out, out
    rc, _, err = run("spill", "a", *data(tmp_path))
    assert rc == 8 and "archive" in err
    # a fresh host sharing the archive lists and restores the session with nothing made
    # first (it was "no kvfs store in ..." until a put made one)
    fresh = ["--data", f"{tmp_path}/h2", "--archive", f"file://{tmp_path}/arch"]
    rc, out, err = run("ls", "--archived", "--json", *fresh)
    assert rc == 0, err
    assert [x["session"] for x in json.loads(out)] == ["a"]
    rc, out, err = run("restore", "a", *fresh)
    assert rc == 0 and "restored a" in out, err
    assert run("get", "sessions/a/p/layer-000", "again", *fresh)[0] == 0
    assert (tmp_path / "again").read_bytes() == (tmp_path / "f").read_bytes()
    # without an archive given, a missing store is still an error, not a new empty one
    rc, _, err = run("restore", "a", "--data", f"{tmp_path}/h3")
    assert rc == 3 and "no kvfs store" in err and not (tmp_path / "h3").exists()


def test_restore_reports_the_page_bytes_that_came_back_as_spill_reports_those_that_left(
    run: Run, tmp_path: Path
) -> None:
    """Two pages of a session holding the same bytes: spill said 2 x their size left the
    local tier, and restore said it brought back half of that (the store counts each
    content once), though ls showed the whole session local again."""
    d = one_page(run, tmp_path, os.urandom(20000), archive=True)
    assert run("put", "f", "sessions/a/p/layer-001", *d)[0] == 0
    rc, out, _ = run("spill", "a", "--json", *d)
    assert rc == 0 and json.loads(out)[0]["bytes"] == 40000
    rc, out, _ = run("restore", "a", "--json", *d)
    assert rc == 0 and json.loads(out)[0]["bytes"] == 40000
    assert run("spill", "a", *d)[0] == 0
    rc, out, _ = run("restore", "a", *d)
    assert rc == 0 and "restored a: 39.1 KiB" in out, out


def test_fsck_finds_and_repairs(run: Run, tmp_path: Path) -> None:
    d = one_page(run, tmp_path, os.urandom(50000))
    assert run("fsck", *d)[0] == 0
    damage_the_page(tmp_path)
    (tmp_path / "d1" / "stray").write_bytes(b"")
    # one line on stderr, from a process of its own (in this one pytest owns the logging):
    # the event log's record of the failed read came first, timestamped
    cmd = [sys.executable, "-m", "cli", "get", "sessions/a/p/layer-000", "out", *d]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert got.returncode == 5 and got.stderr.startswith("kvfs get: "), got.stderr
    assert got.stderr.count("\n") == 1, got.stderr
    rc, out, _ = run("fsck", "--json", *d)
    found = json.loads(out)
    assert rc == 5 and len(found["corrupt"]) == 1
    assert found["damaged_pages"] == ["sessions/a/p/layer-000"]  # named as the user knows it
    assert "repaired" not in found  # (a repair's: docs/cli.md; "repaired: 0" read as tried)
    rc, out, _ = run("fsck", *d)
    assert "sessions/a/p/layer-000" in out and "deletes the damaged pages" in out
    assert "repaired" not in out, out
    rc, out, _ = run("fsck", "--repair", *d)
    assert rc == 0 and "repaired" in out
    assert "deleted sessions/a/p/layer-000: its data was damaged and held nowhere else" in out
    assert run("fsck", *d)[0] == 0
    assert run("ls", "sessions/a/p/layer-000", *d)[0] == 3


def test_fsck_lists_a_page_whose_name_holds_a_newline_on_one_line(run: Run, tmp_path: Path) -> None:
    """fsck printed damaged page names as they are: a name holding a newline split its
    entry over two lines, which read as a second entry (ls escapes it)."""
    d = data(tmp_path)
    (tmp_path / "f").write_bytes(os.urandom(50000))
    assert run("put", "f", "sessions/nl\nx/p/layer-000", *d)[0] == 0
    with kvfs.open_store_sync(kvfs.StoreConfig(data_dirs=(tmp_path / "d0", tmp_path / "d1"))) as s:
        ext = s.stat("sessions/nl\nx/p/layer-000").extents[0]
    with open(ext.path, "r+b") as f:
        f.seek(ext.offset + 10)
        f.write(b"\xff\xfe\xfd")
    rc, out, _ = run("fsck", *d)
    assert rc == 5 and "\n  sessions/nl\\nx/p/layer-000\n" in out, out
    rc, out, _ = run("fsck", "--repair", *d)
    assert rc == 0 and "\n  deleted sessions/nl\\nx/p/layer-000: its data" in out, out


def test_fsck_check_archive_without_an_archive_keeps_the_local_findings_and_exits_8(
    run: Run, tmp_path: Path
) -> None:
    """With no archive configured, fsck --check-archive did the local check (and repair),
    then dropped its findings for a plain error, exit 1, where docs/cli.md gives 8 for an
    archive not configured and says the local check and repair stand."""
    d = one_page(run, tmp_path, os.urandom(5000))
    damage_the_page(tmp_path)
    rc, out, err = run("fsck", "--check-archive", "--repair", "--json", *d)
    found = json.loads(out)
    assert rc == 8 and "no archive tier is configured" in found["archive_error"][0], err
    assert found["damaged_pages"] == ["sessions/a/p/layer-000"] and found["repaired"], found
    assert run("ls", "sessions/a/p/layer-000", *d)[0] == 3  # the repair stands
    rc, out, _ = run("fsck", "--check-archive", *d)
    assert rc == 8 and "clean; the archive could not be checked" in out, out


def test_fsck_repair_keeps_a_damaged_pinned_page_and_says_so(run: Run, tmp_path: Path) -> None:
    """fsck --repair deleted a damaged pinned page held nowhere else, and said "repaired"
    (exit 0): the pin vanished without a word."""
    d = one_page(run, tmp_path, os.urandom(50000))
    assert run("pin", "sessions/a/p/layer-000", *d)[0] == 0
    damage_the_page(tmp_path)
    rc, out, _ = run("fsck", "--repair", *d)
    assert rc == 5 and "1 damaged page(s) kept that cannot be read" in out, out
    assert "kept sessions/a/p/layer-000, pinned: its data was damaged" in out
    rc, out, _ = run("fsck", "--repair", "--json", *d)  # said again, not forgotten
    assert rc == 5 and json.loads(out)["unrecoverable"] == ["sessions/a/p/layer-000"]
    assert run("unpin", "sessions/a/p/layer-000", *d)[0] == 0
    rc, out, _ = run("fsck", "--repair", *d)
    assert rc == 0 and "deleted sessions/a/p/layer-000" in out, out
    assert run("fsck", *d)[0] == 0


def test_fsck_check_archive_finds_damaged_objects_and_uploads_again_what_is_held(
    run: Run, tmp_path: Path
) -> None:
    """A damaged archive object was noticed only by the read that needed it, and fsck, which
    checked the local tier alone, said "clean" (an audit of hosts sharing a bucket)."""
    d = data(tmp_path, archive=True)
    (tmp_path / "f").write_bytes(os.urandom(40000))
    (tmp_path / "g").write_bytes(os.urandom(40000))
    assert run("put", "f", "sessions/gone/p/layer-000", *d)[0] == 0
    assert run("put", "g", "sessions/held/p/layer-000", *d)[0] == 0
    for s in ("gone", "held"):
        assert run("spill", s, *d)[0] == 0
    assert run("restore", "held", *d)[0] == 0  # local again, and archived
    objects = sorted((tmp_path / "arch" / "blobs").iterdir())
    assert len(objects) == 2
    for o in objects:
        raw = bytearray(o.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        o.write_bytes(bytes(raw))
    assert run("fsck", *d)[0] == 0  # the local tier is fine
    rc, out, _ = run("fsck", "--check-archive", "--json", *d)
    found = json.loads(out)
    assert rc == 5 and len(found["archive_corrupt"]) == 2
    assert found["archive_damaged_pages"] == [
        "sessions/gone/p/layer-000",
        "sessions/held/p/layer-000",
    ]
    rc, out, _ = run("fsck", "--check-archive", "--repair", *d)
    assert rc == 5 and "1 page(s) whose archive object is damaged are held nowhere here" in out
    found = json.loads(run("fsck", "--check-archive", "--json", *d)[1])
    assert found["archive_damaged_pages"] == ["sessions/gone/p/layer-000"]  # held: uploaded
    assert run("evict", "held", *d)[0] == 0
    rc, _, _ = run("get", "sessions/held/p/layer-000", "back", *d)
    assert rc == 0 and (tmp_path / "back").read_bytes() == (tmp_path / "g").read_bytes()
    rc, out, _ = run("fsck", "--check-archive", *data(tmp_path))
    assert rc == 8 and "no archive tier is configured" in out


def test_config_shows_sources_and_masks(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "k.toml"
    f.write_text('[store]\nio_threads = 5\n[archive]\narchive_url = "s3://K:hidden@b/p"\n')
    monkeypatch.setenv("KVFS_CAPACITY", "1GiB")
    # credentials in the URL are refused (exit 2), and the configuration is shown all the
    # same, masked: it is what the user has to fix
    rc, out, err = run("config", "--config", str(f), "--data", "dd")
    assert rc == 2 and "hidden" not in out + err and "s3://***@b/p" in out
    assert "credentials may not be given in the archive URL" in err
    assert "io_threads = 5  # " + str(f) in out and "# $KVFS_CAPACITY" in out
    rc, out, _ = run("config", "--config", str(f), "--json")
    doc = json.loads(out)
    assert doc["options"]["store.io_threads"] == {"value": 5, "source": str(f)}
    assert "hidden" not in out and "credentials" in doc["error"]
    f.write_text('[store]\nio_threads = 5\n[archive]\narchive_url = "s3://b/p"\n')
    rc, out, _ = run("config", "--config", str(f), "--json")
    assert rc == 0 and json.loads(out)["error"] is None
    rc, _, err = run("config", "--config", str(tmp_path / "none.toml"))
    assert rc == 2 and "none.toml does not exist" in err  # a configuration error


def test_the_index_is_shown_by_its_absolute_path(run: Run, tmp_path: Path) -> None:
    """With a relative data directory (the embedded default, ./kvfs-data), `kvfs stats` and
    `kvfs config` showed "index kvfs-data/kvfs-index.sqlite3": from another directory (a
    daemon's stats, asked from elsewhere) that named no file, or another store's."""
    (tmp_path / "f").write_bytes(b"i" * 100)
    assert run("put", "f", "sessions/a/p/layer-000", "--archive", "")[0] == 0
    index = str(tmp_path / "kvfs-data" / "kvfs-index.sqlite3")
    rc, out, _ = run("stats", "--json", "--archive", "")
    assert rc == 0 and json.loads(out)["extra"]["settings"]["index"] == index
    assert f"index {index}\n" in run("stats", "--archive", "")[1]
    rc, out, _ = run("config", "--json")
    assert rc == 0 and json.loads(out)["index"] == index
    assert f"# index: {index}\n" in run("config")[1]


def test_config_shows_the_archive_that_auto_and_a_relative_url_come_to(
    run: Run, tmp_path: Path
) -> None:
    """`kvfs config` showed `archive_url = "auto"` and `"file://arch"` as given, and nothing
    said whether the store had an archive tier (auto: only with the default data directory)
    nor where a relative one was (taken from the current directory)."""
    for flags, archive in (
        ([], f"file://{tmp_path}/kvfs-archive"),
        (["--data", "d"], None),
        (["--data", "d", "--archive", "file://arch"], f"file://{tmp_path}/arch"),
        (["--archive", "s3://b/p"], "s3://b/p"),
    ):
        rc, out, _ = run("config", *flags)
        assert rc == 0 and f"# archive: {archive or 'none'}\n" in out, out
        rc, out, _ = run("config", "--json", *flags)
        assert rc == 0 and json.loads(out)["archive"] == archive


def test_config_takes_file_localhost_and_a_quoted_path_as_the_store_does(
    run: Run, tmp_path: Path
) -> None:
    """docs/archive.md: file://localhost/DIR is file:///DIR (RFC 8089). The settings took it
    for the relative directory localhost/DIR under the working directory (kvfs config
    showed it, a daemon opened it), and `kvfs config --check` looked for an archive's
    directory with its %-escapes as they are, so an archive that was there was 'not there
    yet' and nothing was tried in it."""
    arch = tmp_path / "my arch"
    arch.mkdir()
    plain = f"file://{tmp_path}/my%20arch"
    for url in (f"file://localhost{tmp_path}/my%20arch", plain):
        rc, out, _ = run("config", "--json", "--data", "dd", "--archive", url)
        assert rc == 0 and json.loads(out)["archive"] == plain, out
        rc, out, _ = run("config", "--check", "--json", "--data", "dd", "--archive", url)
        details = {c["check"].split(":")[0]: c["detail"] for c in json.loads(out)}
        assert rc == 0 and details["archive"] == "reachable", out
        assert details["archive round trip"] == "put, get and delete of one object"
    assert not (tmp_path / "localhost").exists()
    assert set(os.listdir(arch)) <= {".objectstore-tmp"}  # (the round trip's object went)


def test_config_check_of_a_configuration_that_is_not_valid_tries_nothing(
    run: Run, tmp_path: Path
) -> None:
    """`kvfs config --check --json --archive bogus://x` printed the configuration's dump (a
    JSON object, not the checks' list a script reads) before its error: `--check` of a
    configuration that is not valid says why in one line, exit 2, as for a bad file."""
    for url in ("bogus://x", "s3://K:hidden@b/p"):
        for fmt in ([], ["--json"]):
            rc, out, err = run("config", "--check", *fmt, "--data", "dd", "--archive", url)
            assert (rc, out) == (2, ""), (url, fmt, out)
            assert err.startswith("kvfs config: ") and err.count("\n") == 1, err
            assert "hidden" not in err
    assert not (tmp_path / "dd").exists()


def test_size_presets_and_hf_config(run: Run, tmp_path: Path) -> None:
    rc, out, _ = run("size", "--model", "Qwen2.5-1.5B", "--dtype", "fp16", "--json")
    assert rc == 0 and json.loads(out)["bytes_per_token"] == 28672
    rc, out, _ = run(
        "size",
        "--model",
        "llama-3.3-70b",
        "--local",
        "4TiB",
        "--rate",
        "10000",
        "--session-tokens",
        "32768",
        "--json",
    )
    r = json.loads(out)
    assert r["bytes_per_token"] == 327680
    assert r["local_tokens"] == (4 << 40) // 327680 and r["local_sessions"] == (4 << 40) // (
        327680 * 32768
    )
    assert r["local_residency_s"] == pytest.approx((4 << 40) / (10000 * 327680))
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 512,
            }
        )
    )
    rc, out, _ = run("size", "--hf-config", str(cfg), "--dtype", "fp8", "--json")
    assert json.loads(out)["bytes_per_token"] == 2 * 4 * 2 * 64 * 1
    rc, out, _ = run("size", "--model", "Qwen2.5-1.5B", "--local", "1GiB", "--rate", "100")
    assert rc == 0 and "stays local" in out
    assert out.split("\n")[0].split() == ["FIGURE", "VALUE"]  # (as every table's headers)
    assert run("size", "--model", "gpt-9")[0] == 2
    assert run("size", "--model", "Qwen2.5-1.5B", "--dtype", "fp7")[0] == 2


def test_missing_store_and_missing_page(run: Run, tmp_path: Path) -> None:
    rc, _, err = run("ls", "--data", str(tmp_path / "nowhere"))
    assert rc == 3 and "no kvfs store" in err
    (tmp_path / "f").write_bytes(b"1")
    d = data(tmp_path)
    run("put", "f", "sessions/a/p/layer-000", *d)
    assert run("get", "sessions/a/p/layer-009", *d)[0] == 3
    rc, _, err = run("put", "f", "sessions/a/p/layer-000", *d)
    assert rc == 1 and "exists" in err
    assert run("put", "f", "sessions/a/p/layer-000", "--replace", *d)[0] == 0
    assert run("put", "f", "/abs", *d)[0] == 2
    # a bad name is refused before anything is made for it (it made a new store first)
    rc, _, err = run("put", "f", "../up", "--data", str(tmp_path / "never"))
    assert rc == 2 and "made a new store" not in err and not (tmp_path / "never").exists()
    assert run("ls", "--daemon", *d)[0] == 7


def test_a_missing_session_is_named_as_the_user_typed_it(run: Run, tmp_path: Path) -> None:
    d = one_page(run, tmp_path, b"x", archive=True)
    for cmd in ("ls", "rm", "pin", "unpin", "evict", "spill", "restore"):
        rc, _, err = run(cmd, "nosuch", *d)
        assert rc == 3 and "'nosuch'" in err and "sessions/nosuch" not in err, (cmd, err)


def test_bad_arguments_and_one_line_errors(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    cmd = [sys.executable, "-m", "cli"]
    r = subprocess.run(
        [*cmd, "ls", "--sort", "colour"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = subprocess.run([*cmd, "evict"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 2
    for bad in ("0", "-1", "nan", "soon"):  # (0 and -1 unmounted, then reported a failure)
        r = subprocess.run(
            [*cmd, "umount", "--timeout", bad, str(tmp_path)], capture_output=True, text=True
        )
        assert r.returncode == 2 and "--timeout" in r.stderr, (bad, r.stderr)
    r = subprocess.run(
        [*cmd, "ls", "--data", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("kvfs ls: ")
    r = subprocess.run(
        [*cmd, "--debug", "ls", "--data", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    # the traceback, then the same exit code and last line as without --debug (it was 1)
    assert r.returncode == 3 and "Traceback" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("kvfs ls: ")


def test_a_file_it_cannot_open_is_named_as_cp_names_it(run: Run, tmp_path: Path) -> None:
    """`kvfs put nofile ...` said "kvfs put: [Errno 2] No such file or directory: 'nofile'",
    Python's words; the file comes first now, and the reason (exit 3 and 1 as before)."""
    d = one_page(run, tmp_path, b"x" * 100)
    rc, _, err = run("put", "nofile", "sessions/a/p/layer-001", *d)
    assert (rc, err) == (3, "kvfs put: nofile: No such file or directory\n")
    rc, _, err = run("put", str(tmp_path), "sessions/a/p/layer-001", *d)
    assert (rc, err) == (1, f"kvfs put: {tmp_path}: Is a directory\n")
    rc, _, err = run("get", "sessions/a/p/layer-000", "no/dir/out", *d)
    assert (rc, err) == (3, "kvfs get: no/dir/out: No such file or directory\n")
    rc, _, err = run("size", "--hf-config", "config.json")
    assert (rc, err) == (3, "kvfs size: config.json: No such file or directory\n")


def test_a_commands_warning_is_one_line_naming_the_command(run: Run, tmp_path: Path) -> None:
    """A warning logged while a command ran came out as the daemon's log records it
    ("2026-11-27 23:43:21,252 WARNING kvfs.engine: ..."), unlike the command's own lines;
    --debug keeps that record's form."""
    d = one_page(run, tmp_path, b"w" * 5000, archive=True)
    assert run("spill", "a", *d)[0] == 0
    without = data(tmp_path)  # the same store, with no archive configured
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    cmd = [sys.executable, "-m", "cli"]
    r = subprocess.run([*cmd, "ls", *without], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "SESSION" in r.stdout
    assert r.stderr.splitlines() == [
        "kvfs ls: warning: opened without an archive, but some pages are held only by the "
        f"archive this store spilled to (file://{tmp_path}/arch): they read as missing until "
        "it is configured"
    ]
    r = subprocess.run([*cmd, "--debug", "ls", *without], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and " WARNING kvfs.engine: opened without an archive" in r.stderr


def test_a_commands_log_line_of_an_exception_says_where_its_traceback_is() -> None:
    """A command's one-line log format dropped an error's traceback without a word."""
    from cli.__main__ import _CommandFormatter

    try:
        raise OSError("disk on fire")
    except OSError:
        record = logging.LogRecord(
            "kvfs.spill",
            logging.ERROR,
            __file__,
            1,
            "unexpected error in %s",
            ("a",),
            sys.exc_info(),
        )
    assert _CommandFormatter("spill").format(record) == (
        "kvfs spill: error: unexpected error in a (kvfs --debug shows its traceback)"
    )


def test_a_bad_target_among_several_changes_nothing(run: Run, tmp_path: Path) -> None:
    """`kvfs rm a b typo` deleted a and b, then reported only the typo."""
    d = data(tmp_path)
    (tmp_path / "f").write_bytes(b"z" * 100)
    for s in ("a", "b"):
        run("put", "f", f"sessions/{s}/p/layer-000", *d)
    for cmd in ("rm", "pin", "evict"):
        rc, _, err = (
            run(cmd, "a", "b", "typo", "--force", *d)
            if cmd == "evict"
            else run(cmd, "a", "b", "typo", *d)
        )
        assert rc == 3 and "typo" in err
    sessions = json.loads(run("ls", "--json", *d)[1])
    assert [(s["session"], s["pinned"], s["local_bytes"]) for s in sessions] == [
        ("a", False, 100),
        ("b", False, 100),
    ]
    d = data(tmp_path, archive=True)
    rc, _, err = run("spill", "a", "typo", *d)
    assert rc == 3 and "typo" in err
    assert json.loads(run("ls", "--json", *d)[1])[0]["archived_bytes"] == 0


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("KVFS_METRICS_PORT", "99999", "from 0 to 65535"),
        ("KVFS_CAPACITY", "1e400", "not a size"),
        ("KVFS_CAPACITY", "-5MiB", "not a size"),
        ("KVFS_CAPACITY", "1000", "at least 1MiB"),
        ("KVFS_CAPACITY", "0.5", "not a whole number of bytes"),
        ("KVFS_ZSTD_LEVEL", "99", "from 1 to 19"),
        ("KVFS_HIGH_WATERMARK", "1.5", "from 0 to 1"),
        # taken, then failed the open ("max_workers must be greater than 0"), or the check
        # of the whole configuration without naming where the value came from
        ("KVFS_ARCHIVE_CONCURRENCY", "0", "at least 1 is needed"),
        ("KVFS_IO_THREADS", "0", "at least 1 is needed"),
        ("KVFS_UPLOAD_PROCESSES", "-1", "at least 0 is needed"),
        ("KVFS_RETENTION", "-1d", "at least 0 is needed"),
        # taken: a negative number of seconds as 0, the smallest session left out of its
        # series, a nan that the background spiller's sleep raised on
        ("KVFS_IDLE_SECONDS", "-5", "at least 0 is needed"),
        ("KVFS_GC_GRACE", "-1", "at least 0 is needed"),
        ("KVFS_METRICS_SESSIONS", "-1", "at least 0 is needed"),
        ("KVFS_SPILL_INTERVAL", "nan", "a number is needed"),
        ("KVFS_IO_THREADS", "2.5", "an integer is needed"),
        ("KVFS_DATA_DIRS", " , ", "a list of directories is needed"),
    ],
)
def test_out_of_range_settings_are_refused_by_name(
    run: Run, monkeypatch: pytest.MonkeyPatch, var: str, value: str, says: str
) -> None:
    """They were accepted (a port wrapped around to another, a 1-byte cap) or failed later
    with a message that did not name the setting."""
    monkeypatch.setenv(var, value)
    rc, _, err = run("config")
    assert rc == 2 and f"${var}" in err and says in err, err


def test_a_reader_that_goes_away_is_no_error(tmp_path: Path) -> None:
    """`kvfs config --json | head -1` printed "[Errno 32] Broken pipe" and exited 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    with subprocess.Popen(
        [sys.executable, "-m", "cli", "config", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    ) as p:
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # before it writes
        err = p.stderr.read()
        assert p.wait() == 141 and err == b""


def test_a_put_that_makes_a_new_store_says_so(run: Run, tmp_path: Path) -> None:
    """A forgotten --config made a store in the working directory without a word."""
    (tmp_path / "f").write_bytes(b"z")
    rc, _, err = run("put", "f", "x/y")
    assert rc == 0 and "made a new store in kvfs-data" in err
    rc, _, err = run("put", "f", "x/z")
    assert rc == 0 and "new store" not in err


def test_version(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"kvfs {kvfs.__version__}"


def test_tables_line_up_with_wide_characters_and_stay_one_line_per_row() -> None:
    """Columns were padded by len(): a CJK session name shifted its row, and a page name
    holding a newline broke the table."""
    import io

    from cli._util import print_table

    buf = io.StringIO()
    rows = [["用户-会话", 3], ["abc", 12], ["a\nb", 1], ["a\\nb", 2]]
    print_table(["SESSION", "PAGES"], rows, file=buf)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 6
    assert lines[2] == "用户-会话      3" and lines[3] == "abc           12"
    # (a backslash is escaped too: the name a, newline, b and the name a\nb printed alike)
    assert lines[4] == "a\\nb           1" and lines[5] == "a\\\\nb          2"


def test_a_bad_archive_url_is_told_before_anything_starts(run: Run, tmp_path: Path) -> None:
    """`kvfs mount` with an archive URL no backend takes says so at once, exit 2, as `ls`
    does (it detached a daemon that then failed: "ValueError: ...", exit 1)."""
    (tmp_path / "mnt").mkdir()
    for cmd in (["mount", str(tmp_path / "mnt")], ["ls"]):
        rc, _, err = run(*cmd, "--data", str(tmp_path / "d"), "--archive", "http://x")
        assert rc == 2 and err.count("\n") == 1, err
        assert "unsupported archive URL 'http://x'" in err and "ValueError" not in err
    assert not (tmp_path / "d").exists()


def test_journald_asked_for_where_it_is_not_running(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """log_target = "journald" without journald: `kvfs mount` says so at once, exit 2 (the
    detached daemon failed, and the parent said only "the daemon exited (3)")."""
    import kvfs._metrics

    absent = str(tmp_path / "no-journal-socket")
    monkeypatch.setattr(kvfs._metrics.JournaldHandler.__init__, "__defaults__", (absent,))
    monkeypatch.setenv("KVFS_LOG_TARGET", "journald")
    (tmp_path / "mnt").mkdir()
    rc, _, err = run("mount", "--data", str(tmp_path / "d"), str(tmp_path / "mnt"))
    assert rc == 2 and "journald is not running here" in err and err.count("\n") == 1, err


def test_errors_inside_an_exception_group_keep_their_line_and_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Inside a trio nursery errors come grouped: Ctrl-C during `kvfs restore` exited 1 with
    "Exceptions from Trio nursery (1 sub-exception)" instead of 130, and a PageNotFound in
    `kvfs bench control` read the same, exit 1 instead of 3."""
    import trio

    from cli import __main__ as entry
    from cli import _store_cmds

    def raising(group: BaseException) -> Callable[..., int]:
        def cmd(args: object) -> int:
            raise group

        return cmd

    cases = [
        (BaseExceptionGroup("nursery", [KeyboardInterrupt()]), 130, "kvfs: interrupted"),
        (
            ExceptionGroup("nursery", [kvfs.PageNotFound("no page 'x'")]),
            3,
            "kvfs ls: no page 'x'",
        ),
        (
            BaseExceptionGroup(
                "outer",
                [
                    trio.Cancelled._create(),
                    ExceptionGroup("inner", [kvfs.CapacityExceeded("full")]),
                ],
            ),
            4,
            "kvfs ls: full",
        ),
    ]
    for group, code, line in cases:
        monkeypatch.setattr(_store_cmds, "cmd_ls", raising(group))
        assert entry.main(["ls", "--data", str(tmp_path)]) == code
        assert capsys.readouterr().err.strip() == line


def test_a_progress_bar_clears_what_a_longer_line_left(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bar redrew with a bare carriage return: a shorter redraw left the end of the
    longer one on screen ("1.0 MiB/3.0 MiBMiB")."""
    from cli._util import Progress, fmt_bytes

    with Progress("spill s", 3 << 20, enabled=True, fmt=fmt_bytes) as bar:
        bar.update(3 << 20)
    draws = capsys.readouterr().err.split("\r")[1:]
    assert draws and all(d.rstrip("\n").endswith("\x1b[K") for d in draws)


def _stderr_on_a_terminal(tmp_path: Path, *argv: str) -> tuple[int, str, str]:
    """``kvfs ARGV`` in a process whose stderr is a terminal (a pty) and whose stdout is a
    pipe, as in ``kvfs spill s --json > out.json`` typed at a shell."""
    import pty

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    master, slave = pty.openpty()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "cli", *argv],
            stdout=subprocess.PIPE,
            stderr=slave,
            env=env,
            cwd=tmp_path,
            check=False,
        )
        os.close(slave)
        err = b""
        with contextlib.suppress(OSError):  # (EIO: the terminal's other end is closed)
            while chunk := os.read(master, 65536):
                err += chunk
    finally:
        os.close(master)
    return r.returncode, r.stdout.decode(), err.decode(errors="replace")


def test_json_output_draws_no_progress_bar_on_a_terminal(run: Run, tmp_path: Path) -> None:
    """spill, restore, evict and fsck drew their bars on a terminal with --json too: a
    script asking for JSON got bars in the log that took its stderr."""
    d = one_page(run, tmp_path, os.urandom(300_000), archive=True)
    rc, out, err = _stderr_on_a_terminal(tmp_path, "spill", "a", *d)
    assert rc == 0 and "\x1b[K" in err, (out, err)  # the bar, where no --json is given
    for argv in (("restore", "a"), ("spill", "a"), ("evict", "a"), ("fsck",)):
        rc, out, err = _stderr_on_a_terminal(tmp_path, *argv, "--json", *d)
        assert rc == 0 and "\x1b[K" not in err, (argv, err)
        json.loads(out)


def test_an_empty_listing_says_so(run: Run, tmp_path: Path) -> None:
    """ls, ls --archived and hosts with nothing to list printed a table's headers and
    rule alone, as if the output were cut short."""
    d = one_page(run, tmp_path, b"x", archive=True)
    assert run("rm", "a", *d)[0] == 0
    for argv, said in (
        (("ls",), "no sessions"),
        (("ls", "sessions"), "no pages in sessions"),
        (("ls", "--archived"), "no sessions in the archive"),
        (("hosts",), "no host has written to the archive yet"),
    ):
        rc, out, err = run(*argv, *d)
        assert (rc, out) == (0, said + "\n"), (argv, err)
        rc, out, _ = run(*argv, "--json", *d)
        assert (rc, json.loads(out)) == (0, []), argv


def test_a_put_over_an_existing_page_says_how_to_replace_it(run: Run, tmp_path: Path) -> None:
    """It said the page exists and pages are write-once, and not that --replace replaces
    it."""
    d = one_page(run, tmp_path, b"x")
    rc, _, err = run("put", "f", "sessions/a/p/layer-000", *d)
    assert rc == 1 and "--replace" in err and "sessions/a/p/layer-000" in err, err
    assert run("put", "f", "sessions/a/p/layer-000", "--replace", *d)[0] == 0


def test_get_to_standard_output_with_json_is_a_usage_error(run: Run, tmp_path: Path) -> None:
    """`kvfs get PATH --json` wrote the page's raw bytes where JSON was asked for (exit 0):
    a script parsing it got bytes."""
    d = one_page(run, tmp_path, b"raw bytes")
    for dest in ((), ("-",)):
        rc, out, err = run("get", "sessions/a/p/layer-000", *dest, "--json", *d)
        assert (rc, out) == (2, "") and "FILE" in err, err


def test_daemon_mode_with_no_daemon_says_what_to_do(run: Run, tmp_path: Path) -> None:
    """`kvfs ls --daemon` with no daemon running said only that none answers on its
    socket."""
    d = one_page(run, tmp_path, b"x")
    rc, _, err = run("ls", "--daemon", *d)
    assert rc == 7 and "no kvfs daemon answers" in err, err
    assert "kvfs mount" in err and "drop --daemon" in err, err


def test_ls_puts_numbers_in_names_in_numeric_order(run: Run, tmp_path: Path) -> None:
    """A model with 1000+ layers, or sessions agent-9 and agent-10: plain string order
    listed layer-1000 before layer-999."""
    d = data(tmp_path)
    (tmp_path / "f").write_bytes(b"x" * 10)
    for path in (
        "sessions/agent-10/p/layer-1000",
        "sessions/agent-10/p/layer-999",
        "sessions/agent-9/p/layer-000",
    ):
        assert run("put", "f", path, *d)[0] == 0
    sessions = json.loads(run("ls", "--json", *d)[1])
    assert [s["session"] for s in sessions] == ["agent-9", "agent-10"]
    pages = json.loads(run("ls", "agent-10", "--json", *d)[1])
    assert [p["path"].rsplit("/", 1)[1] for p in pages] == ["layer-999", "layer-1000"]
    rc, out, _ = run("ls", "agent-10", *d)
    assert rc == 0 and out.index("layer-999") < out.index("layer-1000")


def test_an_absolute_path_off_any_mount_is_a_usage_error(run: Run, tmp_path: Path) -> None:
    """`kvfs ls /some/dir/x` (a path pasted from outside the mount) said "no page, session
    or directory" (exit 3); the reason, an absolute name, was only in a daemon's log."""
    d = one_page(run, tmp_path, b"x" * 10)
    for argv in (("ls", "/tmp/not-a-mount/x"), ("rm", "/tmp/not-a-mount/x"), ("pin", "/x")):
        rc, _, err = run(*argv, *d)
        assert rc == 2 and "is not on a kvfs mount" in err, (argv, rc, err)
    assert tier(run, d) == "local"  # nothing touched


def test_a_bad_option_is_told_with_the_commands_own_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An unknown option of a command printed the top-level usage (`usage: kvfs [-h]
    [--debug] ...`): the command's own says what it takes."""
    from cli.__main__ import main

    for argv, usage in (
        (["mount", "--readonly", "/x"], "usage: kvfs mount"),
        (["ls", "--bogus"], "usage: kvfs ls"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(usage), err
        assert f"kvfs {argv[0]}: error: unrecognized arguments: {argv[1]}" in err


def test_evict_rm_and_stats_report_what_they_did(run: Run, tmp_path: Path) -> None:
    """`evict --json` said "pinned_kept": 0 while a page stayed local (its data shared with
    a pinned page elsewhere); `rm --json` gave a bare "result"; `stats --count` without
    --watch was ignored."""
    d = data(tmp_path, archive=True)
    (tmp_path / "f").write_bytes(os.urandom(50_000))
    (tmp_path / "g").write_bytes(os.urandom(50_000))
    assert run("put", "f", "sessions/a/p/layer-000", *d)[0] == 0
    assert run("put", "g", "sessions/a/p/layer-001", *d)[0] == 0
    assert run("put", "f", "sessions/b/p/layer-000", "--pin", *d)[0] == 0  # the same data
    rc, out, err = run("evict", "a", "--json", *d)
    assert rc == 0, err
    assert json.loads(out)[0] | {"freed_bytes": 0} == {
        "target": "a",
        "kind": "session",
        "freed_bytes": 0,
        "pinned_kept": 0,
        "local_kept": 1,
    }
    rc, out, _ = run("evict", "a", *d)
    assert rc == 0 and "1 page(s) kept: their data is shared with a pinned page" in out
    rc, out, _ = run("rm", "a", "sessions/b/p/layer-000", "--json", *d)
    assert rc == 0
    assert [(r["kind"], r["pages"]) for r in json.loads(out)] == [("session", 2), ("page", 1)]
    rc, _, err = run("stats", "--count", "2", *d)
    assert rc == 2 and "--count needs --watch" in err


def test_evict_says_what_it_kept_in_one_parenthesis(run: Run, tmp_path: Path) -> None:
    """A session holding a pinned page and a page whose data a pinned page elsewhere
    shares: evict said so in two parentheses back to back; one says both now."""
    d = data(tmp_path, archive=True)
    (tmp_path / "f").write_bytes(os.urandom(50_000))
    (tmp_path / "g").write_bytes(os.urandom(50_000))
    assert run("put", "f", "sessions/a/p/layer-000", *d)[0] == 0
    assert run("put", "g", "sessions/a/p/layer-001", "--pin", *d)[0] == 0
    assert run("put", "f", "sessions/b/p/layer-000", "--pin", *d)[0] == 0  # the same data
    rc, out, _ = run("evict", "a", *d)
    assert rc == 0 and out.count(" (") == 1, out
    assert out.endswith(
        " freed (1 pinned page(s) kept: kvfs unpin first; 1 page(s) kept: their data is "
        "shared with a pinned page, or in use)\n"
    ), out


def test_stats_watch_does_not_hold_the_store(run: Run, tmp_path: Path) -> None:
    """`kvfs stats --watch` on the data directory held its lock for as long as it ran: a
    daemon (`kvfs mount`) could not start meanwhile. It opens the store for each refresh."""
    import subprocess
    import sys
    import time

    d = one_page(run, tmp_path, b"x" * 10)
    cfg = kvfs.StoreConfig(data_dirs=(tmp_path / "d0", tmp_path / "d1"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFS_")}
    with subprocess.Popen(
        [sys.executable, "-m", "cli", "stats", "--watch", "0.5", "--count", "20", *d],
        stdout=subprocess.PIPE,
        env=env,
        cwd=Path(__file__).parent.parent,
    ) as watch:
        try:
            assert watch.stdout is not None and watch.stdout.readline()  # it has begun
            opened = False
            deadline = time.monotonic() + 8
            while not opened and time.monotonic() < deadline:
                try:
                    with kvfs.open_store_sync(cfg) as s:
                        opened = s.stat("sessions/a/p/layer-000").size == 10
                except kvfs.StoreLocked:
                    time.sleep(0.05)
            assert opened and watch.poll() is None  # while the watch runs
        finally:
            watch.kill()


@pytest.mark.parametrize("cmd", ["ls", "pin", "rm", "evict"])
def test_a_name_no_page_or_session_could_have_is_a_usage_error(
    run: Run, tmp_path: Path, cmd: str
) -> None:
    """``kvfs ls 'sessions/a/../b'`` and ``kvfs pin ''`` said "no page" (exit 3, as for a
    name that is merely missing), where ``restore`` said why the name is bad (exit 2). The
    reason named the bad part alone ("path component may not be '..'"), not the name."""
    d = one_page(run, tmp_path, b"x")
    for bad, why in [
        ("sessions/a/../b", "path 'sessions/a/../b': component may not be '..'"),
        ("", "path is empty"),
    ]:
        rc, _, err = run(cmd, bad, *d)
        assert rc == 2 and why in err, (bad, rc, err)
    rc, _, err = run(cmd, "sessions/nope", *d)  # a good name, missing: not found
    assert rc == 3, err


def test_messages_show_a_name_holding_a_newline_on_one_line(run: Run, tmp_path: Path) -> None:
    """put, pin, evict and rm printed names raw: a newline in one split its message in two,
    as ls and fsck (which escape it) never did."""
    d = data(tmp_path)
    (tmp_path / "f").write_bytes(b"x" * 100)
    name = "sessions/nl\nx/p/layer-000"
    for argv in (("put", "f", name), ("pin", name), ("unpin", name), ("evict", "--force", name)):
        rc, out, err = run(*argv, *d)  # (evict, with no archive: deleted)
        assert rc == 0 and out.count("\n") == 1 and "nl\\nx" in out, (argv, out, err)
    assert run("put", "f", name, *d)[0] == 0
    rc, out, _ = run("rm", name, *d)
    assert rc == 0 and out == "deleted page sessions/nl\\nx/p/layer-000\n"


def _archived_store(run: Run, tmp_path: Path, s3_server) -> tuple[list[str], list[str]]:  # noqa: ANN001
    """Session a spilled (its page held by the archive alone), b local; the data options
    with the archive reachable, and with its endpoint down (the same bucket: the archive
    this store recorded)."""
    bucket = s3_server.new_bucket()
    dirs = ["--data", f"{tmp_path}/d0,{tmp_path}/d1"]
    up = [*dirs, "--archive", f"s3://{bucket}?endpoint={s3_server.endpoint}"]
    down = [*dirs, "--archive", f"s3://{bucket}?endpoint=http://127.0.0.1:1&open_deadline=0.5"]
    (tmp_path / "f").write_bytes(os.urandom(5000))
    (tmp_path / "g").write_bytes(os.urandom(7000))
    assert run("put", "f", "sessions/a/p/layer-000", *up)[0] == 0
    assert run("put", "g", "sessions/b/p/layer-000", *up)[0] == 0
    assert run("spill", "a", *up)[0] == 0
    return up, down


def test_offline_fsck_stats_and_ls_inspect_the_local_tier_while_the_archive_is_unreachable(
    run: Run,
    tmp_path: Path,
    s3_server,  # noqa: ANN001
) -> None:
    """With the archive's endpoint down, `kvfs fsck`, `stats` and `ls` on the data
    directory did not open the store at all (exit 8, "cannot reach the S3 endpoint"): no
    local check ran, and the user learnt nothing of the local pages while S3 was down."""
    up, down = _archived_store(run, tmp_path, s3_server)
    for flags in ([], ["--check-archive"]):
        rc, out, err = run("fsck", "--json", *flags, *down)
        found = json.loads(out)
        assert rc == 8 and "cannot reach the S3 endpoint" in found["archive_error"][0], err
        assert not any(found[k] for k in ("missing", "corrupt", "orphans", "damaged_pages"))
        assert "opened without the archive" in err and "only the local tier" in err, err
    rc, out, _ = run("fsck", *down)
    assert rc == 8 and out.endswith("clean; the archive could not be checked\n"), out
    rc, out, _ = run("stats", "--json", *down)
    st = json.loads(out)
    assert rc == 0 and st["pages"] == 2 and "archive" not in st["extra"], st
    assert "cannot reach the S3 endpoint" in st["extra"]["archive_error"]["error"], st
    rc, out, _ = run("stats", *down)
    assert rc == 0 and "unavailable, not opened (cannot reach the S3 endpoint" in out, out
    rc, _, err = run("stats", "--watch", "0.1", "--count", "3", *down)  # (said it each time)
    assert rc == 0 and err.count("opened without the archive") == 1, err
    rc, out, err = run("ls", "--json", *down)
    assert rc == 0 and [s["session"] for s in json.loads(out)] == ["a", "b"], err
    assert "only the local tier is inspected" in err, err
    for session, where in (("a", "archive"), ("b", "local")):
        rc, out, _ = run("ls", session, "--json", *down)
        assert rc == 0 and [p["tier"] for p in json.loads(out)] == [where], out
    # nothing was changed: the archive back, its page comes back from it
    rc, _, err = run("ls", "--archived", *down)
    assert rc == 8 and "cannot reach" in err, err
    assert run("restore", "a", *up)[0] == 0
    assert run("get", "sessions/a/p/layer-000", "back", *up)[0] == 0
    assert (tmp_path / "back").read_bytes() == (tmp_path / "f").read_bytes()


def test_stats_watch_waits_for_an_unreachable_archive_once_and_tries_it_now_and_then(
    run: Run,
    tmp_path: Path,
    s3_server,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kvfs stats --watch` on a data directory whose archive's endpoint is down opens the
    store for each refresh, and each open waited out the endpoint's open_deadline (15 s by
    default) again before it fell back to the local tier. The first refresh waits; the
    next ones open without the archive, which is tried again every ARCHIVE_RETRY_SECONDS,
    and that is said once."""
    _, down = _archived_store(run, tmp_path, s3_server)
    caplog.set_level(logging.INFO, logger="kvfs.engine")

    def tries() -> int:  # (the opens that tried the archive and waited for it)
        said = "opened without its archive, which cannot be used"
        return sum(said in r.getMessage() for r in caplog.records)

    for every, waited in ((3600.0, 1), (0.0, 4)):
        monkeypatch.setattr("cli._store_cmds.ARCHIVE_RETRY_SECONDS", every)
        caplog.clear()
        rc, out, err = run("stats", "--watch", "0.01", "--count", "4", "--json", *down)
        assert rc == 0 and tries() == waited, err
        refreshes = [json.loads(line) for line in out.splitlines()]
        assert len(refreshes) == 4 and {st["pages"] for st in refreshes} == {2}, out
        for st in refreshes:  # (the archive's line says why all the same)
            assert "cannot reach the S3 endpoint" in st["extra"]["archive_error"]["error"], st
        assert err.count("opened without the archive") == 1, err
        assert err.count(f"do not wait for the archive; it is tried again every {every:g} s") == 1


def test_offline_fsck_finds_local_damage_while_the_archive_is_unreachable_and_repairs_nothing(
    run: Run,
    tmp_path: Path,
    s3_server,  # noqa: ANN001
) -> None:
    """A damaged local copy of archived data with the archive's endpoint down: `kvfs fsck`
    exited 8 without checking anything (the store did not open). It is found now, beside
    the archive's error; --repair, which could delete pages whose good copy the archive
    holds, still refuses to open, and so do the other commands that change the store. The
    verdict said "--repair removes ..." all the same: it says now that the repair needs
    the archive back."""
    up, down = _archived_store(run, tmp_path, s3_server)
    assert run("restore", "a", *up)[0] == 0  # local+archive
    damage_the_page(tmp_path)
    rc, out, err = run("fsck", "--json", *down)
    found = json.loads(out)
    assert rc == 5 and found["damaged_pages"] == ["sessions/a/p/layer-000"], err
    assert "cannot reach the S3 endpoint" in found["archive_error"][0], found
    # the verdict said "--repair removes ...", a repair that then refused to run
    rc, out, _ = run("fsck", *down)
    verdict = out.splitlines()[-1]
    assert rc == 5 and "--repair needs it" in verdict, out
    assert "refuses to run until the archive can be reached, then removes" in verdict, out
    assert "--repair removes" not in verdict and verdict.count("could not be checked") == 1
    for cmd in (["fsck", "--repair"], ["rm", "a"], ["evict", "b"], ["put", "f", "c/x"]):
        rc, _, err = run(*cmd, *down)
        assert rc == 8 and "cannot reach the S3 endpoint" in err, (cmd, err)
    rc, out, _ = run("ls", "--json", *up)
    assert [s["session"] for s in json.loads(out)] == ["a", "b"], out
    # with the archive back, the repair restores the damaged copy from it
    rc, out, _ = run("fsck", "--repair", *up)
    assert rc == 0, out
    assert run("get", "sessions/a/p/layer-000", "back", *up)[0] == 0
    assert (tmp_path / "back").read_bytes() == (tmp_path / "f").read_bytes()


def test_config_check_tries_the_directories_and_the_archive(
    run: Run, tmp_path: Path, s3_server: Any
) -> None:
    """`kvfs config --check` writes to each data directory as the store does, and stores,
    reads back and deletes one object in the archive: what would fail says why (exit 1),
    before a daemon is started on it. A read-only data directory, two on one file system,
    a server refusing boto3's default checksums (with the option that fixes it) and one
    without conditional puts are each named; a good configuration exits 0, leaving nothing
    behind."""
    from _s3 import OlderS3Server, iam_credentials

    def checks(*argv: str) -> tuple[int, dict[str, list[dict[str, str]]]]:
        rc, out, _ = run("config", "--check", "--json", *argv)
        by: dict[str, list[dict[str, str]]] = {}
        for c in json.loads(out):
            by.setdefault(c["check"].split(":")[0], []).append(c)
        return rc, by

    bucket = s3_server.new_bucket()
    good = f"s3://{bucket}/p?endpoint={s3_server.endpoint}"
    (tmp_path / "d0").mkdir()
    rc, by = checks("--data", f"{tmp_path}/d0,{tmp_path}/d1", "--archive", good)
    assert rc == 0, by
    assert [c["status"] for c in by["data dir 0"]] == ["ok"]
    assert "writable with O_DIRECT" in by["data dir 0"][0]["detail"]
    assert "not there yet" in by["data dir 1"][0]["detail"]
    assert not (tmp_path / "d1").exists()  # (a check makes nothing)
    assert by["data dir 1"][1]["status"] == "warn"  # the same file system as d0
    assert by["archive round trip"][0]["status"] == "ok"
    assert s3_server.keys(bucket) == [] and os.listdir(tmp_path / "d0") == []

    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        rc, by = checks("--data", str(ro), "--archive", "")
        assert rc == 1 and by["data dir 0"][0]["status"] == "fail"
        assert "Read-only file system" in by["data dir 0"][0]["detail"]
    finally:
        subprocess.run(["umount", str(ro)], check=True)

    for refuses, status, words in [
        ("checksums", "fail", "checksums=when_required"),
        ("conditional", "warn", "refuses If-None-Match"),
    ]:
        with OlderS3Server(s3_server.endpoint, refuses=refuses) as server:
            url = f"s3://{bucket}/p?endpoint={server.endpoint}&deadline=5"
            rc, by = checks("--data", f"{tmp_path}/d0", "--archive", url)
            found = [c for c in sum(by.values(), []) if words in c["detail"]]
            assert found and found[0]["status"] == status, by
            assert rc == (1 if status == "fail" else 0)
            rc, by = checks(
                "--data", f"{tmp_path}/d0", "--archive", url + "&checksums=when_required"
            )
            assert by["archive round trip"][0]["status"] == "ok", by
    assert s3_server.keys(bucket) == []

    # credentials that may store but not delete: every collection would fail
    arn = f"arn:aws:s3:::{bucket}"
    may = [
        # (s3:HeadBucket: moto's name for a bucket's HEAD, where AWS checks s3:ListBucket)
        {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:HeadBucket"], "Resource": arn},
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"], "Resource": arn + "/*"},
    ]
    with iam_credentials(s3_server, may):
        rc, by = checks("--data", f"{tmp_path}/d0", "--archive", good)
    assert rc == 1 and by["archive round trip"][0]["status"] == "fail", by
    assert "s3:DeleteObject" in by["archive round trip"][0]["detail"]
