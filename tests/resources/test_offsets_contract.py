"""The offset store contract, run on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from lineage.core.errors import ConfigError, OffsetError, TopicLockedError, UnknownTopicError
from lineage.core.positions import Position
from resources.state.lease import LeaseKeeper
from resources.state.offset_sql import (
    LEASE_ENV,
    OWNER_HOST_ENV,
    OwnerId,
    SqlOffsetStore,
    local_owner_is_dead,
    lock_lease_from_env,
    make_owner,
    open_offset_store,
)
from resources.state.offsets import (
    STATE_COMMITTED,
    STATE_NEW,
    STATE_PLANNED,
    STATE_RELOADED,
    OffsetRecord,
    OffsetStore,
)

ROOT = Path(__file__).resolve().parents[2]
T = "fact.orders"
A, B = "host-a:1:aaaaaaaa", "host-b:2:bbbbbbbb"


def P(minute: int, id: int = 0) -> Position:
    return Position(dt.datetime(2026, 1, 31, 12, minute, 0, 123456), id)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty store location: a SQLite file, or a new schema in the test database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'offsets.db'}"
    pg_url: str = request.getfixturevalue("pg_url")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return f"{pg_url}?options=-csearch_path%3D{schema}"


@pytest.fixture
def open_store(store_url: str) -> Iterator[Callable[[], OffsetStore]]:
    """Opens more store objects on the same database; all are closed at teardown."""
    opened: list[OffsetStore] = []

    def _open() -> OffsetStore:
        opened.append(open_offset_store(store_url))
        return opened[-1]

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store: Callable[[], OffsetStore]) -> OffsetStore:
    return open_store()


def current(store: OffsetStore, topic: str = T) -> OffsetRecord:
    rec = store.get(topic)
    assert rec is not None, f"{topic} has no record"
    return rec


def locked(store: OffsetStore, last: Position | None = None, owner: str = A) -> OffsetStore:
    store.init(T, last or P(0), "step", who="test")
    store.acquire(T, owner)
    return store


def planned(store: OffsetStore) -> OffsetStore:
    locked(store).plan(T, A, last=P(0), next=P(1), seq=1, source_version=7)
    return store


# -- records ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("last", [Position.zero(), P(0, -5), Position(dt.datetime(2026, 1, 1, 0, 0, 0, 1), 2**62)],
                         ids=["zero", "negative-id", "microsecond"])
def test_init_then_get_round_trips(store: OffsetStore, last: Position) -> None:
    rec = store.init(T, last, "step", who="me", note="first")
    got = current(store)
    assert got == rec
    assert (got.last, got.next, got.rows, got.seq, got.run, got.processor, got.state, got.owner,
            got.owner_since, got.source_version) == (last, None, 0, 0, None, "step", STATE_NEW, "", None, None)
    assert not got.pending
    assert store.get("fact.other") is None
    [entry] = store.history(T)
    assert (entry.action, entry.who, entry.old_last, entry.new_last, entry.note) == ("init", "me", None, last, "first")


def test_every_field_round_trips(store: OffsetStore) -> None:
    planned(store).commit(T, A, seq=1, last=P(0), next=P(1), rows=42)
    rec = store.plan(T, A, last=P(1), next=Position(dt.datetime(2026, 2, 1, 0, 0, 0, 999999), -(2**63) + 1),
                     seq=2, source_version=2**40)
    got = current(store)
    assert got == rec
    assert got.next == Position(dt.datetime(2026, 2, 1, 0, 0, 0, 999999), -(2**63) + 1)
    assert (got.rows, got.seq, got.source_version, got.state, got.owner) == (42, 2, 2**40, STATE_PLANNED, A)
    assert got.run is not None and got.owner_since is not None and got.run.tzinfo is None
    assert got.pending


def test_init_twice_is_refused(store: OffsetStore) -> None:
    store.init(T, P(0), "step", who="me")
    with pytest.raises(OffsetError, match="already has an offset record"):
        store.init(T, P(5), "reload", who="me")
    assert current(store).last == P(0)


def test_list_is_ordered_by_topic(store: OffsetStore) -> None:
    for topic in ("b.x", "a.y", "c.z"):
        store.init(topic, P(0), "step", who="me")
    assert [r.topic for r in store.list()] == ["a.y", "b.x", "c.z"]


def test_unknown_topic(store: OffsetStore) -> None:
    for call in (lambda: store.acquire(T, A), lambda: store.release(T, A), lambda: store.unlock(T, who="x"),
                 lambda: store.reset(T, P(0), who="x", reason="r")):
        with pytest.raises(UnknownTopicError, match=T):
            call()


# -- locks ------------------------------------------------------------------------------------------


def test_acquire_is_reentrant_and_exclusive(store: OffsetStore) -> None:
    store.init(T, P(0), "step", who="me")
    first = store.acquire(T, A)
    assert first.owner == A and first.owner_since is not None
    assert store.acquire(T, A).owner_since == first.owner_since
    with pytest.raises(TopicLockedError, match=re.escape(f"'{A}'")) as err:
        store.acquire(T, B)
    assert err.value.holder == A and err.value.topic == T
    assert current(store).owner == A


def test_acquire_needs_an_owner(store: OffsetStore) -> None:
    store.init(T, P(0), "step", who="me")
    with pytest.raises(OffsetError, match="non-empty owner"):
        store.acquire(T, "")


def test_stale_owner_is_taken_over_and_logged(store: OffsetStore) -> None:
    locked(store)
    store.is_stale_owner = lambda owner: owner == A
    assert store.acquire(T, B).owner == B
    entry = store.history(T)[0]
    assert (entry.action, entry.who) == ("steal", B) and A in entry.note
    with pytest.raises(TopicLockedError):  # B is alive
        store.acquire(T, A)


def test_release(store: OffsetStore) -> None:
    locked(store)
    with pytest.raises(OffsetError, match="cannot release"):
        store.release(T, B)
    assert current(store).owner == A
    store.release(T, A)
    assert (current(store).owner, current(store).owner_since) == ("", None)
    store.release(T, B)  # nobody holds it: no-op
    assert store.acquire(T, B).owner == B


def test_unlock_clears_and_is_logged(store: OffsetStore) -> None:
    locked(store)
    assert store.unlock(T, who="admin") == A
    assert current(store).owner == ""
    entry = store.history(T)[0]
    assert (entry.action, entry.who) == ("unlock", "admin") and A in entry.note
    assert store.unlock(T, who="admin") == ""


# -- plan / commit ----------------------------------------------------------------------------------


def test_plan_sets_next_seq_and_state(store: OffsetStore) -> None:
    rec = current(planned(store))
    assert (rec.last, rec.next, rec.seq, rec.state, rec.source_version) == (P(0), P(1), 1, STATE_PLANNED, 7)
    entry = store.history(T)[0]
    assert (entry.action, entry.who, entry.old_last, entry.new_last) == ("plan", A, P(0), P(0))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"last": P(0, -1)}, r"expected last \(.*\) but the store has \(.*\); another run committed first — re-plan"),
    ({"seq": 0}, "not above the stored 0"),
    ({"next": P(0)}, "is not after last"),
    ({"owner": B}, "held by"),
    ({"owner": ""}, "non-empty owner"),
], ids=["last", "seq", "next", "owner", "no-owner"])
def test_plan_compare_and_set(store: OffsetStore, kwargs: dict, message: str) -> None:
    locked(store)
    args = {"owner": A, "last": P(0), "next": P(1), "seq": 1} | kwargs
    before = store.get(T)
    with pytest.raises(OffsetError, match=message):
        store.plan(T, args.pop("owner"), source_version=None, **args)
    assert store.get(T) == before


def test_plan_requires_the_lock(store: OffsetStore) -> None:
    store.init(T, P(0), "step", who="me")
    with pytest.raises(OffsetError, match="nobody holds the lock"):
        store.plan(T, A, last=P(0), next=P(1), seq=1, source_version=None)


def test_plan_can_release_the_lock_in_the_same_transaction(store: OffsetStore) -> None:
    rec = locked(store).plan(T, A, last=P(0), next=P(1), seq=1, source_version=3, release=True)
    assert current(store) == rec
    assert (rec.next, rec.seq, rec.state, rec.owner, rec.owner_since, rec.lease_until) == (P(1), 1, STATE_PLANNED, "", None, None)
    assert [e.action for e in store.history(T)][:1] == ["plan"]
    assert store.acquire(T, B).owner == B  # the block's run takes the lock and finds it pending
    assert current(store).pending and current(store).seq == 1


def test_a_plan_that_does_not_wait_for_the_disk_is_synced_by_sync(open_store: Callable[[], OffsetStore], store_url: str) -> None:
    store = open_store()
    rec = locked(store).plan(T, A, last=P(0), next=P(1), seq=1, source_version=None, release=True, flush=False)
    assert current(open_store()) == rec  # committed: another connection sees it
    store.sync()
    store.sync()
    assert current(store) == rec and [e.action for e in store.history(T)][:1] == ["plan"]  # sync logs nothing
    if store_url.startswith("sqlite:///"):  # the waiting commit must write a page, else it does not sync the WAL
        wal = Path(store_url.removeprefix("sqlite:///") + "-wal")
        size = wal.stat().st_size
        store.sync()
        assert wal.stat().st_size > size


def test_plan_while_pending_is_refused(store: OffsetStore) -> None:
    planned(store)
    with pytest.raises(OffsetError, match="planned and not committed"):
        store.plan(T, A, last=P(0), next=P(2), seq=2, source_version=None)
    assert current(store).next == P(1)


def test_messages_name_the_start_not_the_zero_sentinel(store: OffsetStore) -> None:
    locked(store, Position.zero()).plan(T, A, last=Position.zero(), next=P(1), seq=1, source_version=None)
    with pytest.raises(OffsetError, match=r"block 1 \(start, \(.*\)\] is planned and not committed") as exc:
        store.plan(T, A, last=Position.zero(), next=P(2), seq=2, source_version=None)
    assert "0001-01-01" not in str(exc.value) and str(-(2**63)) not in str(exc.value)


def test_commit_moves_last(store: OffsetStore) -> None:
    rec = planned(store).commit(T, A, seq=1, last=P(0), next=P(1), rows=10, note="done")
    assert store.get(T) == rec
    assert (rec.last, rec.next, rec.rows, rec.seq, rec.state, rec.owner) == (P(1), None, 10, 1, STATE_COMMITTED, A)
    assert rec.run is not None
    entry = store.history(T)[0]
    assert (entry.action, entry.old_last, entry.new_last, entry.note) == ("commit", P(0), P(1), "done")
    store.plan(T, A, last=P(1), next=P(2), seq=2, source_version=None)
    assert store.commit(T, A, seq=2, last=P(1), next=P(2), rows=1, state="failed: x").state == "failed: x"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"seq": 2}, r"expected block 2 .* but the store has block 1"),
    ({"last": P(5)}, "another run committed or reset it — re-plan"),
    ({"next": P(2)}, "expected block 1"),
    ({"owner": B}, "held by"),
], ids=["seq", "last", "next", "owner"])
def test_commit_compare_and_set_changes_nothing(store: OffsetStore, kwargs: dict, message: str) -> None:
    before = planned(store).get(T)
    args = {"owner": A, "seq": 1, "last": P(0), "next": P(1)} | kwargs
    with pytest.raises(OffsetError, match=message):
        store.commit(T, args.pop("owner"), rows=1, **args)
    assert store.get(T) == before
    assert store.history(T)[0].action == "plan"


def test_commit_twice_is_refused(store: OffsetStore) -> None:
    planned(store).commit(T, A, seq=1, last=P(0), next=P(1), rows=1)
    with pytest.raises(OffsetError, match="no block pending"):
        store.commit(T, A, seq=1, last=P(0), next=P(1), rows=1)


def test_set_state_by_the_holder_only(store: OffsetStore) -> None:
    locked(store).set_state(T, A, "failed: boom")
    assert current(store).state == "failed: boom"
    with pytest.raises(OffsetError, match="held by"):
        store.set_state(T, B, "x")


# -- reload / reset ---------------------------------------------------------------------------------


def test_commit_reload_never_moves_last_backwards(store: OffsetStore) -> None:
    locked(store, last=P(10))
    rec = store.commit_reload(T, A, seq=1, mark=P(20), rows=5, source_version=3)
    assert (rec.last, rec.seq, rec.rows, rec.state, rec.source_version) == (P(20), 1, 5, STATE_RELOADED, 3)
    rec = store.commit_reload(T, A, seq=2, mark=P(15), rows=6, source_version=4)
    assert (rec.last, rec.seq, rec.rows) == (P(20), 2, 6)
    assert store.get(T) == rec
    entry = store.history(T)[0]
    assert (entry.action, entry.new_last) == ("reload", P(20)) and "last kept" in entry.note
    with pytest.raises(OffsetError, match="not above the stored 2"):
        store.commit_reload(T, A, seq=2, mark=P(30), rows=1, source_version=None)
    with pytest.raises(OffsetError, match="held by"):
        store.commit_reload(T, B, seq=3, mark=P(30), rows=1, source_version=None)
    assert store.get(T) == rec


def test_reset_moves_backwards_keeps_seq_and_is_logged(store: OffsetStore) -> None:
    planned(store).commit(T, A, seq=1, last=P(0), next=P(1), rows=1)
    store.plan(T, A, last=P(1), next=P(2), seq=2, source_version=None)
    rec = store.reset(T, Position.zero(), who=A, reason="backfill")
    assert (rec.last, rec.next, rec.seq, rec.owner) == (Position.zero(), None, 2, A)
    assert store.get(T) == rec
    entry = store.history(T)[0]
    assert (entry.action, entry.who, entry.note, entry.old_last, entry.new_last) == (
        "reset", A, "backfill", P(1), Position.zero())
    with pytest.raises(OffsetError, match="not above the stored 2"):
        store.plan(T, A, last=Position.zero(), next=P(1), seq=2, source_version=None)


def test_forget_deletes_a_record_is_logged_and_refused_while_another_owner_holds_it(store: OffsetStore) -> None:
    locked(store)
    with pytest.raises(TopicLockedError, match=re.escape(A)):
        store.forget(T, who="admin", reason="replicator deleted")
    store.release(T, A)
    store.forget(T, who="admin", reason="replicator deleted")
    assert store.get(T) is None
    assert store.history(T)[0].action == "forget" and store.history(T)[0].note == "replicator deleted"
    store.forget(T, who="admin", reason="again")  # nothing there: a no-op
    store.init(T, P(0), "step", who="test")  # the name is free again


def test_reset_is_refused_while_another_owner_holds_the_lock(store: OffsetStore) -> None:
    locked(store)
    with pytest.raises(TopicLockedError, match=re.escape(A)):
        store.reset(T, P(5), who="admin", reason="x")
    assert current(store).last == P(0)
    store.release(T, A)
    assert store.reset(T, P(5), who="admin", reason="x").last == P(5)


# -- history ----------------------------------------------------------------------------------------


def test_history_newest_first_and_filtered(store: OffsetStore) -> None:
    planned(store).commit(T, A, seq=1, last=P(0), next=P(1), rows=1)
    store.init("dim.other", P(0), "reload", who="me")
    assert [e.action for e in store.history()] == ["init", "commit", "plan", "init"]
    assert [e.action for e in store.history(T)] == ["commit", "plan", "init"]
    assert [e.action for e in store.history(T, limit=2)] == ["commit", "plan"]
    ats = [e.at for e in store.history()]
    assert ats == sorted(ats, reverse=True)


# -- several store objects / processes ----------------------------------------------------------------


def test_two_store_objects_see_each_others_writes(open_store: Callable[[], OffsetStore]) -> None:
    one, two = open_store(), open_store()
    one.init(T, P(0), "step", who="me")
    assert two.get(T) == one.get(T)
    two.acquire(T, B)
    with pytest.raises(TopicLockedError, match=re.escape(B)):
        one.acquire(T, A)
    two.plan(T, B, last=P(0), next=P(1), seq=1, source_version=None)
    assert current(one).next == P(1)


def _race(stores: list[OffsetStore], call: Callable[[OffsetStore, int], object]) -> list[BaseException | None]:
    """Run ``call(store, i)`` on every store at once, each in its own thread."""
    barrier = threading.Barrier(len(stores))
    results: list[BaseException | None] = [None] * len(stores)

    def run(i: int) -> None:
        barrier.wait()
        try:
            call(stores[i], i)
        except BaseException as exc:  # noqa: B036 - collected and checked by the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_concurrent_plans_exactly_one_wins(open_store: Callable[[], OffsetStore]) -> None:
    stores = [open_store() for _ in range(6)]
    locked(stores[0])
    results = _race(stores, lambda s, i: s.plan(T, A, last=P(0), next=P(1, i), seq=1, source_version=i))
    assert results.count(None) == 1, results
    assert all(isinstance(r, OffsetError) for r in results if r is not None), results
    winner = results.index(None)
    assert current(stores[0]).next == P(1, winner)
    assert [e.action for e in stores[0].history(T)].count("plan") == 1


def test_concurrent_acquires_exactly_one_wins(open_store: Callable[[], OffsetStore]) -> None:
    stores = [open_store() for _ in range(6)]
    stores[0].init(T, P(0), "step", who="me")
    results = _race(stores, lambda s, i: s.acquire(T, f"owner-{i}"))
    assert results.count(None) == 1, results
    assert all(isinstance(r, TopicLockedError) for r in results if r is not None), results
    assert current(stores[0]).owner == f"owner-{results.index(None)}"


def test_processes_create_and_use_one_store(store_url: str) -> None:
    """Several processes open a store that does not exist yet (racing to create its tables)."""
    script = ("import sys; from resources.state.offset_sql import open_offset_store; from lineage.core.positions import "
              "Position; s = open_offset_store(sys.argv[1]); s.init('t.p' + sys.argv[2], Position.zero(), "
              "'step', who=sys.argv[2]); s.close()")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script, store_url, str(i)], env=env, stderr=subprocess.PIPE,
                              text=True) for i in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    s = open_offset_store(store_url)
    try:
        assert [r.topic for r in s.list()] == [f"t.p{i}" for i in range(4)]
    finally:
        s.close()


# -- opening by URL ---------------------------------------------------------------------------------


def test_open_sqlite_absolute_path_creates_the_directory_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "offsets.db"
    s = open_offset_store(f"sqlite:///{path}", create_dir=True)
    try:
        assert isinstance(s, SqlOffsetStore) and path.is_file()
        assert s.is_stale_owner is local_owner_is_dead
    finally:
        s.close()


def test_open_sqlite_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "state").mkdir()
    open_offset_store("sqlite:///state/offsets.db").close()
    assert (tmp_path / "state" / "offsets.db").is_file()


def test_open_sqlite_in_a_missing_folder_is_a_config_error_naming_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/no/such/dir/x.db"
    with pytest.raises(ConfigError, match=rf"offset store '{url}': the folder {tmp_path}/no/such/dir does not exist; "
                                          "create it, or fix TIDEMARK_OFFSETS_URL / --offsets-url"):
        open_offset_store(url)
    assert not (tmp_path / "no").exists()


def test_sqlite_waits_for_the_disk_on_every_write_but_init_and_the_lock(tmp_path: Path) -> None:
    """plan/commit/reset must survive a power cut; init/acquire/release need not (see
    resources.state.offset_sql). The mode each COMMIT ran under, as SQLite saw the statements; the
    mode is switched only when it changes, so a write after a refused or relaxed one still waits."""
    store = SqlOffsetStore.sqlite(tmp_path / "offsets.db")
    mode, commits = ["FULL"], []

    def trace(sql: str) -> None:
        if sql.startswith("PRAGMA synchronous="):
            mode[0] = sql.split("=", 1)[1]
        elif sql == "COMMIT":
            commits.append(mode[0])

    store._conn.set_trace_callback(trace)

    def relaxes(call: Callable[[], object]) -> bool:
        commits.clear()
        call()
        assert len(set(commits)) <= 1, commits
        return commits == ["NORMAL"] * len(commits) and bool(commits)

    def refused_acquire() -> None:
        with pytest.raises(TopicLockedError):
            store.acquire(T, B)

    try:
        assert relaxes(lambda: store.init(T, P(0), "step", who="test"))
        assert relaxes(lambda: store.acquire(T, A))
        commits.clear()
        refused_acquire()
        assert commits == []  # (rolled back)
        assert commits == [] and not relaxes(lambda: store.plan(T, A, last=P(0), next=P(1), seq=1, source_version=None))
        assert commits == ["FULL"]
        assert not relaxes(lambda: store.commit(T, A, seq=1, last=P(0), next=P(1), rows=0))
        assert not relaxes(lambda: store.set_state(T, A, "x"))
        assert relaxes(lambda: store.release(T, A))
        assert not relaxes(lambda: store.reset(T, P(0), who="test", reason="test"))
        assert store._conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL, as the reset left it
        assert not relaxes(lambda: store.unlock(T, who="test"))
        assert commits == ["FULL"]
    finally:
        store.close()


@pytest.mark.postgres
def test_open_postgres_alias(pg_url: str) -> None:
    s = open_offset_store(pg_url.replace("postgresql://", "postgres://"))
    try:
        assert s.list() is not None
    finally:
        s.close()


@pytest.mark.parametrize("url", ["mysql://u@h/db", "sqlite://", "sqlite:///", "/tmp/offsets.db", ""])
def test_open_rejects_other_urls(url: str) -> None:
    with pytest.raises(ConfigError, match="accepted forms: sqlite:///") as err:
        open_offset_store(url)
    assert repr(url) in str(err.value)


def test_open_hides_the_password() -> None:
    with pytest.raises(ConfigError) as err:
        open_offset_store("mysql://user:secret@host/db")
    assert "secret" not in str(err.value) and "user:***@host" in str(err.value)


# -- owners -----------------------------------------------------------------------------------------


def test_make_owner() -> None:
    owner = make_owner()
    ns = os.stat("/proc/self/ns/pid").st_ino
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    assert re.fullmatch(rf"{re.escape(socket.gethostname())}:{os.getpid()}@{ns}\.{boot}:[0-9a-f]{{8}}", owner)
    assert make_owner() != owner
    with_run = make_owner(run_id="6f1d2c3b-aaaa-4bbb-8ccc-0123456789ab")
    parsed = OwnerId.parse(with_run)
    assert parsed is not None and str(parsed) == with_run
    assert (parsed.pid, parsed.pid_ns, parsed.boot_id, parsed.run_id) == (
        os.getpid(), str(ns), boot, "6f1d2c3b-aaaa-4bbb-8ccc-0123456789ab")
    old = OwnerId.parse("host-a:1:aaaaaaaa")  # an id written by a Tidemark without namespaces
    assert old is not None and (old.host, old.pid, old.pid_ns, old.run_id) == ("host-a", 1, None, None)
    assert OwnerId.parse("not an owner") is None


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _owner_here(pid: int, *, host: str | None = None, ns: str | None = None, boot: str | None = None) -> str:
    """An owner id of this host, pid namespace and boot, but for ``pid`` (and what is overridden)."""
    here = OwnerId.parse(make_owner())
    assert here is not None and here.pid_ns and here.boot_id
    return str(OwnerId(host or here.host, pid, "00000000", ns or here.pid_ns, boot or here.boot_id))


def test_local_owner_is_dead_only_in_this_pid_namespace_and_boot(monkeypatch: pytest.MonkeyPatch) -> None:
    dead = _dead_pid()
    here = OwnerId.parse(make_owner())
    assert here is not None and here.pid_ns is not None
    assert local_owner_is_dead(_owner_here(dead))
    assert not local_owner_is_dead(make_owner())
    assert not local_owner_is_dead(_owner_here(1))  # exists (init), maybe not ours
    # Same hostname, another pid namespace (a container sharing the host's UTS namespace, a pod
    # sibling): its pids mean nothing here. Another boot: the pid is from before a reboot.
    assert not local_owner_is_dead(_owner_here(dead, ns=str(int(here.pid_ns) + 1)))
    assert not local_owner_is_dead(_owner_here(dead, boot="00000000"))
    assert not local_owner_is_dead(_owner_here(dead, host=f"not-{socket.gethostname()}"))
    # Ids of older Tidemarks carry no namespace: never provably dead, only the lease frees them.
    assert not local_owner_is_dead(f"{socket.gethostname()}:{dead}:00000000")
    for junk in ("", "x", f"{socket.gethostname()}:abc:00", _owner_here(0)):
        assert not local_owner_is_dead(junk)
    # TIDEMARK_OWNER_HOST replaces the hostname in new ids and in the comparison.
    monkeypatch.setenv(OWNER_HOST_ENV, "pod-7")
    assert make_owner().startswith(f"pod-7:{os.getpid()}@")
    assert local_owner_is_dead(_owner_here(dead, host="pod-7"))
    assert not local_owner_is_dead(_owner_here(dead, host=socket.gethostname()))


# -- catching up with the Delta log ---------------------------------------------------------------


def _recover(store: OffsetStore, *, expected_seq: int, seq: int, last: Position, who: str = "engine") -> OffsetRecord:
    return store.recover(T, who=who, expected_seq=expected_seq, seq=seq, last=last, rows=9, run=dt.datetime(2026, 2, 1),
                         state=STATE_COMMITTED, source_version=11, delta_version=42, note="caught up from the Delta log")


def test_recover_catches_a_stale_record_up_and_is_logged(store: OffsetStore) -> None:
    planned(store)  # block 1 pending in the stale copy; the log has landed up to block 4
    store.release(T, A)
    rec = _recover(store, expected_seq=1, seq=4, last=P(9))
    assert (rec.last, rec.next, rec.seq, rec.rows, rec.state, rec.source_version, rec.delta_version) == \
        (P(9), None, 4, 9, STATE_COMMITTED, 11, 42)
    assert current(store) == rec
    entry = store.history(T, limit=1)[0]
    assert (entry.action, entry.who, entry.old_last, entry.new_last, entry.note) == \
        ("recover", "engine", P(0), P(9), "caught up from the Delta log")


def test_recover_is_compare_and_set_and_never_goes_back(store: OffsetStore) -> None:
    store.init(T, P(0), "step", who="test", seq=2)
    assert current(store).seq == 2
    with pytest.raises(OffsetError, match="another run caught it up first"):
        _recover(store, expected_seq=1, seq=4, last=P(9))
    with pytest.raises(OffsetError, match="only catches a store up"):
        _recover(store, expected_seq=2, seq=2, last=P(9))
    store.acquire(T, B)
    with pytest.raises(TopicLockedError):
        _recover(store, expected_seq=2, seq=4, last=P(9))
    assert _recover(store, expected_seq=2, seq=4, last=P(9), who=B).seq == 4  # the holder may


def test_commit_records_the_delta_version_and_reset_never_lowers_seq(store: OffsetStore) -> None:
    planned(store)
    rec = store.commit(T, A, seq=1, last=P(0), next=P(1), rows=3, delta_version=17)
    assert rec.delta_version == 17 and current(store).delta_version == 17
    store.release(T, A)
    assert store.reset(T, P(0), who="op", reason="replay", seq=6).seq == 6
    assert store.reset(T, P(0), who="op", reason="replay", seq=2).seq == 6


def test_a_store_created_before_delta_version_existed_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.execute("""CREATE TABLE tidemark_offsets (
        topic TEXT PRIMARY KEY, last_pos TEXT NOT NULL, last_id BIGINT NOT NULL,
        next_pos TEXT, next_id BIGINT, rows BIGINT NOT NULL, seq BIGINT NOT NULL, run TEXT,
        processor TEXT NOT NULL, state TEXT NOT NULL, owner TEXT NOT NULL, owner_since TEXT,
        source_version BIGINT, updated_at TEXT NOT NULL)""")
    conn.execute("INSERT INTO tidemark_offsets VALUES ('fact.orders', '2026-01-31T12:00:00.000000', 5, NULL, NULL, 3, 2, "
                 "NULL, 'step', 'committed', '', NULL, 4, '2026-01-31T12:00:00.000000')")
    conn.commit()
    conn.close()
    store = open_offset_store(f"sqlite:///{db}")
    rec = current(store)
    assert (rec.seq, rec.source_version, rec.delta_version) == (2, 4, None)
    store.close()


# -- leases -------------------------------------------------------------------------------------------


class Clock:
    """A store clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = dt.datetime(2026, 3, 1, 12, 0, 0)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, **kwargs: float) -> None:
        self.now += dt.timedelta(**kwargs)


