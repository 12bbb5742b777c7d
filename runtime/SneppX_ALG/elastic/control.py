"""The channel between a node agent and each of its worker processes: JSON lines over a Unix socket pair.

Why a socket pair and JSON: the worker inherits one end (its fd number is in SNEPPX_CONTROL_FD), so no port is
opened and nothing else can connect; JSON keeps every message a plain value (no pickle on any path). The agent
learns at once when a worker dies (end of file), and the worker when its agent does, so a worker never outlives
its node.

Agent -> worker: `assign` (a generation: ranks, world size, addresses), `join_pending` (agents wait to join: stop
at the next checkpoint boundary), `abort` (the generation is over: end its collectives now), `pause` and `resume`
(operator mode: the job is paused; `ctx.report` waits), `exit`.
Worker -> agent: `beat` (every BEAT_INTERVAL, from a thread: a worker that stops beating is stopped or wedged),
`progress` (a step finished), `saved` (a checkpoint step was handed to the coordinator), `restored`, `done` (train_fn returned everywhere), `boundary` (stopped at a
checkpoint boundary to let agents join), `failed` (the generation broke: a collective error), `idle` (ready for
the next `assign`), `fatal` (an error retrying can't fix, e.g. a rollback past the limit).
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

MAX_MESSAGE_BYTES = 1 << 20
BEAT_INTERVAL = 0.1


class ChannelClosed(Exception):
    """The other end is gone (its process exited or was killed)."""


class Channel:
    """One end of the socket pair. send() is safe from several threads; receive() from one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buffer = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, kind: str, **fields: Any) -> None:
        data = json.dumps({"kind": kind, **fields}, allow_nan=False).encode() + b"\n"
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as e:
                raise ChannelClosed(str(e)) from None

    def receive(self, timeout: float | None) -> list[dict[str, Any]]:
        """The messages that arrive within `timeout` (None: wait for at least one); [] if none did."""
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(1 << 16)
        except (TimeoutError, BlockingIOError):
            return []
        except OSError as e:
            raise ChannelClosed(str(e)) from None
        if not chunk:
            raise ChannelClosed("end of file")
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > MAX_MESSAGE_BYTES:
            raise ChannelClosed("a message longer than the limit: not a SneppX worker")
        messages = []
        for line in lines:
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser recurses
                raise ChannelClosed("a line that is not JSON: not a SneppX worker") from None
            if isinstance(message, dict) and isinstance(message.get("kind"), str):
                messages.append(message)
        return messages

    def close(self) -> None:
        self.sock.close()
