"""``tidemark follow``: one resident process, one Spark session, every unit the moment it is due
(issue 55, DESIGN.md "Two ways to run").

Every ``interval`` (default 0.5 s) the follower *looks*, JVM-free: the newest Delta version of
every table the lineage's topics read (one file lookup per table when nothing changed), and the
WAL position of each PostgreSQL replicator's server (the end of a Debezium replicator's files). A
topic is looked at (:meth:`Engine.run_topic`: its lock, its planner rules, its unit) when

- a table it reads changed (a commit upstream, by a topic or anyone else);
- its last unit did work (there may be more: when behind, units follow each other at once and
  grow up to ``maxstep``, so throughput rises with the backlog);
- its last wait depends on the clock (``delay``, ``repeat``, a producer's freshness), again after
  ``recheck`` (1 s); a change of a table it reads with a ``delay`` is looked at again one second
  after the delay has passed;
- a failure's backoff passed (2, 4, 8 ... 60 s): the failing topic is retried, the others go on;
- or every ``full_every`` (30 s), whatever it said.

A source the look finds ``$TIDEMARK_FOLLOW_CHECKPOINT_EVERY`` (10) commits past its newest
checkpoint is checkpointed in the background (:mod:`~platform_assets.follow.checkpoints`), so the
units that read it do not replay up to 100 commits (a ``deltalake`` writer's interval) each.

A replicator is looked at (one unit, :meth:`ReplicatorUnit.run_once`) when its source moved since
its last unit started, after a unit that did work, and every ``full_every``. The event intake
(``events``, when an intake config is given: its batch destinations) runs
:func:`~platform_assets.intake.units.process_ready` when the collector's ready files (a directory
listing) are not those its last look found, after a unit that did work, and every ``full_every``.

Units of different topics run at once on a pool of threads, each thread with an
:class:`~platform_assets.engine.runner.Engine` of its own on the one shared Spark session: each
unit goes through the same commit protocol, lease lock and ``etl.log`` as a ``tidemark run``, so
it lands exactly once, and two followers (or a follower and a run) on one offset store share the
topics: the one holding a topic's lock runs it, the other waits and says who holds it. One unit of
a topic at a time: a topic's units run in order, and a consumer's rules (``depends_on``) keep it
behind its producers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lineage.core.errors import TidemarkError, TopicLockedError, first_line
from lineage.planning.look import changed_tables, is_quiet
from lineage.spec.model import Lineage

if TYPE_CHECKING:
    from platform_assets.engine.runner import Engine
    from resources.core.settings import Settings

log = logging.getLogger(__name__)

THREADS_ENV = "TIDEMARK_FOLLOW_THREADS"
EVENTS = "events"  # the event intake's batch processor, as a work
MAX_BACKOFF_S = 60.0


@dataclass
class Work:
    """A topic or a replicator the follower keeps: what makes it due, and its state."""

    name: str  # the topic, ``cdc:<replicator>``, or ``events`` (the intake's batch processor)
    reads: frozenset[str] = frozenset()  # tables whose change makes it due
    delay_s: float = 0.0
    replicator: Any = None  # a lineage Replicator for ``cdc:`` work
    running: bool = False
    again: bool = True  # look at once: its last unit did work (or none ran yet)
    due: float = 0.0  # monotonic time of its next look (0: only when something changes)
    failures: int = 0
    mark: Any = None  # a replicator: its source's position when its last unit started; events: the ready files
    said: str = ""  # the last wait or failure reported


@dataclass
class Event:
    """What the follower reports: a unit done (``result``), a wait, or a failure (``error``)."""

    work: str
    result: Any = None
    error: BaseException | None = None
    wait: str = ""
    at: float = field(default_factory=time.time)


def threads_setting(works: int) -> int:
    """Threads running units at once (``$TIDEMARK_FOLLOW_THREADS``; default: one per work, up to 4)."""
    from resources.core.settings import whole_number_setting

    return whole_number_setting(THREADS_ENV, max(1, min(4, works)), "threads")


class Follower:
    """Runs every unit of ``lineage`` (or of the topics and replicators ``names``) as it becomes due,
    until :meth:`run`'s ``stop`` is set."""

    def __init__(self, settings: Settings, lineage: Lineage, *, names: list[str] | None = None,
                 interval_s: float = 0.5, full_every_s: float = 30.0, recheck_s: float = 1.0,
                 report: Callable[[Event], None] | None = None, spark: Any = None, intake: Any = None) -> None:
        self.settings, self.lineage = settings, lineage
        self.intake = intake  # a lineage.intake Intake with batch destinations: the ``events`` work
        self.left_out: dict[str, str] = {}  # replicators not followed (their source is not configured), why
        self.interval_s, self.full_every_s, self.recheck_s = interval_s, full_every_s, recheck_s
        self.report = report or (lambda e: None)
        self.works = self._works(names)
        self.threads = threads_setting(len(self.works))
        from platform_assets.cdc.positions import every_setting

        self._positions_every = every_setting()  # a bad setting fails before anything runs
        from platform_assets.follow.checkpoints import SourceCheckpoints
        from platform_assets.follow.checkpoints import every_setting as checkpoint_every

        reads = {t for w in self.works.values() for t in w.reads}
        # Where each table read lives (a source may have a path of its own), as Engine.path says.
        self._paths = {t: settings.table_path(t, src.spec.path if (src := lineage.sources.get(t)) else None)
                       for t in reads}
        self.checkpoints = SourceCheckpoints({t: self._paths[t] for t in set(lineage.sources) & reads},
                                             checkpoint_every())
        self._spark = spark
        self._main: Engine | None = None
        self._engines: list[Engine] = []
        self._local = threading.local()
        self._lock = threading.RLock()
        self._sessions: queue.SimpleQueue[Any] = queue.SimpleQueue()  # one per thread (:meth:`_engine`)
        self._sessions_made = False
        self._versions: dict[str, int | None] = {}
        self._sources: dict[str, Any] = {}  # replicator -> its source for the cheap look (and its units)
        self.units = 0
        self.last_unit = time.monotonic()

    def _works(self, names: list[str] | None) -> dict[str, Work]:
        out: dict[str, Work] = {}
        for topic in self.lineage.topics.values():
            if names and topic.name not in names:
                continue
            spec = topic.spec
            reads = frozenset([*spec.depends_on, spec.destination])
            out[topic.name] = Work(topic.name, reads, spec.delay.total_seconds() if spec.delay else 0.0)
        from platform_assets.cdc.run import unconfigured

        for rep in self.lineage.replicators.values():
            key = f"cdc:{rep.name}"
            if names and key not in names and rep.name not in names:
                continue
            missing = None if names else unconfigured(rep)
            if missing:  # following everything: a source not set up here is left out, said once
                self.left_out[key] = missing
                continue
            out[key] = Work(key, replicator=rep)
        if self.intake is not None and (not names or EVENTS in names):
            out[EVENTS] = Work(EVENTS)
        unknown = [n for n in names or [] if n not in out and f"cdc:{n}" not in out]
        if unknown:
            raise TidemarkError(f"follow: unknown topic or replicator {', '.join(unknown)} (topics: "
                                f"{', '.join(self.lineage.topics) or 'none'}; replicators: "
                                f"{', '.join(self.lineage.replicators) or 'none'}"
                                f"{'; and events, the intake' if self.intake is not None else ''})")
        if not out:
            raise TidemarkError("follow: the lineage has no topics and no cdc: replicators to follow")
        return out

    # ------------------------------------------------------------------ engines and Spark
    def _engine(self) -> Engine:
        """This thread's engine (its own offset store connection and lock owner) on a session of its own
        on the one Spark (:func:`sibling_sessions`: its own SQL settings and temporary views, so a unit's
        Delta txn settings and its ``block`` never leak into another thread's unit)."""
        eng = getattr(self._local, "engine", None)
        if eng is None:
            from platform_assets.engine.runner import Engine

            self.spark  # noqa: B018 - the sessions are made with it
            eng = Engine(self.settings, self.lineage, spark=self._sessions.get_nowait())
            self._local.engine = eng
            with self._lock:
                self._engines.append(eng)
        return eng

    @property
    def spark(self) -> Any:
        """The one Spark session (started on first use), with a sibling session for each thread."""
        with self._lock:
            if self._spark is None:
                from platform_assets.engine.runner import Engine

                self._main = Engine(self.settings, self.lineage)
                self._spark = self._main.spark
            if not self._sessions_made:
                from resources.spark.session import sibling_sessions

                for session in sibling_sessions(self._spark, self.settings, self.threads):
                    self._sessions.put(session)
                self._sessions_made = True
        return self._spark

    def close(self) -> None:
        """Close every engine and source. A JVM already gone (a SIGTERM sent to the whole process
        group reaches Spark's JVM too) is said once, not raised: the units it cut short are redone
        from the offset store and the Delta log by the next start."""
        gone = False
        for eng in [*self._engines, *([self._main] if self._main is not None else [])]:
            try:
                eng.close()
            except Exception as exc:  # noqa: BLE001 - closing what may already be broken
                gone = True
                log.debug("follow: closing an engine: %s", first_line(exc))
        if gone:
            log.warning("follow: Spark's JVM was gone before the follower closed it (a signal sent to the whole "
                        "process group?); any unit it cut short is finished by the next start")
        self.checkpoints.close()
        self._main = None
        self._engines.clear()
        for src in self._sources.values():
            try:
                src.close()
            except Exception:  # noqa: BLE001 - closing what may already be broken
                pass
        self._sources.clear()

    # ------------------------------------------------------------------ the loop
    def run(self, stop: threading.Event, *, until_idle_s: float | None = None, max_seconds: float | None = None) -> int:
        """Follow until ``stop`` is set (or, ``until_idle_s``: nothing ran for that long and nothing is
        due; ``max_seconds``: that long). Returns the number of units that did work."""
        started = last_full = time.monotonic()
        self.spark  # noqa: B018 - the session first: a follower holds one from the start
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tidemark-follow")
        running: dict[str, Future[Any]] = {}
        try:
            while not stop.is_set():
                now = time.monotonic()
                full = now - last_full >= self.full_every_s
                if full:
                    last_full = now
                for name in self._due(now, full):
                    w = self.works[name]
                    w.running = True
                    running[name] = pool.submit(self._run_one, w)
                for name, fut in list(running.items()):
                    if fut.done():
                        del running[name]
                if max_seconds is not None and now - started >= max_seconds:
                    break
                if (until_idle_s is not None and not running and now - self.last_unit >= until_idle_s
                        and not any(w.again for w in self.works.values())):
                    break
                stop.wait(self.interval_s)
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
        return self.units

    def _due(self, now: float, full: bool) -> list[str]:
        """The works to look at now (see the module docstring)."""
        changed = self._changed_tables()
        out = []
        for w in self.works.values():
            if w.running:
                continue
            if w.name == EVENTS:
                if w.again or full or (w.due and w.due <= now) or self._ready_files() != w.mark:
                    out.append(w.name)
                continue
            if w.replicator is not None:
                moved = self._source_moved(w)
                if w.again or moved or full or (w.due and w.due <= now):
                    out.append(w.name)
                continue
            hit = bool(w.reads & changed)
            if hit and w.delay_s > 0:  # its rows become old enough one second after the delay
                w.due = min(w.due or float("inf"), now + w.delay_s + 1.0)
            if w.again or hit or full or (w.due and w.due <= now):
                out.append(w.name)
        return out

    def _changed_tables(self) -> set[str]:
        from resources.storage.delta_log import newest_version

        versions: dict[str, int | None] = {}
        for table, path in self._paths.items():
            try:
                versions[table] = newest_version(path, self._versions.get(table))
            except Exception:  # noqa: BLE001 - a table being created or unreadable now: looked at next time
                continue
        changed = changed_tables(self._versions, versions)
        self._versions.update(versions)
        self.checkpoints.saw({t: versions[t] for t in changed})
        return changed

    def _source(self, w: Work) -> Any:
        src = self._sources.get(w.name)
        if src is None:
            from platform_assets.cdc.run import open_source

            src = self._sources[w.name] = open_source(w.replicator)
        return src

    def _source_moved(self, w: Work) -> bool:
        """Whether the replicator's source moved since its last unit started (JVM-free: the server's
        WAL position, or the end of the Debezium files)."""
        try:
            mark = self._mark(self._source(w))
        except Exception as exc:  # noqa: BLE001 - a source that is down: its unit says so, with backoff
            self._sources.pop(w.name, None)
            log.debug("follow: %s: cannot read the source: %s", w.name, first_line(exc))
            return w.due <= time.monotonic() if w.due else True
        return w.mark is None or mark != w.mark

    @staticmethod
    def _mark(src: Any) -> int:
        if hasattr(src, "position"):
            return int(src.position().current)
        return int(src.position_end())

    # ------------------------------------------------------------------ one unit
    def _run_one(self, w: Work) -> None:
        try:
            from resources.spark.session import job_group, make_active

            spark = self._engine().spark
            make_active(spark)  # (what Spark Connect returns binds to the thread's active session)
            with job_group(spark, f"tidemark:{w.name}"):
                if w.replicator is not None:
                    event = self._replicator_unit(w)
                elif w.name == EVENTS:
                    event = self._intake_unit(w)
                else:
                    event = Event(w.name, result=self._engine().run_topic(w.name))
            self._done(w, event)
        except TopicLockedError as exc:  # another follower or run holds it: it runs it
            self._done(w, Event(w.name, wait=f"held elsewhere: {first_line(exc)}"))
        except Exception as exc:  # noqa: BLE001 - this topic backs off, the others go on
            self._done(w, Event(w.name, error=exc))
        finally:
            w.running = False

    def _replicator_unit(self, w: Work) -> Event:
        from platform_assets.cdc.replicator import ReplicatorUnit

        src = self._source(w)
        try:
            w.mark = self._mark(src)
        except Exception as exc:  # noqa: BLE001 - e.g. no slot yet: the unit sets its source up (ensure_setup)
            log.debug("follow: %s: no position before the unit: %s", w.name, first_line(exc))
            w.mark = None  # (looked at again at once after the unit)
        try:
            result = ReplicatorUnit(self._engine(), w.replicator, src, positions_every_s=self._positions_every).run_once()
        except Exception:
            self._sources.pop(w.name, None)  # a broken connection is opened anew
            try:
                src.close()
            except Exception:  # noqa: BLE001
                pass
            raise
        if not (result.processed or result.redone):
            return Event(w.name, wait=result.reason + (f"; paused: {', '.join(result.paused)}" if result.paused else ""))
        return Event(w.name, result=result)

    def _ready_files(self) -> tuple[str, ...]:
        from resources.intake.incoming_log import iter_ready_files

        return tuple(sorted(f.path.name for f in iter_ready_files(self.settings.events_dir())))

    def _intake_unit(self, w: Work) -> Event:
        from platform_assets.intake.units import process_ready

        w.mark = self._ready_files()
        if not w.mark:
            return Event(w.name, wait="no ready event files")
        return Event(w.name, result=IntakeUnits(process_ready(self.settings, self.intake)))

    def _done(self, w: Work, event: Event) -> None:
        now = time.monotonic()
        if event.error is not None:
            w.failures += 1
            w.again = False
            w.due = now + min(MAX_BACKOFF_S, 2.0 ** w.failures)
            event.wait = f"failed ({w.failures} in a row; retried in {w.due - now:.0f} s)"
            self.report(event)
            return
        w.failures = 0
        processed = event.result is not None and (getattr(event.result, "processed", False)
                                                  or getattr(event.result, "redone", False))
        if processed:
            w.again, w.due = True, 0.0
            with self._lock:
                self.units += 1
                self.last_unit = now
            self.report(event)
            return
        w.again = False
        reason = event.wait or getattr(event.result, "reason", "")
        quiet = w.replicator is not None or w.name == EVENTS or is_quiet(reason)
        w.due = 0.0 if quiet else now + self.recheck_s
        if reason != w.said:
            w.said = reason
            self.report(Event(w.name, wait=reason))


@dataclass
class IntakeUnits:
    """What one look of the ``events`` work did: the intake's units (one per group of ready files)."""

    results: list[Any]

    @property
    def processed(self) -> bool:
        return bool(self.results)

    @property
    def reason(self) -> str:
        if not self.results:
            return "no ready event files left (another processor took them?)"
        return (f"{len(self.results)} unit(s), {sum(r.files for r in self.results)} file(s): "
                f"{sum(r.events_in for r in self.results)} events in, {sum(r.written for r in self.results)} rows "
                f"written, {sum(r.failed for r in self.results)} failed")


def batch_intake() -> Any:
    """The intake config (set, or present at its default path) when it has batch destinations: the
    follower's ``events`` work; else None."""
    from lineage.intake.config import configured_intake
    from lineage.intake.destinations import DestinationMode

    intake = configured_intake()
    if intake is None or not any(d.mode is DestinationMode.BATCH for d in intake.spec.destinations):
        return None
    return intake
