"""The monitor's HTTP server: the page, ``/api/stats`` and ``/metrics`` of one collector, served from a
daemon thread of the learner's process (docs/monitoring.md).

Read-only: it answers GET (and HEAD) only and calls nothing on the collector but its ``stats()``
snapshot and its event log. Bound to loopback by default; bound beyond, every request needs the
token (``?token=`` or ``Authorization: Bearer``), and on loopback without a token a request must name
a loopback host, so that a web page the user visits cannot read the monitor through DNS rebinding.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from ..collectors.base import BaseCollector
from .reading import FleetReader, plain

__all__ = ["Monitor"]

logger = logging.getLogger("rlharvest.monitor")

#: what the page's files are served as
_STATIC = {"monitor.js": "text/javascript; charset=utf-8", "monitor.css": "text/css; charset=utf-8"}
#: events sent to the page at most per request (the ring keeps 1,024)
_EVENTS_PER_REQUEST = 500
_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


def _load_prometheus() -> Any:
    try:
        import prometheus_client  # noqa: F401  (before our module that uses it, which may be loaded)

        from . import metrics
    except ImportError as err:
        if (err.name or "").split(".")[0] != "prometheus_client":
            raise
        raise ImportError("rlharvest.monitor needs prometheus-client: pip install 'rlharvest[monitor]' (or "
                          "prometheus-client)") from err
    return metrics


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _this_host() -> str | None:
    """This host's name, when it resolves (what a link shared with others should name)."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return None
    return name


def _check(host: Any, port: Any, token: Any) -> None:
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be an address to bind (e.g. '127.0.0.1', '0.0.0.0'), got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in 0..65535 (0: one the OS chooses), got {port!r}")
    if token is not None and (not isinstance(token, str) or not token or not token.isprintable()
                              or any(char.isspace() for char in token)):
        raise ValueError(f"token must be None (one is generated when bound beyond loopback) or a non-empty printable "
                         f"string without spaces, got {token!r}")


