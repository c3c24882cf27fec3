"""asyncio.TaskGroup on every supported Python (the `taskgroup` backport below 3.11)."""

import sys

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup
else:  # pragma: no cover
    from taskgroup import TaskGroup

__all__ = ["TaskGroup"]
