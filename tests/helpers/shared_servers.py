"""One engine server for a whole test session, shared by every test file that wants the same engine.

An engine server costs 20-60 s to start on the 2-core CI machine, and several files wanted the same
one (the same model and flags): the BF16 tiny-Llama vLLM server of tests/test_bridge_vllm.py and
tests/test_bridge_openai_vllm.py, the SGLang server on the tiny FourSight checkpoint of
tests/sglang/test_server.py, test_bridge_stream.py and test_atomic_updates.py. Their session-scoped
fixtures (tests/conftest.py, tests/sglang/conftest.py) hold a :class:`SharedServer`: started at its
first use, stopped at the end of the session.

Rules for the tests that share one:

* a test that changes what it serves (a weight update) puts the first policy back before it ends,
  so the next file sees the server as it started;
* a test that stops it on purpose (the dead-engine tests) does not break a later one:
  :meth:`SharedServer.running` starts a fresh server when the last one has exited.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class SharedServer(Generic[T]):
    """A server made by ``start(n)`` (``n``: 1 for the first start, 2 after a test stopped it, ...),
    alive while ``alive(server)``, ended by ``stop(server)``."""

    def __init__(self, start: Callable[[int], T], alive: Callable[[T], bool], stop: Callable[[T], None]):
        self._start, self._alive, self._stop = start, alive, stop
        self._server: T | None = None
        self.starts = 0

    def running(self) -> T:
        """The server, started now if it was not yet or if it has exited since."""
        if self._server is not None and not self._alive(self._server):
            self._stop(self._server)  # reap what is left of it (its process group)
            self._server = None
        if self._server is None:
            self.starts += 1
            self._server = self._start(self.starts)
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._stop(self._server)
            self._server = None
