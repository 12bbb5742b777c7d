"""A fault-injecting proxy between one operator process and the test's kube-apiserver.

High-availability tests run two operator processes, each through its own proxy, and need to:
  * see every request an operator sent (method, path, query, time, body) -- `requests`, `writes()`;
  * kill an operator at the moment it is about to send its N-th write, the write held and never
    forwarded, so the process dies between two API calls -- `kill_before_write()`;
  * cut an operator off from the API server on every connection, old and new, and later let it back
    in with the held connections closed, so nothing queued is delivered late -- `partition()`, `heal()`;
  * stop and restart forwarding, delivering what was held -- `pause()`, `resume()`.

The operator side is plain HTTP on 127.0.0.1 with no credentials (`kubeconfig`): both kopf (aiohttp,
logged in through kubernetes.config.load_kube_config) and the kubernetes client (urllib3) accept an
http:// server, so the proxy can read the requests without terminating TLS for them. The proxy opens
one TLS connection upstream per operator connection, with a client certificate from the session CA for
the identity the test gives it: CN=system:serviceaccount:NS:NAME is held to exactly the RBAC of that
ServiceAccount. ALPN offers http/1.1 only, so the apiserver never switches to HTTP/2.

Requests (client -> server) are parsed as far as needed: request line, headers, a Content-Length or
chunked body; each is read whole (bounded) before any of it is forwarded, so a held request sends the
API server nothing. Responses (server -> client) are piped back raw as they come (watch streams too).
Keep-alive connections carry many requests in sequence; an Upgrade request (exec, port-forward) turns
its connection into a raw pipe both ways once forwarded. One asyncio loop in a daemon thread serves all
of a proxy's connections (TLS objects are never shared between threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import os
import pathlib
import signal
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

import yaml

if TYPE_CHECKING:
    from k8s_cluster import Cluster

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_BODY = 16 * 1024 * 1024  # the apiserver refuses bodies over 3 MiB anyway
CHUNK = 64 * 1024  # one read; also the bound on a request head and on each stream's buffer (~2 chunks)
MAX_CONNECTIONS = 128  # more at once are refused (closed at once) and counted in `refused`
MAX_LOG = 100_000  # requests kept (the oldest go first)
MAX_ERRORS = 100
CONNECT_TIMEOUT_S = 30.0
KILL_TIMEOUT_S = 10.0  # how long SIGKILLed process may take to become a zombie
CALL_TIMEOUT_S = 30.0  # how long the test thread waits for the proxy's loop to do what it asked


@dataclasses.dataclass
class Request:
    """One HTTP request from the operator, as the proxy saw it.

    outcome: "pending" (read, waiting at a pause or partition), "forwarded" (handed to the upstream
    connection), "held" (a kill rule held it; never forwarded) or "dropped" (its connection was closed
    before it could be forwarded: heal, kill, shutdown). `time` is time.monotonic() when it was read
    whole; `body` is kept for write verbs only (the decoded body; `body_size` is its length).
    """

    seq: int
    conn: int
    method: str
    path: str
    query: str
    time: float
    body_size: int
    body: bytes
    outcome: str = "pending"

    @property
    def is_write(self) -> bool:
        return self.method in WRITE_METHODS

    @property
    def params(self) -> dict[str, str]:
        """The query as a dict (the last value of a repeated key)."""
        return dict(urllib.parse.parse_qsl(self.query, keep_blank_values=True))

    @property
    def is_watch(self) -> bool:
        return self.params.get("watch") in ("true", "1")


@dataclasses.dataclass(eq=False)
class KillRule:
    """From kill_before_write(): `fired` is set once the request was held, the target killed (a pid or
    Popen: SIGKILLed and seen dead) and the proxy's connections closed; `request` is the held request."""

    n: int
    target: Any
    match: Callable[[Request], bool] | None
    seen: int = 0
    request: Request | None = None
    error: BaseException | None = None
    fired: threading.Event = dataclasses.field(default_factory=threading.Event)

    def wait(self, timeout: float = 60.0) -> Request:
        """Wait until the rule fired; return the held request (re-raises a failure to kill)."""
        if not self.fired.wait(timeout):
            raise AssertionError(f"write #{self.n} to hold did not come within {timeout}s ({self.seen} seen)")
        if self.error is not None:
            raise self.error
        assert self.request is not None
        return self.request


