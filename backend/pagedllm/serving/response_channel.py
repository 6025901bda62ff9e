"""One request's response sender, safe to use from any thread: the final response closes it, and from then on
nothing is sent through it and nothing is asked of it.

That rule is not a nicety. In Triton 24.10 the backend frees a request's response factory when its final
response goes out, and `is_cancelled()` afterwards reads the freed memory inside tritonserver (a segfault that
takes the whole server down); `send()` afterwards raises. Every use goes through here, so no code path (an
engine that died, a cancellation sweep, finalize) can touch a finished request's sender. Calls into the sender
are made under the adapter's `ipc_lock` (see triton_model.py). No Triton import: the adapter hands in the
sender and Triton's FINAL flag, so this is unit-testable.
"""

from __future__ import annotations

import contextlib
import logging
import threading

logger = logging.getLogger(__name__)


class ResponseChannel:
    def __init__(self, sender, final_flag: int, ipc_lock=None) -> None:
        self._sender = sender
        self._final_flag = final_flag
        self._ipc = ipc_lock if ipc_lock is not None else contextlib.nullcontext()
        self._lock = threading.Lock()
        self.closed = False
        self.refused = 0  # uses after the final response, refused (a bug upstream if ever non-zero)

    def send(self, response, final: bool = False) -> bool:
        """Send a response (the last one if `final`); False, and nothing sent, once the channel is closed."""
        with self._lock:
            if self.closed:
                self.refused += 1
                logger.error("a response after the final one was dropped (a bug: please report it)")
                return False
            if final:
                self.closed = True
            # Under the lock: a final response can never overtake one sent before it from another thread.
            with self._ipc:
                self._sender.send(response, flags=self._final_flag if final else 0)
            return True

    def is_cancelled(self) -> bool:
        """Whether the client cancelled; False once closed (the sender must not be asked any more)."""
        with self._lock:
            if self.closed:
                return False
            with self._ipc:
                return bool(self._sender.is_cancelled())