@pytest.fixture
def clock(store: OffsetStore) -> Clock:
    """A hand-moved clock on ``store``, whose lease is one minute."""
    c = Clock()
    store.clock = c
    store.lease = dt.timedelta(minutes=1)
    return c


def test_acquire_writes_the_lease_and_reentry_extends_it(store: OffsetStore, clock: Clock) -> None:
    store.init(T, P(0), "step", who="me")
    rec = store.acquire(T, A)
    assert rec.lease_until == clock.now + dt.timedelta(minutes=1) and current(store) == rec
    clock.advance(seconds=40)
    again = store.acquire(T, A)
    assert again.lease_until == clock.now + dt.timedelta(minutes=1) and again.owner_since == rec.owner_since
    store.release(T, A)
    assert current(store).lease_until is None


def test_expired_lease_is_taken_over_and_logged_as_steal(store: OffsetStore, clock: Clock) -> None:
    locked(store)
    since = clock.now
    clock.advance(seconds=59)
    with pytest.raises(TopicLockedError, match=re.escape("Its lease expires at 2026-03-01T12:01:00.000000 UTC; if that run is dead")) as err:
        store.acquire(T, B)
    assert "taken over then, or clear it now with: tidemark offsets unlock fact.orders" in str(err.value)
    assert err.value.holder == A and current(store).owner == A
    clock.advance(seconds=31)
    rec = store.acquire(T, B)
    assert (rec.owner, rec.owner_since, rec.lease_until) == (B, clock.now, clock.now + dt.timedelta(minutes=1))
    entry = store.history(T)[0]
    assert (entry.action, entry.who) == ("steal", B)
    assert entry.note == (f"took the lock from '{A}' since {since.isoformat(timespec='microseconds')}: "
                          f"its lease expired at 2026-03-01T12:01:00.000000 (30s ago)")


