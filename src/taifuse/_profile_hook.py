"""The profiler's switch: the recorder that is active, or None.

NOTE [ Profiler hooks ]
Every op a user can time passes one of a few places: ``Function.apply`` (the forward of every
autograd op and Tensor method), the backward loop in ``taifuse._engine`` (every node's backward),
the array path's op wrapper at the end of ``taifuse._array_ops`` (ops on NumPy arrays),
``Optimizer.step``'s fused update call, ``BufferPool.acquire`` and ``nn.Module.__call__``. Each of
them reads :data:`ACTIVE` once; when it is None (no profiler running) the op runs as it would
without a profiler, so the disabled cost is that one global read and comparison per call (the
``profiler`` bench suite measures it against a build of the step with the checks bypassed). When
it is set, the place hands the call to the recorder (``taifuse.profiler``), which times it and
writes an event. This module imports nothing, so that every layer may read the switch; the
recorder lives in the user-API layer and is only reached through this variable.
"""

from __future__ import annotations

from typing import Any

ACTIVE: Any = None  # the running taifuse.profiler recorder, or None
