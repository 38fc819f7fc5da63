"""Authenticated TCP channels between the main process and its nodes (see docs/security.md).

The command channel of a node and the weight channel of the distributed weight-sync scheme are both
made here. Opening one is the handshake of :mod:`.handshake`: the listener proves first (the main
process signs with the learner's identity on the command port), then the connecting peer proves it
holds the key of the id it names (:mod:`.keys`). Nothing is decoded before both proofs were
checked, and each side keeps to a short ``handshake_timeout``. Every message after that carries an
HMAC-SHA256 tag of its sequence number and bytes under a per-direction session key that also
depends on an X25519 secret of this channel alone. A peer who relays a handshake (a squatted port),
even one holding the same key, therefore cannot inject, replay or reorder a single message: its
bytes fail the tag and the channel closes.

The first message a listener receives (the peer's *hello*) is decoded as a tuple of plain values
(:mod:`.wire`), never unpickled; later messages from the connecting side (nodes) are in wire format
2 (:mod:`.wire`, never pickles), at most :func:`~.wire.node_limit` bytes each, and a channel may be
told which messages it carries (:meth:`Channel.expect`). The listener's side (the main process)
sends pickles: a node runs what the main process tells it anyway.

Sockets are tuned so that a peer that vanished (host unreachable) makes a blocked send or receive
fail within ``user_timeout`` seconds instead of the kernel's ~15 minutes.
"""

from __future__ import annotations

import hmac
import logging
import math
import multiprocessing.connection as mpc
import os
import pickle
import select
import socket
import threading
import time
from typing import Any, Callable, NoReturn

from .handshake import AuthenticationFailed, Keys, NotProven, connector_side, listener_side
from .keys import (AUTHKEY_ENV, LearnerIdentity, NodeCredential, as_credential, derive_key, new_authkey,
                   parse_authkey, slot_key)
from .ports import PortInUseError, not_this_host
from .wire import (HELLO_MAX, NodeMessageError, decode_from_node, decode_hello, encode_from_node, encode_hello,
                   node_limit)

__all__ = ["AUTHKEY_ENV", "new_authkey", "parse_authkey", "derive_key", "slot_key", "AuthenticationFailed",
           "RefusedMessage", "Channel", "Keys", "authenticate", "listen", "accept_channel", "open_channel",
           "shutdown_connection"]

logger = logging.getLogger("rlharvest")
_TAG = 32


class RefusedMessage(ConnectionError):
    """A node sent a message the main process does not take (malformed, too long, of another wire
    format, a class not allowed, or not one the channel carries): the channel is closed, as if the
    node had gone."""


def _describe(message: Any) -> str:
    """What a message is, in a few words (never its whole text: it may be large)."""
    if type(message) is tuple and message and type(message[0]) is str:
        return f"a tuple starting with {message[0][:40]!r}"
    return f"a {type(message).__name__}"


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