def test_heartbeat_keeps_the_lock(store: OffsetStore, clock: Clock) -> None:
    locked(store)
    for _ in range(5):
        clock.advance(seconds=50)
        assert store.heartbeat(T, A).lease_until == clock.now + dt.timedelta(minutes=1)
        with pytest.raises(TopicLockedError):
            store.acquire(T, B)
    assert current(store).owner == A
    assert [e.action for e in store.history(T)] == ["init"]  # heartbeats are not logged
    clock.advance(seconds=61)
    assert store.acquire(T, B).owner == B


def test_heartbeat_after_takeover_or_unlock_raises(store: OffsetStore, clock: Clock) -> None:
    locked(store)
    clock.advance(minutes=2)
    store.acquire(T, B)
    with pytest.raises(OffsetError, match=re.escape(f"heartbeat by '{A}' refused: the lock is held by '{B}'")) as err:
        store.heartbeat(T, A)
    assert "stop this run" in str(err.value)
    assert current(store).owner == B
    store.unlock(T, who="admin")
    with pytest.raises(OffsetError, match="nobody holds the lock"):
        store.heartbeat(T, B)
    with pytest.raises(UnknownTopicError):
        store.heartbeat("fact.other", A)


def test_other_pid_namespace_is_not_stolen_while_its_lease_lives(store: OffsetStore, clock: Clock) -> None:
    """Same hostname, a pid that does not exist here, but another pid namespace (or an id of an
    older Tidemark): only the lease may free the lock."""
    here = OwnerId.parse(make_owner())
    assert here is not None and here.pid_ns is not None
    dead = _dead_pid()
    store.init(T, P(0), "step", who="me")
    for holder in (_owner_here(dead, ns=str(int(here.pid_ns) + 1)), f"{socket.gethostname()}:{dead}:00000000"):
        store.unlock(T, who="test")
        store.acquire(T, holder)
        clock.advance(seconds=59)
        with pytest.raises(TopicLockedError):
            store.acquire(T, B)
        clock.advance(seconds=2)
        assert store.acquire(T, B).owner == B
    # The same dead pid in this namespace is provably dead: taken over at once.
    store.unlock(T, who="test")
    store.acquire(T, _owner_here(dead))
    assert store.acquire(T, B).owner == B
    assert store.history(T)[0].note.endswith("its process is dead")


