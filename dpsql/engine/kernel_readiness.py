"""Whether this process's compiled kernels are loaded (dpsql.engine.columnar.warm_up).

numba compiles a kernel on its first call, or loads it from its on-disk cache: ~2 minutes of
CPU in a fresh install, ~1 s once cached. A query must not wait for that, so until
:func:`columnar.warm_up <dpsql.engine.columnar.warm_up>` has finished (on its own thread, at
connect) the compiled passes are not chosen: the column programs run in numpy and a program
numpy cannot run (bias measures, the clamp histogram's pass) runs its SQL. Every path returns
the same integers for the same secret (tests/test_clustered.py, tests/test_clamp_pass.py).

The choice reads this flag only, never data: like a store being ready, it is a fact of the
process's age (docs/threat_model.md), and the answer does not depend on it.
"""

from __future__ import annotations

import threading

_loaded = threading.Event()


def ready() -> bool:
    """Whether the kernels were compiled or loaded in this process."""
    return _loaded.is_set()


def mark_ready() -> None:
    _loaded.set()


def forget() -> None:
    """For tests: act as a process whose kernels are not loaded yet."""
    _loaded.clear()