class _Server(ThreadingHTTPServer):
    """One thread per connection; the connections still open are cut by :meth:`close_connections`
    (a browser keeps its connection alive between polls)."""

    daemon_threads = True
    # a port some other process holds must fail the bind, not be shared
    allow_reuse_address = False

    def __init__(self, address: tuple[str, int], monitor: "Monitor") -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.monitor = monitor
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._connections_lock:
                self._connections.discard(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client gone mid-request (or cut by close()) is no error of the monitor's
        logger.debug("rlharvest monitor: the connection from %s ended", client_address, exc_info=True)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass


class Monitor:
    """A live view of a collector: a page, ``/api/stats`` (JSON) and ``/metrics`` (Prometheus), served
    from a background thread of this process until :meth:`close` (docs/monitoring.md).

    Args:
        collector: any rlharvest collector; it may be iterated, run free, or not started yet.
        host: the address to bind: loopback by default; any other needs a token.
        port: the port (0: one the OS chooses; see :attr:`url`).
        token: required by every request (``?token=...`` or ``Authorization: Bearer ...``); None
            generates one when ``host`` is not loopback.

    Raises:
        ImportError: without prometheus-client (``pip install 'rlharvest[monitor]'``).
        ValueError: for a bad ``host``, ``port`` or ``token``.
        TypeError: when ``collector`` is not an rlharvest collector.
        OSError: when the address cannot be bound.

    Example:
        >>> import urllib.request
        >>> from rlharvest.collectors import MultiSyncCollector
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiSyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=32)
        >>> with Monitor(collector) as monitor:
        ...     _ = [batch for batch in collector]
        ...     text = urllib.request.urlopen(monitor.url + "metrics").read().decode()
        >>> "rlharvest_frames_total 32.0" in text
        True
        >>> collector.shutdown()
    """

    def __init__(self, collector: BaseCollector, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        metrics = _load_prometheus()
        from prometheus_client import CollectorRegistry

        _check(host, port, token)
        self.reader = FleetReader(collector)
        self.loopback = _is_loopback(host)
        self.token = token if token is not None or self.loopback else secrets.token_urlsafe(24)
        #: this monitor's Prometheus registry (the collector's metrics only)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(metrics.FleetMetrics(self.reader))
        self._server = _Server((host, port), self)
        self.host, self.port = host, self._server.server_address[1]
        url_host = host
        if host in ("0.0.0.0", "::"):  # every interface: this host's name, if it resolves
            url_host = _this_host() or ("127.0.0.1" if host == "0.0.0.0" else "::1")
        self._url_host = f"[{url_host}]" if ":" in url_host else url_host
        self._closed = False
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="rlharvest-monitor", daemon=True)
        self._thread.start()
        logger.info("rlharvest: monitoring %s at %s", self.reader.name, self.url)

    @property
    def url(self) -> str:
        """The page's address (with ``?token=...`` when a token is required)."""
        return f"http://{self._url_host}:{self.port}/" + (f"?token={quote(self.token)}" if self.token else "")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving: close the port and the connections still open (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()  # a page's kept-alive connection is answered no more
        self._thread.join(timeout)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Monitor({self.reader.name}, url={self.url!r}{', closed' if self._closed else ''})"

    # ------------------------------------------------------------------ what requests read
    def allows(self, query: dict[str, list[str]], authorization: str | None) -> bool:
        """Whether a request carries the token (always, without one)."""
        if self.token is None:
            return True
        given = query.get("token", [""])[-1]
        if authorization and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        return hmac.compare_digest(given.encode(), self.token.encode())

    def stats_json(self, since: int) -> bytes:
        """``/api/stats``: ``stats()``, the workers' rows, the events after ``since``, and the weight
        updates' latency histogram."""
        reading = self.reader.read()
        histogram = reading.snapshot.weight_syncs
        events = self.reader.events_since(since)[-_EVENTS_PER_REQUEST:]
        body = {
            "collector": reading.collector, "time": reading.time, "closed": reading.closed,
            "stats": reading.stats, "workers": [row.as_dict() for row in reading.workers],
            "policy_version": reading.policy_version, "learner_wait_s": reading.learner_wait_s,
            "events": [event.as_dict() for event in events], "last_seq": reading.last_seq,
            "event_counts": {kind.value: count for kind, count in reading.event_counts.items()},
            "weight_syncs": None if histogram is None else {
                "bounds": histogram.bounds, "cumulative": histogram.cumulative, "count": histogram.count,
                "sum_s": histogram.sum_s},
        }
        return json.dumps(plain(body), separators=(",", ":")).encode()


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "rlharvest-monitor"
    #: seconds a connection may stay idle (or a client take to send its request) before it is closed
    timeout = 30.0

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        logger.debug("%s - %s", self.address_string(), format % args)

    def do_GET(self) -> None:  # noqa: N802 (the base class's name)
        self._answer(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(head=True)

    def _refuse_write(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"the monitor is read-only: GET only\n", "text/plain",
                   {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_write  # noqa: N815

    def _answer(self, head: bool) -> None:
        monitor = self.server.monitor
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if monitor.token is None and not self._host_is_loopback():
            return self._send(HTTPStatus.FORBIDDEN, b"a loopback monitor answers requests for a loopback host only\n",
                              "text/plain", head=head)
        if not monitor.allows(query, self.headers.get("Authorization")):
            return self._send(HTTPStatus.UNAUTHORIZED, b"this monitor needs its token: ?token=... or "
                              b"'Authorization: Bearer ...'\n", "text/plain", {"WWW-Authenticate": "Bearer"}, head)
        try:
            status, body, kind = self._route(url.path, query, monitor)
        except Exception:  # a failed read is the client's 500, never the monitor thread's end
            logger.exception("rlharvest monitor: %s failed", url.path)
            status, body, kind = HTTPStatus.INTERNAL_SERVER_ERROR, b"the monitor failed to read the collector\n", \
                "text/plain"
        self._send(status, body, kind, head=head)

    def _route(self, path: str, query: dict[str, list[str]], monitor: Monitor) -> tuple[HTTPStatus, bytes, str]:
        if path == "/metrics":
            from prometheus_client.exposition import choose_encoder

            encoder, kind = choose_encoder(self.headers.get("Accept", ""))
            return HTTPStatus.OK, encoder(monitor.registry), kind
        if path == "/api/stats":
            since = query.get("since", ["0"])[-1]
            return HTTPStatus.OK, monitor.stats_json(int(since) if since.isdigit() else 0), "application/json"
        if path in ("/", "/index.html"):
            suffix = f"?token={quote(monitor.token)}" if monitor.token else ""
            page = _static("index.html").replace(b"{{query}}", suffix.encode())
            return HTTPStatus.OK, page, "text/html; charset=utf-8"
        name = path[len("/static/"):] if path.startswith("/static/") else None
        if name in _STATIC:
            return HTTPStatus.OK, _static(name), _STATIC[name]
        return HTTPStatus.NOT_FOUND, b"not found: the monitor serves /, /api/stats and /metrics\n", "text/plain"

    def _host_is_loopback(self) -> bool:
        host = (self.headers.get("Host") or "").strip()
        if host.startswith("["):
            host = host[1:host.find("]")]
        elif host.count(":") == 1:
            host = host.rsplit(":", 1)[0]
        return _is_loopback(host)

    def _send(self, status: HTTPStatus, body: bytes, kind: str, headers: dict[str, str] | None = None,
              head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in {**_HEADERS, **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)