def test_release_dead_is_compare_and_set_on_the_owner(store: OffsetStore) -> None:
    locked(store)
    assert not store.release_dead(T, B, who="sensor", reason="run x failed")
    assert current(store).owner == A
    assert store.release_dead(T, A, who="sensor", reason="Dagster run r1 ended as FAILURE")
    rec = current(store)
    assert (rec.owner, rec.owner_since, rec.lease_until) == ("", None, None)
    entry = store.history(T)[0]
    assert (entry.action, entry.who) == ("release-dead", "sensor")
    assert A in entry.note and entry.note.endswith("Dagster run r1 ended as FAILURE")
    assert not store.release_dead(T, A, who="sensor", reason="again")  # free already: nothing logged
    assert store.history(T)[0] == entry


_OLD_DDL = """CREATE TABLE tidemark_offsets (
    topic TEXT PRIMARY KEY, last_pos TEXT NOT NULL, last_id BIGINT NOT NULL,
    next_pos TEXT, next_id BIGINT, rows BIGINT NOT NULL, seq BIGINT NOT NULL, run TEXT,
    processor TEXT NOT NULL, state TEXT NOT NULL, owner TEXT NOT NULL, owner_since TEXT,
    source_version BIGINT, updated_at TEXT NOT NULL)"""


def test_a_store_without_leases_is_migrated_on_open(store_url: str) -> None:
    """A store written before leases: the column is added; a lock it holds gets one lease from
    when it was taken."""
    row = ("fact.orders", "2026-01-31T12:00:00.000000", 0, None, None, 0, 0, None, "step", "new", A,
           "2026-01-31T12:00:00.000000", None, "2026-01-31T12:00:00.000000")
    insert = f"INSERT INTO tidemark_offsets VALUES ({', '.join(['?'] * len(row))})"
    if store_url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(store_url.removeprefix("sqlite:///"))) as conn, conn:
            conn.execute(_OLD_DDL)
            conn.execute(insert, row)
    else:
        with psycopg.connect(store_url, autocommit=True) as pg:
            pg.execute(_OLD_DDL)
            pg.execute(insert.replace("?", "%s"), row)
    stores = [open_offset_store(store_url) for _ in range(2)]  # the second finds the column there
    try:
        s = stores[0]
        rec = current(s)
        assert (rec.owner, rec.lease_until, rec.last) == (A, None, Position(dt.datetime(2026, 1, 31, 12), 0))
        s.lease = dt.timedelta(minutes=5)
        s.clock = lambda: dt.datetime(2026, 1, 31, 12, 4, 59)
        with pytest.raises(TopicLockedError, match="Its lease expires at 2026-01-31T12:05:00"):
            s.acquire(T, B)
        s.clock = lambda: dt.datetime(2026, 1, 31, 12, 5, 1)
        assert s.acquire(T, B).lease_until == dt.datetime(2026, 1, 31, 12, 10, 1)
        assert current(stores[1]).owner == B
    finally:
        for s in stores:
            s.close()


