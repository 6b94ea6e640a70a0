"""One error hierarchy for Tidemark: one type per kind of failure, each message says what,
where and how to fix it."""

from __future__ import annotations


class TidemarkError(Exception):
    """Base class of every error Tidemark raises on purpose."""


class LineageError(TidemarkError):
    """The lineage configuration is invalid. Raised before anything runs.

    ``problems`` holds every problem found (the validator reports all of them at once),
    each already formatted as ``file: topic 'x': field 'y': what is wrong``.
    """

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = "invalid lineage" if len(self.problems) == 1 else f"invalid lineage ({len(self.problems)} problems)"
        super().__init__(head + ":\n  - " + "\n  - ".join(self.problems))


class ConfigError(TidemarkError):
    """A setting (environment variable, CLI flag, URL) is invalid."""


class OffsetError(TidemarkError):
    """The offset store refused an update (compare-and-set lost, or it would move backwards)."""


class TopicLockedError(OffsetError):
    """Another run holds the topic's lock (the seed's MUTEX exception)."""

    def __init__(self, topic: str, holder: str, since: str | None = None, lease_until: str | None = None) -> None:
        self.topic = topic
        self.holder = holder
        self.lease_until = lease_until
        when = f" since {since}" if since else ""
        if lease_until:
            fix = (f"Its lease expires at {lease_until} UTC; if that run is dead the lock is taken over then, "
                   f"or clear it now with: tidemark offsets unlock {topic}")
        else:
            fix = f"If that run is dead, clear the lock with: tidemark offsets unlock {topic}"
        super().__init__(f"topic '{topic}' is being processed by '{holder}'{when}; one run per topic at a time. {fix}")


class UnknownTopicError(TidemarkError):
    """A command named a topic the lineage or the offset store does not know."""


class ProcessingError(TidemarkError):
    """A block could not be processed (a transform or a before/after statement failed)."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when the message is empty."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
