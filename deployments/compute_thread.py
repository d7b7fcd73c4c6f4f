"""The one thread of a worker process that touches its model: loading, and every forward of every call.

OpenMP (torch's parallel regions, and our CPU kernels') keeps a team of threads for each thread that starts parallel
work. Once a process has more of those threads than it has cores, the runtime stops letting any of them spin while
waiting between regions (they sleep, and pay a wake-up at each of the hundreds of regions a forward has): forwards
issued from a pool of RPC threads, each with a team of its own, leave cores idle that a single thread keeps busy. A
worker therefore loads its model here and runs every call here; the RPC threads only hand work over and wait.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    """Runs callables one at a time, in the order handed over, on a thread of its own (a daemon: it dies with the
    process). A call from that thread itself runs at once (a call that makes another)."""

    def __init__(self, name: str = "specdec-compute") -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the compute thread; its result, or its exception raised here."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        future: Future = Future()
        self._work.put((future, fn, args))
        return future.result()

    def _loop(self) -> None:
        while True:
            future, fn, args = self._work.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller, whatever it is
                    future.set_exception(exc)
