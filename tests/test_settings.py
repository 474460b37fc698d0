"""Settings: defaults < TOML file < environment < flags; validation; masking; socket path."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

import kvfs
from kvfs._settings import (
    OPTIONS,
    as_toml,
    control_socket_path,
    load_settings,
    masked,
    private_dir,
    runtime_dir,
)


def test_embedded_defaults_need_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = load_settings(env={})
    assert s.config_file is None
    cfg = s.store_config()
    assert cfg.data_dirs == (Path("kvfs-data"),)
    assert cfg.archive_url == f"file://{tmp_path}/kvfs-archive"
    assert all(src == "default" for src in s.sources.values())
    assert {o.name for o in OPTIONS} == set(s.values)


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "kvfs.toml"
    f.write_text(
        '[store]\ndata_dirs = ["/a", "/b"]\ncapacity = "2GiB"\nio_threads = 3\n'
        '[archive]\narchive_url = "s3://bucket/pre"\n[daemon]\nmetrics_port = 9100\n'
    )
    s = load_settings(
        f,
        env={"KVFS_CAPACITY": "1GiB", "KVFS_DURABLE": "false"},
        flags={"capacity": "512MiB", "io_threads": None},
    )
    assert s["data_dirs"] == ["/a", "/b"] and s.sources["data_dirs"] == str(f)
    assert s["capacity"] == 512 << 20 and s.sources["capacity"] == "flag"
    assert s["durable"] is False and s.sources["durable"] == "$KVFS_DURABLE"
    assert s["io_threads"] == 3  # a flag given as None does not override
    cfg = s.store_config()
    assert cfg.archive_url == "s3://bucket/pre"
    assert cfg.extra["daemon"]["metrics_port"] == 9100  # type: ignore[index]
    # configured data dirs without an archive URL: no archive tier ("auto")
    assert load_settings(env={"KVFS_DATA_DIRS": "/x,/y"}).store_config().archive_url == ""
    # a space after a comma is not part of the next directory (it made " /y", relative)
    for given in ("/x, /y", " /x ,/y ,"):
        cfg = load_settings(env={"KVFS_DATA_DIRS": given}).store_config()
        assert cfg.data_dirs == (Path("/x"), Path("/y"))
        cfg = load_settings(env={}, flags={"data_dirs": given}).store_config()
        assert cfg.data_dirs == (Path("/x"), Path("/y"))


def test_config_file_from_environment(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[store]\nstripe_unit = "1MiB"\n')
    s = load_settings(env={"KVFS_CONFIG": str(f)})
    assert s["stripe_unit"] == 1 << 20 and s.config_file == f


@pytest.mark.parametrize(
    "text, match",
    [
        ("[store]\nnope = 1\n", r"unknown option store.nope$"),
        # an option in another section, or misspelt, was told with no word of the one meant,
        # and one above every section as an unknown section
        (
            '[store]\narchive_url = ""\n',
            r"unknown option store.archive_url \(archive.archive_url\?\)",
        ),
        ("[store]\ncapacty = 1\n", r"unknown option store.capacty \(store.capacity\?\)"),
        ("capacity = 1\n", r"option capacity outside its section \(under \[store\]\)"),
        ("[stor]\ncapacity = 1\n", r"unknown section \[stor\]"),
        ('[store]\ncapacity = "lots"\n', "bad value 'lots' for store.capacity"),
        ('[store]\ndirect_io = "maybe"\n', "direct_io"),
        ('[daemon]\nlog_level = "loud"\n', "log_level"),
        ("[store]\ncapacity = \n", "Expected|Invalid"),
        # an integer below 0 is no size: -1 was taken for DISK_CAPACITY ("disk"), and the
        # capacity kept with the store forgotten without a word
        ("[store]\ncapacity = -1\n", "bad value -1 for store.capacity"),
        ("[archive]\nevict_ahead = -1\n", "bad value -1 for archive.evict_ahead"),
        # a TOML float was truncated (2.5 threads were 2), and nan passed every range check
        ("[store]\nio_threads = 2.5\n", "bad value 2.5 for store.io_threads: an integer"),
        ("[daemon]\nmetrics_port = 9100.5\n", "bad value 9100.5 for daemon.metrics_port"),
        ("[archive]\ngc_window = nan\n", "bad value nan for archive.gc_window: a number"),
        ("[archive]\nretention = nan\n", "bad value nan for archive.retention: a duration"),
    ],
)
def test_bad_files_are_one_clear_error(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_settings(f, env={})


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"\$KVFS_IO_THREADS"):
        load_settings(env={"KVFS_IO_THREADS": "many"})


def test_missing_named_file(tmp_path: Path) -> None:
    """A configuration error (exit 2, said as such), not a raw `[Errno 2]` (exit 3)."""
    with pytest.raises(ValueError, match=r"configuration file .*absent.toml does not exist"):
        load_settings(tmp_path / "absent.toml", env={})
    with pytest.raises(ValueError, match=r"\(\$KVFS_CONFIG\) does not exist"):
        load_settings(env={"KVFS_CONFIG": str(tmp_path / "absent.toml")})


def test_a_misspelt_environment_variable_is_told() -> None:
    """Unknown TOML options are errors; a `KVFS_CAPACTY` was silently ignored."""
    from kvfs._settings import unknown_environment

    env = {"KVFS_CAPACTY": "1GiB", "KVFS_CAPACITY": "2GiB", "KVFS_CONFIG": "x", "HOME": "/"}
    assert unknown_environment(env) == [
        "$KVFS_CAPACTY is no kvfs setting: ignored ($KVFS_CAPACITY?)"
    ]
    assert unknown_environment({"KVFS_ZZZZZZZZZZZZ": "1"}) == [
        "$KVFS_ZZZZZZZZZZZZ is no kvfs setting: ignored"
    ]


def test_secrets_are_masked() -> None:
    assert masked("archive_url", "s3://AKIA:topsecret@bucket/x") == "s3://***@bucket/x"
    assert (
        masked("archive_url", "s3://b/x?secret_key=abc&region=eu")
        == "s3://b/x?secret_key=***&region=eu"
    )
    assert masked("aws_secret_access_key", "abc") == "***"
    s = load_settings(env={"KVFS_ARCHIVE_URL": "s3://AKIA:topsecret@bucket/x"})
    assert "topsecret" not in as_toml(s)


def test_socket_path_beside_the_index_or_hashed_when_long(tmp_path: Path) -> None:
    short = load_settings(env={}, flags={"data_dirs": str(tmp_path / "d")}).store_config()
    assert control_socket_path(short) == tmp_path / "d" / "kvfs.sock"
    deep = tmp_path / ("x" * 120)
    long = load_settings(env={}, flags={"data_dirs": str(deep)}).store_config()
    p = control_socket_path(long)
    assert p.name.startswith("ctl-") and len(str(p)) < 108
    assert control_socket_path(long, "/run/k.sock") == Path("/run/k.sock")


def test_archive_policy_is_configurable_like_any_option(tmp_path: Path) -> None:
    """A daemon's spill policy comes from its config file and environment, and reaches the
    archive tier as the store opens it; bad values are refused with the option named."""
    from kvfs._archive import ArchiveConfig
    from kvfs._settings import ARCHIVE_FIELDS

    for name, field in ARCHIVE_FIELDS.items():  # one default, not two that can drift apart
        assert load_settings(env={})[name] == getattr(ArchiveConfig, field), name
    f = tmp_path / "kvfs.toml"
    f.write_text(
        '[store]\ndata_dirs = ["' + str(tmp_path / "d") + '"]\n'
        '[archive]\narchive_url = "file://' + str(tmp_path / "arch") + '"\n'
        'idle_seconds = 60\nhigh_watermark = 0.8\nspill_interval = 0\ncodec = "zstd"\n'
    )
    s = load_settings(f, env={"KVFS_LOW_WATERMARK": "0.5", "KVFS_UPLOAD_PROCESSES": "0"})
    cfg = s.store_config()
    got = ArchiveConfig.from_extra(cfg.extra)
    assert (got.idle_seconds, got.high_watermark, got.low_watermark) == (60.0, 0.8, 0.5)
    assert (got.interval, got.codec, got.upload_processes) == (0.0, "zstd", 0)
    assert "spill_interval = 0.0" in as_toml(s) and 'codec = "zstd"' in as_toml(s)
    import kvfs

    with kvfs.open_store_sync(cfg) as store:  # the store runs with them
        policy = store.engine.policy
        assert policy.cfg.idle_seconds == 60.0 and policy.uploads is None  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="archive.codec"):
        load_settings(env={"KVFS_CODEC": "lz4"})
    with pytest.raises(ValueError, match="archive.idle_seconds"):
        load_settings(env={"KVFS_IDLE_SECONDS": "soon"})
    with pytest.raises(ValueError, match="watermark"):
        load_settings(f, env={"KVFS_LOW_WATERMARK": "0.95"}).store_config()


def test_retention_takes_a_duration_and_needs_an_archive(tmp_path: Path) -> None:
    from kvfs._archive import ArchiveConfig

    for text, seconds in (("90", 90.0), ("1.5s", 1.5), ("30m", 1800.0), ("12h", 43200.0)):
        assert load_settings(env={"KVFS_RETENTION": text})["retention"] == seconds
    f = tmp_path / "kvfs.toml"
    f.write_text('[archive]\nretention = "7d"\n')
    cfg = load_settings(f, env={}).store_config()  # the embedded default archive
    assert ArchiveConfig.from_extra(cfg.extra).retention == 7 * 86400
    assert ArchiveConfig.from_extra({"archive": {"retention": "2w"}}).retention == 14 * 86400
    with pytest.raises(ValueError, match=r"\$KVFS_RETENTION.*not a duration"):
        load_settings(env={"KVFS_RETENTION": "soon"})
    with pytest.raises(ValueError, match=r"\$KVFS_RETENTION: bad value '-1' .*at least 0"):
        load_settings(env={"KVFS_RETENTION": "-1"})
    with pytest.raises(ValueError, match="retention must be >= 0"):  # (the object API's)
        ArchiveConfig.from_extra({"archive": {"retention": -1}})
    no_archive = load_settings(env={"KVFS_RETENTION": "1d", "KVFS_ARCHIVE_URL": ""})
    with pytest.raises(ValueError, match="retention deletes sessions from the archive tier"):
        no_archive.store_config()


def test_the_archive_settings_in_extra_take_the_sizes_the_configuration_file_takes() -> None:
    """``extra={"archive": {"memory_copies": "256MiB"}}`` was refused as "no int", though
    the configuration file takes that size for the same setting (and StoreConfig's own
    sizes take it)."""
    from kvfs._archive import ArchiveConfig

    cfg = ArchiveConfig.from_extra(
        {"archive": {"memory_copies": "256MiB", "evict_ahead": "1 GiB", "retention": "1h"}}
    )
    assert (cfg.memory_copies, cfg.evict_ahead, cfg.retention) == (256 << 20, 1 << 30, 3600.0)
    with pytest.raises(ValueError, match="archive setting memory_copies: not a size"):
        ArchiveConfig.from_extra({"archive": {"memory_copies": "lots"}})
    with pytest.raises(ValueError, match="archive setting retention: not a duration"):
        ArchiveConfig.from_extra({"archive": {"retention": "soon"}})
    with pytest.raises(ValueError, match="archive setting evict_ahead: True is no int"):
        ArchiveConfig.from_extra({"archive": {"evict_ahead": True}})


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("concurrency", 0, "concurrency must be >= 1"),
        ("cpu_slots", -1, "cpu_slots must be >= 0"),
        ("interval", float("nan"), "interval must be >= 0 seconds"),
        ("idle_seconds", -5, "idle_seconds must be >= 0 seconds"),
        ("gc_grace", float("nan"), "gc_grace must be >= 0 seconds"),
        ("retention", float("nan"), "retention must be >= 0 seconds"),
        ("gc_window", float("nan"), "gc_window must be > 0 seconds"),
    ],
)
def test_the_object_api_bounds_the_archive_settings_as_the_file_does(
    make_config: Callable[..., kvfs.StoreConfig], setting: str, value: float, said: str
) -> None:
    """The configuration file and KVFS_* refused these; given to the object API in
    ``extra``, archive concurrency 0 failed the open with the thread pool's "max_workers
    must be greater than 0", and a NaN interval made the spiller's first sleep raise."""
    cfg = make_config(
        ndev=1, archive_url="file:///nonexistent-kvfs-test", extra={"archive": {setting: value}}
    )
    with pytest.raises(ValueError, match=said):
        kvfs.open_store_sync(cfg).__enter__()
    assert not any(p.exists() for p in cfg.data_dirs)  # (refused before anything was made)