def test_lease_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert lock_lease_from_env({}) == dt.timedelta(minutes=5)
    assert lock_lease_from_env({LEASE_ENV: " 90s "}) == dt.timedelta(seconds=90)
    for bad in ("soon", "0", "-5m"):
        with pytest.raises(ConfigError, match=f"^{LEASE_ENV}: .*{re.escape(repr(bad))}"):
            lock_lease_from_env({LEASE_ENV: bad})
    monkeypatch.setenv(LEASE_ENV, "2m")
    s = open_offset_store(f"sqlite:///{tmp_path / 'o.db'}")
    try:
        assert s.lease == dt.timedelta(minutes=2)
    finally:
        s.close()
    monkeypatch.setenv(LEASE_ENV, "five minutes")
    with pytest.raises(ConfigError, match=LEASE_ENV):
        open_offset_store(f"sqlite:///{tmp_path / 'o.db'}")


def test_lease_keeper_heartbeats_from_its_thread_until_stopped(open_store: Callable[[], OffsetStore]) -> None:
    """The keeper shares the store object with the thread doing the block's writes."""
    store, other = open_store(), open_store()
    for s in (store, other):
        s.lease = dt.timedelta(seconds=1.5)
    locked(store)
    keeper = LeaseKeeper(store, T, A, interval_s=0.1).start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # the main thread writes while the keeper beats
            store.set_state(T, A, "working")
            with pytest.raises(TopicLockedError):
                other.acquire(T, B)
            time.sleep(0.05)
        keeper.check()
    finally:
        assert keeper.stop()
    lease = current(store).lease_until
    assert lease is not None and lease > dt.datetime.now(dt.UTC).replace(tzinfo=None)
    time.sleep(1.6)  # no heartbeat any more: the lease runs out
    assert other.acquire(T, B).owner == B


