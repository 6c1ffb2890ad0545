"""The step compiler's switch: the trace or replay that owns allocations now, or None.

NOTE [ Step compiler hooks ]
``taifuse.compile`` (taifuse/compiler.py) records a step at the calls that compute on arrays: the
backend's kernels and its tensor math, which it wraps for the length of one trace, and nothing
else. The one place it needs inside the package is ``BufferPool.acquire``, which reads
:data:`ACTIVE` once per call: while a trace runs, the trace is told of every buffer (its shape,
dtype and when it was made, for the lifetimes the replay's plan is built from); while a replay
runs, the replay hands out the buffers it planned ahead, in the recorded order, instead of the
pool. Its ``acquire`` returns None for a request that is not the step's (another thread's, a
host segment's, or the trace's own call to the pool): the pool then serves it. When it is None (no compiled step running) the pool runs as it would without a compiler:
one global read and comparison. This module imports nothing, so that the pool may read it.
"""

from __future__ import annotations

from typing import Any

ACTIVE: Any = None  # the running trace or replay (taifuse/compiler.py), or None