class _BadRequest(Exception):
    """The client sent something this proxy does not parse; its connection is closed."""


class _Conn:
    """One client connection and its upstream connection."""

    def __init__(self, ident: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.id = ident
        self.client_reader, self.client_writer = reader, writer
        self.upstream_reader: asyncio.StreamReader | None = None
        self.upstream_writer: asyncio.StreamWriter | None = None
        self.down: asyncio.Task[Any] | None = None  # the server -> client pipe, once connected upstream
        self.closed = False

    def _writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client_writer, self.upstream_writer) if w is not None]

    def abort(self) -> None:
        """Close both sides now, discarding whatever is buffered (nothing held is delivered)."""
        self.closed = True
        for writer in self._writers():
            writer.transport.abort()

    def close(self) -> None:
        """Close both sides after flushing what was already forwarded (an ordinary end)."""
        self.closed = True
        for writer in self._writers():
            writer.close()


class ApiProxy:
    """A proxy for one operator process; see the module docstring. Use as a context manager:

        with ApiProxy(cluster, "system:serviceaccount:sneppx-system:sneppx-operator") as proxy:
            env = dict(os.environ, KUBECONFIG=str(proxy.kubeconfig))
            env.pop("KUBERNETES_SERVICE_HOST", None)  # kopf and the client try in-cluster config first
            operator = subprocess.Popen([sys.executable, "-m", "sneppx_operator", "--namespace", ns], env=env)
            rule = proxy.kill_before_write(3, operator, match=lambda r: "/elastictrainingjobs" in r.path)
            ...
            rule.wait()  # the operator is dead; its 3rd job write never reached the API server

    `identity` is the client certificate's CN (the user name RBAC sees; 64 bytes at most), `groups` its O
    fields. Files (client cert, kubeconfig) go to `workdir`, by default a new folder in cluster.workdir.
    """

    def __init__(
        self,
        cluster: Cluster,
        identity: str,
        groups: tuple[str, ...] = (),
        *,
        workdir: pathlib.Path | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        upstream = urllib.parse.urlsplit(cluster.server)
        if upstream.scheme != "https" or not ipaddress.ip_address(upstream.hostname or "").is_loopback:
            raise ValueError(f"the proxy only talks to an https loopback API server, not {cluster.server}")
        if not 0 < len(identity.encode()) <= 64:
            raise ValueError(f"a certificate's CN holds 1 to 64 bytes, not {identity!r}")
        self.identity, self.groups = identity, tuple(groups)
        self.max_connections = max_connections
        self._upstream = (upstream.hostname, upstream.port or 443)
        self.workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix="api-proxy-", dir=cluster.workdir))
        self.workdir.mkdir(parents=True, exist_ok=True)
        pair = cluster.ca.issue(identity, organizations=self.groups)
        cert, key = self.workdir / "client.crt", self.workdir / "client.key"
        for path, data in ((cert, pair.cert_pem), (key, pair.key_pem)):
            path.write_bytes(data)
            path.chmod(0o600)
        self._tls = ssl.create_default_context(cadata=cluster.ca.cert_pem.decode())
        self._tls.load_cert_chain(str(cert), str(key))
        self._tls.set_alpn_protocols(["http/1.1"])
        self.kubeconfig = self.workdir / "kubeconfig"
        self.url = ""  # http://127.0.0.1:PORT once started

        self._lock = threading.Condition()  # guards the log and rules; notified when either changes
        self._log: deque[Request] = deque(maxlen=MAX_LOG)
        self._seq = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._rules: list[KillRule] = []
        self.errors: list[str] = []  # unexpected failures inside the proxy (tests assert it stays empty)
        self.refused = 0  # connections closed at once because max_connections were open

        # Loop-thread state.
        self._state = "flowing"  # or "paused" / "partitioned"
        self._killing = 0  # kills in progress: nothing flows meanwhile
        self._cut: set[_Conn] = set()  # connections open at any time during the partition
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()  # connection handlers (cancelled at shutdown)
        self._fires: set[asyncio.Task[Any]] = set()  # kills in progress (awaited at shutdown)
        self._held_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._cond: asyncio.Condition | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> Self:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="api-proxy", daemon=True)
        self._thread.start()
        port = self._call(self._start_server())
        self.url = f"http://127.0.0.1:{port}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "api-proxy", "cluster": {"server": self.url}}],
            "users": [{"name": "api-proxy", "user": {}}],  # the proxy authenticates upstream
            "contexts": [{"name": "api-proxy", "context": {"cluster": "api-proxy", "user": "api-proxy"}}],
            "current-context": "api-proxy",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        return self

    def close(self) -> None:
        """Stop listening, drop every connection, stop the loop thread."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(CALL_TIMEOUT_S + KILL_TIMEOUT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            assert self._thread is not None
            self._thread.join(CALL_TIMEOUT_S)
            if not self._thread.is_alive():
                loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what the operator sent -------------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        """A snapshot of every request seen so far, in the order they were read."""
        with self._lock:
            return [dataclasses.replace(r) for r in self._log]

    def writes(self, match: Callable[[Request], bool] | None = None) -> list[Request]:
        """The POST/PUT/PATCH/DELETE requests seen so far (those `match` accepts, if given)."""
        return [r for r in self.requests if r.is_write and (match is None or match(r))]

    def wait_for_request(self, match: Callable[[Request], bool], timeout: float = 60.0) -> Request:
        """The first logged request (snapshot) that `match` accepts, waiting for one up to `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                found = next((r for r in self._log if match(r)), None)
                if found is not None:
                    return dataclasses.replace(found)
                left = deadline - time.monotonic()
                if left <= 0:
                    last = list(self._log)[-5:]
                    raise AssertionError(f"no matching request within {timeout}s; the last ones: {last}")
                self._lock.wait(left)

    @property
    def open_connections(self) -> int:
        return self._call(self._count_connections())

    @property
    def held_bytes(self) -> int:
        """Response bytes read from the API server and not passed on yet (waiting at a pause or partition)."""
        return self._held_bytes

    # ---- faults -----------------------------------------------------------------------------------------

    def kill_before_write(
        self, n: int, target: Any, match: Callable[[Request], bool] | None = None
    ) -> KillRule:
        """Hold the n-th write (counted from now) that `match` accepts (every write, if None): never
        forward it; kill `target` (a pid or Popen: SIGKILL, then wait until it is dead; a callable: called
        with the request); then close all of this proxy's connections. While that happens nothing flows on
        any connection, so no other request of the dying process slips through. The rule fires once."""
        if n < 1:
            raise ValueError("n counts from 1")
        rule = KillRule(n, target, match)
        with self._lock:
            self._rules.append(rule)
        return rule

    def partition(self) -> None:
        """Stop forwarding in both directions on every connection, open now or opened later (those are
        accepted, then hang). Requests read meanwhile stay "pending"."""
        self._call(self._set_state("partitioned"))

    def heal(self) -> None:
        """End a partition: close every connection that was open during it, discarding what was held
        (the pending requests become "dropped"), then forward again for new connections."""
        self._call(self._set_state("flowing", heal=True))

    def pause(self) -> None:
        """Stop forwarding in both directions (like partition), keeping what arrives."""
        self._call(self._set_state("paused"))

    def resume(self) -> None:
        """Forward again after pause(), delivering what was held in order."""
        self._call(self._set_state("flowing"))

    # ---- the loop thread --------------------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        if self._loop is None:
            coro.close()
            raise RuntimeError("the proxy is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    async def _start_server(self) -> int:
        self._cond = asyncio.Condition()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=CHUNK)
        return int(self._server.sockets[0].getsockname()[1])

    async def _count_connections(self) -> int:
        return len(self._conns)

    async def _shutdown(self) -> None:
        assert self._server is not None and self._cond is not None
        self._server.close()
        for conn in list(self._conns):
            conn.abort()
        async with self._cond:
            self._cond.notify_all()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._fires, return_exceptions=True)
        await self._server.wait_closed()

    async def _set_state(self, state: str, heal: bool = False) -> None:
        assert self._cond is not None
        if heal != (self._state == "partitioned"):
            what = "heal()" if heal else {"flowing": "resume()", "paused": "pause()"}.get(state, "partition")
            raise RuntimeError(f"{what} while {self._state} (only heal() ends a partition)")
        if state == "partitioned":
            self._cut = set(self._conns)
        for conn in self._cut if heal else ():
            conn.abort()
        if heal:
            self._cut = set()
        self._state = state
        async with self._cond:
            self._cond.notify_all()

    def _flowing(self) -> bool:
        return self._state == "flowing" and not self._killing

    async def _gate(self, conn: _Conn) -> bool:
        """Wait until forwarding is on; False if the connection was closed meanwhile. When it returns True
        without waiting it did not yield, so the caller's next synchronous steps happen in that state."""
        if not conn.closed and not self._flowing():
            assert self._cond is not None
            async with self._cond:
                await self._cond.wait_for(lambda: conn.closed or self._flowing())
        return not conn.closed

    def _error(self, conn: _Conn, exc: BaseException) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(f"connection {conn.id}: {exc!r}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection, from accept to close (the task asyncio.start_server runs for it)."""
        if len(self._conns) >= self.max_connections:
            self.refused += 1
            writer.transport.abort()
            return
        conn = _Conn(next(self._conn_ids), reader, writer)
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(conn)
        self._tasks.add(task)
        if self._state == "partitioned":
            self._cut.add(conn)
        try:
            failure = await self._pipe_up(conn)
        except asyncio.CancelledError:  # shutdown; ending normally keeps asyncio's stream callback quiet
            failure = None
        except Exception as exc:  # noqa: BLE001  (a proxy bug: reported to the test)
            failure = exc
        finally:
            if not conn.closed:
                conn.close()
            if conn.down is not None:
                conn.down.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.down
            self._conns.discard(conn)
            self._cut.discard(conn)
            self._tasks.discard(task)
        if failure is not None:
            self._error(conn, failure)

    async def _connect(self, conn: _Conn) -> bool:
        """Open the upstream TLS connection and start piping responses back; False if that failed."""
        try:
            conn.upstream_reader, conn.upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(
                    *self._upstream, ssl=self._tls, server_hostname=self._upstream[0], limit=CHUNK
                ),
                CONNECT_TIMEOUT_S,
            )
        except (TimeoutError, OSError) as exc:
            self._error(conn, exc)
            return False
        if conn.closed:  # aborted while connecting, before there was an upstream side to abort
            conn.abort()
            return False
        conn.down = asyncio.create_task(self._pipe_down(conn))
        return True

    async def _pipe_up(self, conn: _Conn) -> BaseException | None:
        """Client -> server: read each request whole, log it, pass the gate and the kill rules, forward it.
        The upstream connection opens when the first request may go (none is opened while nothing flows)."""
        try:
            while True:
                parsed = await _read_request(conn.client_reader)
                if parsed is None:
                    return None
                raw, request, upgrade = parsed
                request.conn = conn.id
                self._record(request)
                if conn.upstream_writer is None and not (await self._gate(conn) and await self._connect(conn)):
                    self._set_outcome(request, "dropped")
                    return None
                if not await self._gate(conn):
                    self._set_outcome(request, "dropped")
                    return None
                # From the gate to the write nothing yields: a kill, partition or pause comes before or after.
                rule = self._match_rule(request)
                if rule is not None:
                    self._set_outcome(request, "held")
                    fire = asyncio.ensure_future(self._fire(rule, request))
                    self._fires.add(fire)
                    fire.add_done_callback(self._fires.discard)
                    await asyncio.shield(fire)  # the kill completes even if this connection ends
                    return None
                assert conn.upstream_writer is not None
                conn.upstream_writer.write(raw)
                self._set_outcome(request, "forwarded")
                await conn.upstream_writer.drain()
                if upgrade:
                    await self._pipe_raw(conn)
                    return None
        except (_BadRequest, asyncio.LimitOverrunError) as exc:
            return exc  # something this proxy does not parse: reported in `errors`
        except (ConnectionError, asyncio.IncompleteReadError):
            return None  # a side went away

    async def _pipe_down(self, conn: _Conn) -> BaseException | None:
        """Server -> client, raw: each chunk as it comes, held at the gate while forwarding is off."""
        assert conn.upstream_reader is not None
        try:
            while data := await conn.upstream_reader.read(CHUNK):
                self._held_bytes += len(data)
                try:
                    if not await self._gate(conn):
                        return None
                finally:
                    self._held_bytes -= len(data)
                conn.client_writer.write(data)
                await conn.client_writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            if not conn.closed:
                conn.close()  # the server ended it (Connection: close, a finished watch): flush, then close
        return None

    async def _pipe_raw(self, conn: _Conn) -> None:
        """Client -> server after an Upgrade: raw bytes, still subject to the gate."""
        assert conn.upstream_writer is not None
        while data := await conn.client_reader.read(CHUNK):
            if not await self._gate(conn):
                return
            conn.upstream_writer.write(data)
            await conn.upstream_writer.drain()

    # ---- log and kill rules -----------------------------------------------------------------------------

    def _record(self, request: Request) -> None:
        with self._lock:
            request.seq = next(self._seq)
            self._log.append(request)
            self._lock.notify_all()

    def _set_outcome(self, request: Request, outcome: str) -> None:
        with self._lock:
            request.outcome = outcome
            self._lock.notify_all()

    def _match_rule(self, request: Request) -> KillRule | None:
        if not request.is_write:
            return None
        with self._lock:
            fire = None
            for rule in self._rules:
                if rule.match is None or rule.match(request):
                    rule.seen += 1
                    if rule.seen == rule.n and fire is None:
                        fire = rule
            if fire is not None:
                self._rules.remove(fire)
                self._killing += 1  # nothing flows from here until the kill is done
            return fire

    async def _fire(self, rule: KillRule, request: Request) -> None:
        assert self._loop is not None and self._cond is not None
        try:
            await self._loop.run_in_executor(None, _kill, rule.target, dataclasses.replace(request))
        except BaseException as exc:  # noqa: BLE001  (handed to the test through rule.wait())
            rule.error = exc
        finally:
            for conn in list(self._conns):  # the dead process's connections, the held request's too
                conn.abort()
            self._killing -= 1
            async with self._cond:
                self._cond.notify_all()
            rule.request = dataclasses.replace(request)
            rule.fired.set()


def _kill(target: Any, request: Request) -> None:
    """SIGKILL a pid or Popen and wait until the process is dead (a zombie or reaped); or call `target`."""
    pid = getattr(target, "pid", target)
    if not isinstance(pid, int):
        target(request)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while not _dead(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} still alive {KILL_TIMEOUT_S}s after SIGKILL")
        time.sleep(0.005)


def _dead(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


# ---- HTTP/1.1 requests ------------------------------------------------------------------------------------


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, Request, bool] | None:
    """One whole request: (its raw bytes, to forward unchanged; the parsed Request; whether it asks for a
    protocol upgrade). None on a clean EOF between requests. The head is bounded by the reader's limit
    (CHUNK), the body by MAX_BODY."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise _BadRequest("connection closed inside a request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise _BadRequest(f"request head over {CHUNK} bytes") from None
    lines = head.lstrip(b"\r\n").split(b"\r\n")
    try:
        method, target, version = lines[0].decode("latin-1").split(" ")
    except ValueError:
        raise _BadRequest(f"bad request line {lines[0][:200]!r}") from None
    if not version.startswith("HTTP/1."):
        raise _BadRequest(f"not HTTP/1.x: {version!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise _BadRequest(f"bad header line {line[:200]!r}")
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    if "expect" in headers:  # the client would wait for a 100 Continue before the body this proxy waits for
        raise _BadRequest(f"Expect: {headers['expect']} is not supported")
    parts = [head]
    body = bytearray()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            parts.append(size_line)
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise _BadRequest(f"bad chunk size {size_line[:100]!r}") from None
            if size == 0:
                break
            if len(body) + size > MAX_BODY:
                raise _BadRequest(f"chunked body over {MAX_BODY} bytes")
            chunk = await reader.readexactly(size + 2)
            parts.append(chunk)
            body += chunk[:-2]
        while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
            parts.append(trailer)
        parts.append(trailer)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise _BadRequest(f"bad Content-Length {headers['content-length']!r}") from None
        if not 0 <= length <= MAX_BODY:
            raise _BadRequest(f"Content-Length {length} out of bounds")
        body += await reader.readexactly(length)
        parts.append(bytes(body))
    split = urllib.parse.urlsplit(target)
    request = Request(
        seq=0,
        conn=0,
        method=method,
        path=split.path,
        query=split.query,
        time=time.monotonic(),
        body_size=len(body),
        body=bytes(body) if method in WRITE_METHODS else b"",
    )
    upgrade = "upgrade" in headers.get("connection", "").lower()
    return b"".join(parts), request, upgrade