def test_lease_keeper_notices_a_takeover(open_store: Callable[[], OffsetStore]) -> None:
    store, other = open_store(), open_store()
    locked(store)
    keeper = LeaseKeeper(store, T, A, interval_s=0.05).start()
    other.unlock(T, who="admin")
    other.acquire(T, B)
    deadline = time.monotonic() + 10
    while keeper.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not keeper.stop()
    with pytest.raises(OffsetError, match=f"held by '{B}'"):
        keeper.check()


def test_lease_keeper_notices_its_record_gone(open_store: Callable[[], OffsetStore]) -> None:
    """The store lost or replaced under a running unit: the lock went with the record, so the unit
    must stop like after a takeover (a heartbeat that finds no record is not a passing failure)."""
    store, other = open_store(), open_store()
    locked(store)
    keeper = LeaseKeeper(store, T, A, interval_s=0.05).start()
    other.unlock(T, who="admin")
    other.forget(T, who="admin", reason="the store lost")
    deadline = time.monotonic() + 10
    while keeper.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not keeper.stop()
    with pytest.raises(OffsetError, match="no longer in the offset store"):
        keeper.check()


# -- per-input offsets (merge topics) ---------------------------------------------------------------


def test_per_input_offsets_are_planned_committed_and_round_trip(store: OffsetStore) -> None:
    locked(store)
    rec = store.plan(T, A, last=P(0), next=P(1), seq=1, source_version=3, inputs_next={"dim.c": 4, "dim.d": 0})
    assert current(store) == rec and rec.inputs == {} and rec.inputs_next == {"dim.c": 4, "dim.d": 0}
    rec = store.commit(T, A, seq=1, last=P(0), next=P(1), rows=5)
    assert (rec.inputs, rec.inputs_next) == ({"dim.c": 4, "dim.d": 0}, None)
    assert current(store) == rec
    # Only another input changed: a unit whose base block is empty (next == last) is allowed.
    store.plan(T, A, last=P(1), next=P(1), seq=2, source_version=3, inputs_next={"dim.c": 9, "dim.d": 0})
    assert current(store).pending
    assert store.commit(T, A, seq=2, last=P(1), next=P(1), rows=1).inputs == {"dim.c": 9, "dim.d": 0}
    # Without new input versions an empty block is still refused.
    with pytest.raises(OffsetError, match="is not after last"):
        store.plan(T, A, last=P(1), next=P(1), seq=3, source_version=3)


