"""SIGTERM ends the agent (and the launcher) wherever its main thread is, inside a record store call too.

The signal's handler raises in the main thread; a store call that catches `Exception` to name its errors
(records/kube.py) turned it into a RecordUnavailableError, which the rendezvous poll retries, and the handler had
set SIGTERM to SIG_IGN: the pod trained on until its grace period's SIGKILL. It made tests/k8s's resize test see
the old pod's agent end 0 (it had trained on to the end) instead of 143. Here a real ConfigMap call goes to an
HTTP server on 127.0.0.1 that holds it unanswered, and a real SIGTERM comes while it waits.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest

from SneppX_ALG.elastic import agent, trainer
from SneppX_ALG.records import kube

CONFIG_MAP = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "job", "namespace": "ns",
                                                                    "resourceVersion": "1"}, "data": {}}


class HoldingServer:
    """Answers GET with an empty ConfigMap, except the method it holds: that request is read and never answered."""

    def __init__(self, hold: str) -> None:
        self.hold = hold
        self.held = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn.makefile("rb") as stream:
            while True:
                head = [line for line in iter(stream.readline, b"\r\n") if line]
                if not head:
                    return
                length = next((int(h.split(b":")[1]) for h in head if h.lower().startswith(b"content-length")), 0)
                stream.read(length)
                if head[0].split()[0].decode() == self.hold:
                    self.held.set()
                    return  # unanswered: the caller waits in its read
                body = json.dumps(CONFIG_MAP).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))

    def close(self) -> None:
        self.listener.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def sigterm_restored() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


HANDLERS = {"agent": (agent._terminate, agent.Terminated), "launcher": (trainer._raise_terminated, trainer._Terminated)}
CALLS: dict[str, Callable[[kube.KubernetesRecordStore], Any]] = {
    "GET": lambda store: store.read("run/x/finished"),  # every poll of the rendezvous and the control record
    "PATCH": lambda store: store.create("run/x/finished", {"reason": "completed"}),  # a write, after its read
}


@pytest.mark.parametrize("hold", sorted(CALLS))
@pytest.mark.parametrize("who", sorted(HANDLERS))
def test_sigterm_during_a_record_store_call_ends_the_process_not_the_call(
    who: str, hold: str, sigterm_restored: None,
) -> None:
    handler, terminated = HANDLERS[who]
    server = HoldingServer(hold)
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{server.port}"
    store = kube.KubernetesRecordStore("ns", "job", api_client=kubernetes.client.ApiClient(config))
    signal.signal(signal.SIGTERM, handler)

    def terminate_once_held() -> None:
        if server.held.wait(30):
            # to the main thread, waiting in the held call (a process-directed kill may land on this thread)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)

    sender = threading.Thread(target=terminate_once_held, daemon=True)
    sender.start()
    try:
        with pytest.raises(terminated):
            CALLS[hold](store)
    finally:
        sender.join(30)
        server.close()
    assert server.held.is_set()
