"""Authenticated TCP channels between the main process and its nodes (see docs/security.md).

The command channel of a node and the weight channel of the distributed weight-sync scheme are both
made here. Opening one is a mutual challenge over a key both ends got out of band (or derived from
one: :func:`derive_key`):

1. the listener sends a random nonce; 2. the connecting peer answers with its own nonce, the *id* of
the key it holds (0: the collector's key; a node's rank: that node's slot key, :func:`slot_key`) and
an HMAC of all three under that key; 3. only if that is right does the listener send its own HMAC,
which the peer checks. Nothing is decoded before both proofs were checked, and each side keeps to a
short ``handshake_timeout``. Every message after that carries an HMAC-SHA256 tag of its sequence
number and bytes under a per-direction session key derived from the key, its id and both nonces. A
stranger who relays a handshake it cannot complete itself (a squatted port) therefore cannot
inject, replay or reorder a single message: its bytes fail the tag and the channel closes.

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
from typing import Any, Callable, NoReturn, Union

from .ports import PortInUseError, not_this_host
from .wire import (HELLO_MAX, NodeMessageError, decode_from_node, decode_hello, encode_from_node, encode_hello,
                   node_limit)

__all__ = ["AUTHKEY_ENV", "new_authkey", "parse_authkey", "derive_key", "slot_key", "AuthenticationFailed",
           "RefusedMessage", "Channel", "Keys", "authenticate", "listen", "accept_channel", "open_channel",
           "shutdown_connection"]

logger = logging.getLogger("rlharvest")

#: environment variable holding the collector's key (hex) for nodes started by hand
AUTHKEY_ENV = "RLHARVEST_AUTHKEY"
_MIN_KEY_BYTES = 16
_MAGIC = b"rlharvest-channel-2\0"
_NONCE = 32
_TAG = 32
_KEY_ID = 8
#: the keys a listener accepts: ``key id -> key``, or None for an id it does not know
Keys = Union[bytes, Callable[[int], Union[bytes, None]]]


class AuthenticationFailed(ConnectionError):
    """A peer did not complete the handshake (wrong key, garbage, silence) or sent a forged message."""


class RefusedMessage(ConnectionError):
    """A node sent a message the main process does not take (malformed, too long, of another wire
    format, a class not allowed, or not one the channel carries): the channel is closed, as if the
    node had gone."""


class _NoGreeting(AuthenticationFailed):
    """The listener closed the connection before greeting (it was busy, or is not a listener)."""


def new_authkey() -> bytes:
    """A fresh random key (32 bytes)."""
    return os.urandom(32)


def parse_authkey(value: bytes | str, name: str = "authkey") -> bytes:
    """``value`` as key bytes: bytes, or their hex; at least 16 bytes.

    Raises:
        ValueError: naming ``name`` for anything shorter or not hex.
        TypeError: naming ``name`` for other types.
    """
    if isinstance(value, str):
        try:
            value = bytes.fromhex(value.strip())
        except ValueError:
            raise ValueError(f"{name} must be hex digits (e.g. from `python -c 'import secrets; "
                             f"print(secrets.token_hex(32))'`), got a string that is not hex.") from None
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{name} must be bytes or a hex string, got {type(value).__name__}")
    if len(value) < _MIN_KEY_BYTES:
        raise ValueError(f"{name} must hold at least {_MIN_KEY_BYTES} bytes ({2 * _MIN_KEY_BYTES} hex digits), "
                         f"got {len(value)}.")
    return bytes(value)


def derive_key(key: bytes, label: str, *parts: bytes) -> bytes:
    """A key for one purpose (``label``), derived from ``key`` and ``parts`` (e.g. a salt that
    travels): HMAC-SHA256. Whoever holds ``key`` can derive it; from it, nobody can learn ``key``."""
    return hmac.digest(key, b"rlharvest-" + label.encode() + b"\0" + b"\0".join(parts), "sha256")


def slot_key(authkey: bytes, rank: int) -> bytes:
    """The key of the node of rank ``rank`` (of every generation of it), derived from the collector's key:
    nodes the collector starts itself get only theirs (docs/security.md, "The key")."""
    return derive_key(authkey, "slot", rank.to_bytes(8, "big"))


def _describe(message: Any) -> str:
    """What a message is, in a few words (never its whole text: it may be large)."""
    if type(message) is tuple and message and type(message[0]) is str:
        return f"a tuple starting with {message[0][:40]!r}"
    return f"a {type(message).__name__}"


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, label + b"\0" + b"".join(parts), "sha256")


def _key_for(keys: Keys, key_id: int) -> bytes | None:
    if isinstance(keys, (bytes, bytearray)):
        return bytes(keys) if key_id == 0 else None
    return keys(key_id)


class Channel:
    """An authenticated, ordered message channel (the handshake made it; see the module docstring).

    Offers the subset of ``multiprocessing.connection.Connection`` the transports use: ``send``,
    ``recv``, ``send_bytes``, ``recv_bytes``, ``poll``, ``fileno`` and ``close``.
    """

    def __init__(self, conn: mpc.Connection, send_key: bytes, recv_key: bytes, *, key_id: int = 0,
                 loads: Callable[[bytes], Any] = pickle.loads, dumps: Callable[[Any], bytes] = _pickle,
                 max_message: Callable[[], int] | None = None) -> None:
        self._conn = conn
        self._send_key, self._recv_key = send_key, recv_key
        self._send_seq = self._recv_seq = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        #: which key the connecting peer proved it holds (0: the collector's; a rank: that slot's)
        self.key_id = key_id
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
    """Bounds a whole handshake: after ``seconds`` the socket is shut down, which wakes any blocked
    read or write (a per-read timeout would let a peer dripping one byte at a time go on forever)."""

    def __init__(self, conn: mpc.Connection, seconds: float) -> None:
        self.conn, self.expired, self._done = conn, False, False
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if not self._done:
                self.expired = True
                shutdown_connection(self.conn)

    def stop(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()


def _connection(sock: socket.socket, user_timeout: float) -> mpc.Connection:
    _tune_socket(sock, user_timeout)
    sock.settimeout(None)
    return mpc.Connection(sock.detach())


def _server_side(conn: mpc.Connection, keys: Keys) -> Channel:
    """The listener checks the peer's proof before giving its own (it is no oracle for strangers)."""
    server_nonce = os.urandom(_NONCE)
    conn.send_bytes(_MAGIC + server_nonce)
    reply = conn.recv_bytes(_NONCE + _KEY_ID + _TAG)
    if len(reply) != _NONCE + _KEY_ID + _TAG:
        raise AuthenticationFailed("malformed handshake")
    client_nonce, key_id, proof = reply[:_NONCE], reply[_NONCE:_NONCE + _KEY_ID], reply[_NONCE + _KEY_ID:]
    key = _key_for(keys, int.from_bytes(key_id, "big", signed=True))
    if key is None:
        raise AuthenticationFailed("a key this listener does not take")
    if not hmac.compare_digest(proof, _mac(key, b"client", server_nonce, client_nonce, key_id)):
        raise AuthenticationFailed("wrong key")
    conn.send_bytes(_mac(key, b"server", server_nonce, client_nonce, key_id))
    return Channel(conn, _mac(key, b"server->client", server_nonce, client_nonce, key_id),
                   _mac(key, b"client->server", server_nonce, client_nonce, key_id),
                   key_id=int.from_bytes(key_id, "big", signed=True), loads=decode_from_node, max_message=node_limit)