def test_an_input_offset_never_moves_backwards(store: OffsetStore) -> None:
    locked(store)
    store.plan(T, A, last=P(0), next=P(1), seq=1, source_version=3, inputs_next={"dim.c": 4})
    store.commit(T, A, seq=1, last=P(0), next=P(1), rows=5)
    with pytest.raises(OffsetError, match=r"input offsets would move backwards \(dim.c 3 < 4\)"):
        store.plan(T, A, last=P(1), next=P(2), seq=2, source_version=3, inputs_next={"dim.c": 3})
    assert not current(store).pending
    # recover never lowers an input either (the store may know a later version than a commit).
    store.release(T, A)
    rec = store.recover(T, who=B, expected_seq=1, seq=2, last=P(2), rows=1, run=None, state=STATE_COMMITTED,
                        source_version=3, delta_version=8, note="test", inputs={"dim.c": 2, "dim.e": 1})
    assert rec.inputs == {"dim.c": 4, "dim.e": 1}
    # A reset moves the base position only; input offsets stay.
    assert store.reset(T, P(0), who=B, reason="restate").inputs == {"dim.c": 4, "dim.e": 1}


def test_a_commit_forgets_the_inputs_it_names_after_taking_the_plans(store: OffsetStore) -> None:
    """A stream loop's positions in files that are gone (archived) are dropped as it commits."""
    locked(store)
    store.plan(T, A, last=P(0), next=P(1), seq=1, source_version=None, inputs_next={"f1": 10, "f1#done": 1, "f2": 5})
    store.commit(T, A, seq=1, last=P(0), next=P(1), rows=1)
    store.plan(T, A, last=P(1), next=P(2), seq=2, source_version=None, inputs_next={"f2": 8})
    rec = store.commit(T, A, seq=2, last=P(1), next=P(2), rows=1, forget=["f1", "f1#done", "f9"])
    assert rec.inputs == {"f2": 8} and current(store) == rec
    # a forgotten input starts again from nothing: planning it anew is not "backwards"
    store.plan(T, A, last=P(2), next=P(3), seq=3, source_version=None, inputs_next={"f1": 1})
    assert store.commit(T, A, seq=3, last=P(2), next=P(3), rows=0).inputs == {"f1": 1, "f2": 8}