def _as_uid(uid: int, fn: Callable[[], int]) -> int:
    """``fn()``'s result, run in a forked child that became ``uid``."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgid(uid)
            os.setuid(uid)
            code = fn()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(
    os.getuid() != 0,
    reason="needs root to act as two users (CI and the device machine run as root)",
)
def test_runtime_dir_is_refused_when_another_user_made_it_first() -> None:
    """The daemon's state files (its pid: ``kvfs umount`` signals it) and fallback sockets
    live in ``/tmp/kvfs-<uid>``. Another user who made that first, or one left open to
    others, is refused with the reason; a missing one is made 0700."""
    victim = 54321
    path = Path(f"/tmp/kvfs-{victim}")
    shutil.rmtree(path, ignore_errors=True)

    def try_it() -> int:
        try:
            return 0 if runtime_dir() == path else 1
        except PermissionError as e:
            reasons = {"belongs to uid 65534": 10, "writable by other users": 11}
            return next((code for why, code in reasons.items() if why in str(e)), 12)

    try:
        assert _as_uid(victim, try_it) == 0  # made, 0700, its own
        st = os.lstat(path)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (victim, 0o700)
        os.chmod(path, 0o777)
        assert _as_uid(victim, try_it) == 11
        os.rmdir(path)
        os.mkdir(path, 0o700)
        os.chown(path, 65534, 65534)  # the other user was first
        assert _as_uid(victim, try_it) == 10
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_private_dir_refuses_a_link_or_a_shared_dir(tmp_path: Path) -> None:
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    assert private_dir(d) == d
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(PermissionError, match="is no directory"):
        private_dir(tmp_path / "link")
    d.chmod(0o1777)
    with pytest.raises(PermissionError, match=r"writable by other users \(mode 1777\)"):
        private_dir(d)


def test_runtime_paths_do_not_depend_on_the_callers_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon started by systemd (no XDG_RUNTIME_DIR) and a login shell's ``kvfs umount``
    (with it) must agree on where the daemon's state and fallback socket are."""
    from kvfs._daemon import state_path

    long = load_settings(env={}, flags={"data_dirs": str(tmp_path / ("x" * 120))}).store_config()
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    before = (control_socket_path(long), state_path(tmp_path / "mnt"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert (control_socket_path(long), state_path(tmp_path / "mnt")) == before
    assert before[0].parent == before[1].parent == runtime_dir()


def test_archive_settings_in_extra_are_checked_by_name_and_kind() -> None:
    """``StoreConfig(extra={"archive": ...})`` from a script: a value of the wrong kind was
    a bare TypeError from deep inside ('<=' not supported...), and the configuration file's
    names for two settings were refused with no word of the names meant."""
    from kvfs._archive import ArchiveConfig

    def refused(archive: dict[str, object]) -> str:
        with pytest.raises(ValueError) as e:
            ArchiveConfig.from_extra({"archive": archive})
        return str(e.value)

    assert refused({"concurrency": "x"}) == "archive setting concurrency: 'x' is no int"
    assert refused({"high_watermark": True}) == "archive setting high_watermark: True is no float"
    assert "archive_concurrency (concurrency?)" in refused({"archive_concurrency": 8})
    assert "spill_interval (interval?)" in refused({"spill_interval": 0})
    assert "intervall (interval?)" in refused({"intervall": 1})
    cfg = ArchiveConfig.from_extra(
        {"archive": {"interval": 2, "retention": "1d", "store_options": {"deadline": 1}}}
    )
    assert (cfg.interval, cfg.retention) == (2, 86400.0)


def test_store_config_takes_size_strings_and_names_the_field_of_a_wrong_type(
    tmp_path: Path,
) -> None:
    """``StoreConfig(stripe_unit="64KiB", capacity="64MiB")``, the sizes the configuration
    file and ``--capacity`` take, failed with "'<=' not supported between instances of
    'str' and 'int'"; ``io_threads="8"`` and ``data_dirs=None`` failed as deep, and
    ``direct_io="false"`` was taken as true."""
    import kvfs

    cfg = kvfs.StoreConfig(
        data_dirs=[str(tmp_path / "d")], stripe_unit="64KiB", capacity="64MiB", index_dir=""
    )
    assert (cfg.stripe_unit, cfg.capacity) == (64 << 10, 64 << 20)
    assert (cfg.data_dirs, cfg.index_dir) == ((tmp_path / "d",), None)
    assert cfg.replace(capacity=" Disk ").capacity == kvfs.DISK_CAPACITY
    with kvfs.open_store_sync(cfg, capacity="2MiB") as s:
        assert s.statistics().capacity_bytes == 2 << 20
        assert s.config.stripe_unit == 64 << 10

    def refused(error: type[Exception], **fields: object) -> str:
        with pytest.raises(error) as e:
            kvfs.StoreConfig(**fields)  # type: ignore[arg-type]
        return str(e.value)

    assert "StoreConfig.capacity" in refused(ValueError, capacity="64 megs")
    assert "StoreConfig.stripe_unit" in refused(TypeError, stripe_unit=None)
    assert "StoreConfig.capacity" in refused(TypeError, capacity=1.5)
    assert "StoreConfig.io_threads" in refused(TypeError, io_threads="8")
    assert "StoreConfig.data_dirs" in refused(TypeError, data_dirs=None)
    assert "StoreConfig.data_dirs" in refused(TypeError, data_dirs=[1])
    assert "StoreConfig.direct_io" in refused(TypeError, direct_io="false")
    assert "StoreConfig.archive_url" in refused(TypeError, archive_url=None)
    assert "StoreConfig.extra" in refused(TypeError, extra=None)
    assert "multiple of 4096" in refused(ValueError, stripe_unit="5000")


@pytest.mark.parametrize(
    ("given", "says"),
    [
        # a capacity of "0.5" bytes was 0, "the cap kept with the store", without a word
        ("0.5", r"not a whole number of bytes: '0.5' \(0.5 bytes\)"),
        ("1048576.7", "not a whole number of bytes"),
        ("0.1KiB", r"\(102.4 bytes\)"),
        # more than SQLite's integers hold: taken, then the open failed with an OverflowError
        ("9000000PiB", "at most 9223372036854775807 bytes"),
        ("1/2MiB", "not a size"),
        # past what the default decimal context holds: decimal.Overflow, no ValueError (the
        # CLI said "[<class 'decimal.Overflow'>]"), and products rounded to whole bytes
        ("1e999999999", "at most 9223372036854775807 bytes"),
        ("1.0000000000000000000000000000001", "not a whole number of bytes"),
        ("1e-99999999", "not a whole number of bytes"),
    ],
)
def test_a_size_is_a_whole_number_of_bytes_the_index_can_hold(
    tmp_path: Path, given: str, says: str
) -> None:
    import kvfs

    with pytest.raises(ValueError, match=rf"\$KVFS_CAPACITY: bad value .*{says}"):
        load_settings(env={"KVFS_CAPACITY": given})
    f = tmp_path / "c.toml"
    f.write_text(f'[archive]\nmemory_copies = "{given}"\n')
    with pytest.raises(ValueError, match=f"for archive.memory_copies: .*{says}"):
        load_settings(f, env={})
    with pytest.raises(ValueError, match=f"StoreConfig.capacity: .*{says}"):
        kvfs.StoreConfig(capacity=given)
    # fractions of a unit that come to whole bytes, and a TOML float that is whole, stay
    assert kvfs.parse_size("1.5MiB") == 3 << 19 and kvfs.parse_size("1.1GB") == 1_100_000_000
    f.write_text("[store]\ncapacity = 2e9\n")
    assert load_settings(f, env={})["capacity"] == 2_000_000_000


def test_a_capacity_beyond_the_index_is_refused_in_the_object_api(tmp_path: Path) -> None:
    """``StoreConfig(capacity=10**22)`` was taken, and the open failed with "OverflowError:
    Integer value out of range"."""
    import kvfs

    with pytest.raises(ValueError, match="StoreConfig.capacity: .* over the largest size"):
        kvfs.StoreConfig(data_dirs=[tmp_path / "d"], capacity=10**22)
    assert kvfs.StoreConfig(capacity=2**63 - 1).capacity == 2**63 - 1


def test_an_empty_boolean_is_refused_not_false(tmp_path: Path) -> None:
    """``KVFS_DURABLE=`` (empty, as an unset ``${VAR}`` in a unit file gives) was false: the
    store stopped syncing its writes with no word; the forms docs/configuration.md lists
    are the ones taken."""
    with pytest.raises(ValueError, match=r"\$KVFS_DURABLE: bad value '' .*true or false"):
        load_settings(env={"KVFS_DURABLE": ""})
    f = tmp_path / "c.toml"
    f.write_text('[store]\ndirect_io = ""\n')
    with pytest.raises(ValueError, match="bad value '' for store.direct_io"):
        load_settings(f, env={})
    for given, value in (("OFF", False), ("No", False), ("0", False), ("on", True), ("1", True)):
        assert load_settings(env={"KVFS_DURABLE": given})["durable"] is value


def test_the_settings_as_toml_read_back_whatever_their_strings_hold(tmp_path: Path) -> None:
    """`kvfs config` printed a string setting with only backslashes and quotes escaped: a
    path holding a line break (or any control character), or a configuration file's name
    holding one in the comment that says where a value came from, made a document no TOML
    reader takes."""
    import tomllib

    odd = tmp_path / 'a\nb\t"c"\\d\x01'
    odd.mkdir()
    conf = odd / "kvfs.toml"
    conf.write_text('[store]\nindex_dir = "i\\nj"\n')
    s = load_settings(conf, env={"KVFS_DATA_DIRS": f"{odd}/d0,{odd}/d1"})
    back = tomllib.loads(as_toml(s))
    assert back["store"]["data_dirs"] == [f"{odd}/d0", f"{odd}/d1"]
    assert back["store"]["index_dir"] == "i\nj"


def test_a_variable_a_flag_overrides_is_not_read() -> None:
    """An empty KVFS_DATA_DIRS is refused (an unset ${VAR} in a unit file, say), but one a
    flag overrides was refused too: `--data d` (and every command run on a mount, which
    names the mount's directories so) failed though the variable was not used."""
    s = load_settings(env={"KVFS_DATA_DIRS": ""}, flags={"data_dirs": "/x"})
    assert s["data_dirs"] == ["/x"] and s.sources["data_dirs"] == "flag"
    with pytest.raises(ValueError, match=r"\$KVFS_DATA_DIRS"):
        load_settings(env={"KVFS_DATA_DIRS": ""})