class Channel:
    """An authenticated, ordered message channel (the handshake made it; see the module docstring).

    Offers the subset of ``multiprocessing.connection.Connection`` the transports use: ``send``,
    ``recv``, ``send_bytes``, ``recv_bytes``, ``poll``, ``fileno`` and ``close``.
    """

    def __init__(self, conn: mpc.Connection, send_key: bytes, recv_key: bytes, *, key_id: int = 0,
                 loads: Callable[[bytes], Any] = pickle.loads, dumps: Callable[[Any], bytes] = _pickle,
                 max_message: Callable[[], int] | None = None, exporter: bytes | None = None) -> None:
        self._conn = conn
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = self._recv_seq = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        #: which key the connecting peer proved it holds (0: the join key; a rank: that slot's)
        self.key_id = key_id
        #: a secret of this channel alone (both ends hold it, nobody else): wraps a key sent over it
        self.exporter = exporter
        self._loads, self._dumps, self._max_message = loads, dumps, max_message
        self._expected: tuple[Callable[[Any], bool], str] | None = None

    def expect(self, check: Callable[[Any], bool], what: str) -> None:
        """Take only messages for which ``check`` is true (``what`` says which, in the refusal)."""
        self._expected = (check, what)

    def send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            tag = hmac.new(self._send_key, self._send_seq.to_bytes(8, "big"), "sha256")
            tag.update(data)
            self._conn.send_bytes(tag.digest() + data)
            self._send_seq += 1

    def recv_bytes(self, max_length: int | None = None) -> bytes:
        """The next message's bytes, authenticated; from a node, at most :func:`~.wire.node_limit` bytes
        (and ``max_length``), refused before they are read.

        Raises:
            AuthenticationFailed: for a message that fails its tag; RefusedMessage: for one too long.
        """
        with self._recv_lock:
            limits = [n for n in (max_length, None if self._max_message is None else self._max_message())
                      if n is not None]
            limit = min(limits) if limits else None
            try:
                frame = self._conn.recv_bytes(None if limit is None else limit + _TAG)
            except OSError as err:
                if limit is None or str(err) != "bad message length":
                    raise
                self._refuse(f"a message longer than {limit} bytes"
                             + ("" if limit == max_length else " (rlharvest.transport.wire.limit_from_nodes)"))
            tag = hmac.new(self._recv_key, self._recv_seq.to_bytes(8, "big"), "sha256")
            tag.update(memoryview(frame)[_TAG:])
            if len(frame) < _TAG or not hmac.compare_digest(frame[:_TAG], tag.digest()):
                self.close()
                raise AuthenticationFailed("a message failed authentication (injected or corrupted): channel closed")
            self._recv_seq += 1
            return frame[_TAG:]

    def send(self, obj: Any) -> None:
        """Send ``obj`` (a pickle from the listener's side, wire format 2 from the connecting side).

        Raises:
            UnsendableValue: (a TypeError, from a node) for what wire format 2 cannot hold; nothing was sent.
        """
        self.send_bytes(self._dumps(obj))

    def recv(self) -> Any:
        """The next message: authenticated bytes only (``recv_bytes`` checked the tag), and from a
        node, decoded from wire format 2 (:mod:`.wire`) and one the channel expects.

        Raises:
            RefusedMessage: (an OSError) for a message it does not take; the channel is closed.
        """
        data = self.recv_bytes()
        try:
            message = self._loads(data)
        except NodeMessageError as err:
            self._refuse(str(err))
        if self._expected is not None and not self._expected[0](message):
            self._refuse(f"a message that is not {self._expected[1]} ({_describe(message)})")
        return message

    def _refuse(self, why: str) -> NoReturn:
        self.close()
        logger.warning("rlharvest: closed the channel of a peer whose message is refused: %s", why)
        raise RefusedMessage(why)

    def send_hello(self, hello: tuple) -> None:
        """The first message to a listener: plain values only (it never unpickles a hello)."""
        self.send_bytes(encode_hello(hello))

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message (or the end of the connection) is there to read, waiting up to
        ``timeout`` seconds (None: until there is). One ``poll(2)`` on the socket: the parent polls
        every node's channel at every reply, and ``Connection.poll`` builds a selector each time."""
        fd = self._conn.fileno()  # OSError once closed, as Connection.poll
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if timeout is None:
            return bool(poller.poll())
        return bool(poller.poll(math.ceil(timeout * 1e3) if timeout > 0 else 0))

    def fileno(self) -> int:
        return self._conn.fileno()

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def close(self) -> None:
        self._conn.close()


