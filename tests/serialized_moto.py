"""moto's S3 server, bound to 127.0.0.1, handling one request at a time (started by tests/s3_servers.py).

Why: moto decides a conditional PutObject by checking the condition and then writing, with no lock between
the two (moto/s3/responses.py `put_object`), so two concurrent `If-None-Match: *` creates of one key can both
succeed (2 of 300 races between 24 writers did). Real S3 and the Versity gateway decide each conditional
write atomically, and SneppX's commit markers and rendezvous records rely on that. One lock around moto's
request handling gives moto the same atomicity, so the tests that race writers run on both servers and mean
the same on both. It costs little: moto is one Python process, whose requests hardly ran in parallel anyway.
Connections are still accepted concurrently (a threaded server); only the handling of a request, its
response body included, holds the lock.

    python tests/serialized_moto.py --port PORT
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple

HOST = "127.0.0.1"  # tests send traffic to loopback only; moto's own default is configurable, this is not

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def one_at_a_time(app: WsgiApp) -> WsgiApp:
    """`app` behind a lock held until its response body is complete (moto may produce the body lazily)."""
    lock = threading.Lock()

    def handle(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with lock:
            response = app(environ, start_response)
            try:
                return [b"".join(response)]
            finally:
                close = getattr(response, "close", None)
                if close is not None:
                    close()

    return handle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    os.environ.setdefault("MOTO_PORT", str(port))  # moto builds some URLs from it, as its own main() sets it
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(HOST, port, one_at_a_time(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