def _client_side(conn: mpc.Connection, authkey: bytes, key_id: int) -> Channel:
    """The connecting peer proves, then requires the listener's proof before it reads anything else."""
    try:
        greeting = conn.recv_bytes(len(_MAGIC) + _NONCE)
    except EOFError as err:
        raise _NoGreeting("the listener closed the connection before its greeting") from err
    if len(greeting) != len(_MAGIC) + _NONCE or not greeting.startswith(_MAGIC):
        raise AuthenticationFailed("the listener does not speak the rlharvest channel protocol")
    server_nonce, client_nonce = greeting[len(_MAGIC):], os.urandom(_NONCE)
    ident = key_id.to_bytes(_KEY_ID, "big", signed=True)
    conn.send_bytes(client_nonce + ident + _mac(authkey, b"client", server_nonce, client_nonce, ident))
    proof = conn.recv_bytes(_TAG)
    if not hmac.compare_digest(proof, _mac(authkey, b"server", server_nonce, client_nonce, ident)):
        raise AuthenticationFailed("the listener did not prove it holds the key")
    return Channel(conn, _mac(authkey, b"client->server", server_nonce, client_nonce, ident),
                   _mac(authkey, b"server->client", server_nonce, client_nonce, ident), key_id=key_id,
                   dumps=encode_from_node)


def authenticate(conn: mpc.Connection, authkey: Keys, timeout: float, *, listener: bool,
                 hello: bool = False, key_id: int = 0) -> tuple[Channel, Any]:
    """Run one side of the handshake within ``timeout`` seconds (and, on the listener's side with
    ``hello``, receive the peer's hello too, decoded as plain values). Returns ``(channel, hello or None)``.

    ``authkey``: the key (and ``key_id`` its id) a connecting peer proves it holds; for a listener,
    the keys it takes (bytes: the key of id 0; or a function of the id).

    Raises:
        AuthenticationFailed: wrong key, garbage, silence or a closed connection; ``conn`` is closed.
    """
    watchdog = _Watchdog(conn, timeout)
    try:
        channel = _server_side(conn, authkey) if listener else _client_side(conn, authkey, key_id)
        first = decode_hello(channel.recv_bytes(HELLO_MAX)) if hello else None  # the peer proved it holds the key
    except Exception as err:
        watchdog.stop()
        conn.close()
        if watchdog.expired:
            raise AuthenticationFailed(f"no complete handshake within {timeout:g} s") from err
        if isinstance(err, AuthenticationFailed):
            raise
        if isinstance(err, EOFError):
            why = "" if listener else " (it holds another key, or is not a collector's listener)"
            raise AuthenticationFailed(f"the peer closed the connection during the handshake{why}") from err
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


def open_channel(host: str, port: int, authkey: bytes, timeout: float, user_timeout: float,
                 handshake_timeout: float = 5.0, key_id: int = 0,
                 on_retry: Callable[[BaseException], None] | None = None) -> Channel:
    """Connect to a :class:`~.listener.ChannelListener` (retrying until ``timeout``) and authenticate with
    ``authkey``, whose id is ``key_id``; ``on_retry(error)`` is called before each retry.

    Raises:
        AuthenticationFailed: the listener is not one holding ``authkey``; it is refused before
            anything it sent was unpickled.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            return authenticate(_connection(sock, user_timeout), authkey, handshake_timeout, listener=False,
                                key_id=key_id)[0]
        except _NoGreeting as err:  # a listener busy with strangers closes newcomers at once: try again
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