# ---------------------------------------------------------------------------------------------- sockets
def _tune_socket(sock: socket.socket, user_timeout: float) -> None:
    """Fail blocked sends/receives after ``user_timeout`` s of silence instead of ~15 minutes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(user_timeout / 3)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(user_timeout * 1000))


class _Watchdog:
    """Bounds a handshake: after ``seconds`` (or at :meth:`fire`) the socket is shut down, which wakes
    any blocked read or write (a per-read timeout would let a peer dripping one byte at a time go on
    forever)."""

    def __init__(self, conn: mpc.Connection, seconds: float) -> None:
        self.conn, self.seconds, self._done = conn, seconds, False
        #: why the handshake was cut short (None while it was not)
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._timer = self._start(seconds)

    @property
    def expired(self) -> bool:
        return self.reason is not None

    def _start(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.fire, args=(f"no complete handshake within {seconds:g} s",))
        timer.daemon = True
        timer.start()
        return timer

    def fire(self, reason: str) -> None:
        """Cut the handshake short now (unless it ended): its socket is shut down."""
        with self._lock:
            if not self._done and self.reason is None:
                self.reason = reason
                shutdown_connection(self.conn)

    def restart(self, seconds: float) -> None:
        """A new deadline, ``seconds`` from now (unless it was cut short already)."""
        with self._lock:
            if self.reason is not None:
                return
            self._timer.cancel()
            self.seconds, self._timer = seconds, self._start(seconds)

    def stop(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()


def _connection(sock: socket.socket, user_timeout: float) -> mpc.Connection:
    _tune_socket(sock, user_timeout)
    sock.settimeout(None)
    return mpc.Connection(sock.detach())


def authenticate(conn: mpc.Connection, authkey: Keys, timeout: float, *, listener: bool, hello: bool = False,
                 key_id: int = 0, identity: LearnerIdentity | None = None, learner: bytes | None = None,
                 hello_timeout: float | None = None,
                 watchdog: _Watchdog | None = None) -> tuple[Channel, Any]:
    """Run one side of the handshake of :mod:`.handshake` within ``timeout`` seconds (and, on the
    listener's side with ``hello``, receive the peer's hello within ``hello_timeout`` more, decoded
    as plain values). Returns ``(channel, hello or None)``.

    ``authkey``: for a connecting peer, the key it proves it holds (``key_id`` its id; ``learner``:
    the learner's public key, whose signature the listener must show); for a listener, the keys it
    takes (bytes: the key of id 0; or a function of the id), ``identity`` the learner's signing key
    it proves with (else an HMAC).
    ``watchdog``: the one bounding this handshake, if the caller made it (to cut it short itself).

    Raises:
        NotProven: (connecting side) the listener closed the connection before its proof.
        AuthenticationFailed: wrong key, garbage, silence or a closed connection; ``conn`` is closed.
    """
    watchdog = watchdog or _Watchdog(conn, timeout)
    try:
        if listener:
            session = listener_side(conn, authkey, identity)
            channel = Channel(conn, session.send_key, session.recv_key, key_id=session.key_id,
                              exporter=session.exporter, loads=decode_from_node, max_message=node_limit)
        else:
            session = connector_side(conn, authkey, key_id, learner)
            channel = Channel(conn, session.send_key, session.recv_key, key_id=session.key_id,
                              exporter=session.exporter, dumps=encode_from_node)
        if hello:  # the peer proved it holds the key
            watchdog.restart(hello_timeout if hello_timeout is not None else timeout)
            first = decode_hello(channel.recv_bytes(HELLO_MAX))
        else:
            first = None
    except Exception as err:
        watchdog.stop()
        conn.close()
        if watchdog.reason is not None:
            raise AuthenticationFailed(watchdog.reason) from err
        if isinstance(err, AuthenticationFailed):
            raise
        if isinstance(err, (EOFError, ConnectionResetError)):
            raise AuthenticationFailed("the peer closed the connection during the handshake") from err
        raise AuthenticationFailed(f"malformed handshake ({type(err).__name__}: {err})") from err
    watchdog.stop()
    return channel, first


def listen(host: str, port: int, attempts: int = 10) -> socket.socket:
    """A listening socket on ``port``, or on one of the next ``attempts`` ports if it is taken."""
    for candidate in range(port, min(port + attempts, 65536)):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
        except OSError as err:
            sock.close()
            if (not_here := not_this_host(err, host)) is not None:  # no other port would do either
                raise not_here from None
            continue
        sock.listen(64)
        return sock
    raise PortInUseError(f"ports {port}..{port + attempts - 1} are all in use.")


def accept_channel(server: socket.socket, authkey: Keys, timeout: float, user_timeout: float,
                   handshake_timeout: float = 5.0) -> Channel | None:
    """Accept one connection and authenticate it (None when nobody connected within ``timeout``).

    Raises:
        AuthenticationFailed: the peer failed the handshake.
    """
    server.settimeout(timeout)
    try:
        sock, _ = server.accept()
    except socket.timeout:
        return None
    return authenticate(_connection(sock, user_timeout), authkey, handshake_timeout, listener=True)[0]


def open_channel(host: str, port: int, authkey: bytes | NodeCredential, timeout: float, user_timeout: float,
                 handshake_timeout: float = 5.0, key_id: int = 0,
                 on_retry: Callable[[BaseException], None] | None = None) -> Channel:
    """Connect to a :class:`~.listener.ChannelListener` (retrying until ``timeout``) and authenticate
    with ``authkey``: a node's credential (its key, its id, and the learner's public key, whose
    signature the listener must show; or its encoded bytes), or a key of id ``key_id`` (the listener then proves with an
    HMAC under it: the weight and relay ports); ``on_retry(error)`` is called before each retry.

    Raises:
        AuthenticationFailed: the listener did not prove itself; it is refused before anything it
            sent was unpickled, and before this side sent anything that depends on its key.
    """
    credential = as_credential(authkey)  # also a node key's bytes (a key file's hex, decoded)
    if credential is not None:
        key, key_id, learner = credential.key, credential.key_id, credential.learner
    else:
        key, learner = authkey, None
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            return authenticate(_connection(sock, user_timeout), key, handshake_timeout, listener=False,
                                key_id=key_id, learner=learner)[0]
        except NotProven as err:  # this handshake was evicted for a newer one: nothing keyed was sent
            if time.monotonic() > deadline:
                raise AuthenticationFailed(f"refused the listener at {host}:{port}: {err}") from err
        except AuthenticationFailed as err:
            raise AuthenticationFailed(f"refused the listener at {host}:{port}: {err}") from err
        except OSError as err:
            if time.monotonic() > deadline:
                raise
            if on_retry is not None:
                on_retry(err)
        time.sleep(0.1)


def shutdown_connection(conn) -> None:
    """Shut a channel's socket down both ways, which wakes a recv() blocked in another thread."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed or never connected
        pass