def test_the_log_head_grows_with_every_logged_change_and_only_then(store: OffsetStore) -> None:
    empty = store.log_head()
    assert empty == 0
    store.init(T, P(0), "step", who="t")
    after_init = store.log_head()
    assert after_init > empty
    assert store.log_head() == after_init  # reading changes nothing
    store.acquire(T, A)
    store.plan(T, A, last=P(0), next=P(1), seq=1, source_version=None)
    assert store.log_head() > after_init
    entries = store.logged_after(after_init)
    assert list(entries.values()) == [T] and max(entries) == store.log_head()
    assert store.logged_after(store.log_head()) == {}


# -- the log's retention ---------------------------------------------------------------------------


def _log_blocks(store: OffsetStore, topic: str, blocks: int) -> None:
    """``blocks`` planned and committed blocks of ``topic`` (two log entries each)."""
    rec = store.get(topic) or store.init(topic, P(0), "step", who="t")
    store.acquire(topic, A)
    for _ in range(blocks):
        rec = current(store, topic)
        nxt = Position(rec.last.pos + dt.timedelta(minutes=1), 0)
        store.plan(topic, A, last=rec.last, next=nxt, seq=rec.seq + 1, source_version=None)
        store.commit(topic, A, seq=rec.seq + 1, last=rec.last, next=nxt, rows=1)
    store.release(topic, A)


def test_prune_log_removes_old_entries_but_each_topics_newest_and_never_a_record(
        store: OffsetStore, monkeypatch: pytest.MonkeyPatch) -> None:
    import resources.state.offset_sql as offset_sql

    monkeypatch.setattr(offset_sql, "PRUNE_BATCH", 3)  # several batches per topic
    clock = Clock()
    store.clock = clock
    _log_blocks(store, T, 5)  # init, then a plan and a commit per block
    _log_blocks(store, "fact.quiet", 2)
    old = {e.topic: sum(1 for x in store.history(limit=1000) if x.topic == e.topic) for e in store.history(limit=1000)}
    clock.advance(days=40)
    _log_blocks(store, T, 1)  # new entries: never pruned
    head, records = store.log_head(), store.list()
    cutoff = clock.now - dt.timedelta(days=30)
    assert old == {T: 11, "fact.quiet": 5}
    assert store.prune_log(cutoff, keep=2, dry_run=True) == old[T] + old["fact.quiet"] - 2
    assert len(store.history(limit=1000)) == old[T] + old["fact.quiet"] + 2  # a dry run removes nothing
    # T's two newest entries are new ones, so all its old ones may go; the quiet topic keeps its newest two.
    removed = store.prune_log(cutoff, keep=2)
    assert removed == old[T] + old["fact.quiet"] - 2
    left = store.history(limit=1000)
    assert [(e.topic, e.at >= cutoff) for e in left] == [(T, True), (T, True), ("fact.quiet", False), ("fact.quiet", False)]
    assert store.log_head() == head and store.list() == records
    assert store.prune_log(cutoff, keep=2) == 0  # nothing left to remove
    assert store.prune_log(clock.now + dt.timedelta(days=1), keep=1) == 2  # T keeps one, the quiet topic one
    assert store.log_head() == head
    with pytest.raises(ValueError, match="at least its newest"):
        store.prune_log(cutoff, keep=0)


def test_log_retention_from_env() -> None:
    from resources.state.offsets import LOG_KEEP_ENV, LOG_RETENTION_ENV, log_retention_from_env

    assert log_retention_from_env({}) == log_retention_from_env({LOG_RETENTION_ENV: "30d", LOG_KEEP_ENV: "1000"})
    assert log_retention_from_env({LOG_RETENTION_ENV: "0"}).age == dt.timedelta(0)
    assert log_retention_from_env({LOG_RETENTION_ENV: "12h", LOG_KEEP_ENV: "5"}).keep == 5
    for env, message in [({LOG_RETENTION_ENV: "soon"}, "TIDEMARK_OFFSET_LOG_RETENTION: 'soon' is not a duration"),
                         ({LOG_RETENTION_ENV: "5m"}, "TIDEMARK_OFFSET_LOG_RETENTION='5m': keep the offset log at least 1h"),
                         ({LOG_KEEP_ENV: "0"}, "TIDEMARK_OFFSET_LOG_KEEP='0': give how many"),
                         ({LOG_KEEP_ENV: "many"}, "TIDEMARK_OFFSET_LOG_KEEP='many'")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            log_retention_from_env(env)


# -- counters ---------------------------------------------------------------------------------------


def test_take_number_counts_from_one_and_from_a_floor_without_a_lock(open_store: Callable[[], OffsetStore]) -> None:
    one, two = open_store(), open_store()
    assert [one.take_number("n", who=A), two.take_number("n", who=B), one.take_number("n", who=A)] == [1, 2, 3]
    assert two.take_number("n", who=B, at_least=10) == 11  # a floor the caller knows raises it
    assert one.take_number("n", who=A, at_least=5) == 12  # never lowers it
    rec = current(one, "n")
    assert (rec.seq, rec.owner, rec.next, rec.processor) == (12, "", None, "counter")


def test_take_number_gives_every_concurrent_caller_its_own_number(open_store: Callable[[], OffsetStore]) -> None:
    stores = [open_store() for _ in range(4)]
    got: list[int] = []

    def draw(s: OffsetStore) -> None:
        got.extend(s.take_number("n", who=A) for _ in range(25))

    threads = [threading.Thread(target=draw, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 101))
