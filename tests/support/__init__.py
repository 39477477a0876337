"""What the tests of every tier share: waiting on a condition (``until``, ``until_async``)."""

from tests.support.waiting import until, until_async

__all__ = ["until", "until_async"]
