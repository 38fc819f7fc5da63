"""The handshake that opens an authenticated channel (docs/security.md, "What is authenticated").

The listener proves first, so a peer that connects to a squatted port gives away nothing keyed:

1. the connecting peer sends its nonce, the *id* of the key it holds and a fresh X25519 public
   value: nothing that depends on its key (it speaks first, so that the listener tells a real peer,
   which speaks at once, from a silent stranger);
2. the listener answers with its own nonce, its own X25519 value and its proof over everything so
   far: an Ed25519 signature with the learner's identity (the command port,
   :class:`~.keys.LearnerIdentity`: no node can make it), or, on the ports of weights and relays,
   an HMAC under the key of that id;
3. the peer checks it and proves that it holds the key: an HMAC under a key derived from its key,
   the transcript and the X25519 shared secret.

The session keys derive from the key, the transcript and the shared secret: a peer that relays a
handshake it cannot make itself, even one holding the same key, cannot read the shared secret, so
cannot inject a message.
"""

from __future__ import annotations

import hashlib
import hmac
import multiprocessing.connection as mpc
import os
from dataclasses import dataclass
from typing import Callable, Union

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .keys import LearnerIdentity, verify_learner

__all__ = ["AuthenticationFailed", "Keys", "NotProven", "Session", "connector_side", "listener_side"]

MAGIC = b"rlharvest-channel-3\0"
_NONCE = 32
_KEY_ID = 8
_POINT = 32
_TAG = 32
_SIGNATURE = 64
_NO_KEY = b"no such key"
#: the keys a listener accepts: ``key id -> key``, or None for an id it does not know
Keys = Union[bytes, Callable[[int], Union[bytes, None]]]


class AuthenticationFailed(ConnectionError):
    """A peer did not complete the handshake (wrong key, garbage, silence) or sent a forged message."""


class NotProven(AuthenticationFailed):
    """The listener closed the connection before it proved anything (it evicted this handshake for a
    newer one, or is not a listener): nothing was sent that depends on a key, so the connecting peer
    may try again."""


@dataclass(frozen=True)
class Session:
    """What a handshake agreed on: the key of each direction, the id of the peer's key, and a secret
    of this channel alone (``exporter``: to wrap a key sent over it)."""

    send_key: bytes
    recv_key: bytes
    key_id: int
    exporter: bytes


def _key_for(keys: Keys, key_id: int) -> bytes | None:
    if isinstance(keys, (bytes, bytearray)):
        return bytes(keys) if key_id == 0 else None
    return keys(key_id)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, label + b"\0" + b"".join(parts), "sha256")


def _ephemeral() -> tuple[X25519PrivateKey, bytes]:
    private = X25519PrivateKey.from_private_bytes(os.urandom(32))
    return private, private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _session(key: bytes, transcript: bytes, private: X25519PrivateKey, peer_point: bytes, key_id: int,
             listener: bool) -> tuple[Session, bytes]:
    """The session keys and the connecting peer's proof."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_point))
    except ValueError as err:  # a low-order point: no shared secret
        raise AuthenticationFailed("malformed handshake (an invalid X25519 value)") from err
    master = _mac(key, b"master", transcript, shared)
    down, up = _mac(master, b"listener->connector"), _mac(master, b"connector->listener")
    session = Session(down if listener else up, up if listener else down, key_id, _mac(master, b"exporter"))
    return session, _mac(master, b"connector-proof")


def _transcript(first: bytes, answer: bytes) -> bytes:
    return hashlib.sha256(first + answer[:len(MAGIC) + _NONCE + _POINT]).digest()


def listener_side(conn: mpc.Connection, keys: Keys, identity: LearnerIdentity | None = None) -> Session:
    """The listener's side: read the peer's first message, prove (a signature with ``identity``, else
    an HMAC), check the peer's proof.

    Raises:
        AuthenticationFailed: for a key id ``keys`` does not take, garbage or a wrong proof.
        EOFError, OSError: the connection ended.
    """
    first = conn.recv_bytes(len(MAGIC) + _NONCE + _KEY_ID + _POINT)
    if len(first) != len(MAGIC) + _NONCE + _KEY_ID + _POINT or not first.startswith(MAGIC):
        raise AuthenticationFailed("malformed handshake")
    ident = first[len(MAGIC) + _NONCE:len(MAGIC) + _NONCE + _KEY_ID]
    key_id = int.from_bytes(ident, "big", signed=True)
    key = _key_for(keys, key_id)
    if key is None:  # said (unproven): waiting would not help that peer
        conn.send_bytes(MAGIC + _NO_KEY)
        raise AuthenticationFailed("a key this listener does not take")
    private, point = _ephemeral()
    answer = MAGIC + os.urandom(_NONCE) + point
    transcript = _transcript(first, answer)
    conn.send_bytes(answer + (identity.sign(transcript) if identity is not None else _mac(key, b"listener", transcript)))
    session, expected = _session(key, transcript, private, first[-_POINT:], key_id, listener=True)
    if not hmac.compare_digest(conn.recv_bytes(_TAG), expected):
        raise AuthenticationFailed("wrong key")
    return session


def connector_side(conn: mpc.Connection, key: bytes, key_id: int, learner: bytes | None = None) -> Session:
    """The connecting peer's side: send nothing keyed until the listener proved itself (the learner's
    signature when ``learner``, its public key, is given; else an HMAC under ``key``), then prove.

    Raises:
        NotProven: the listener closed the connection before its proof.
        AuthenticationFailed: the listener's proof is wrong, or it does not speak this protocol.
    """
    private, point = _ephemeral()
    first = MAGIC + os.urandom(_NONCE) + key_id.to_bytes(_KEY_ID, "big", signed=True) + point
    conn.send_bytes(first)
    try:
        answer = conn.recv_bytes(len(MAGIC) + _NONCE + _POINT + _SIGNATURE)
    except (EOFError, ConnectionResetError) as err:
        raise NotProven("the listener closed the connection before its proof") from err
    head = len(MAGIC) + _NONCE + _POINT
    if answer == MAGIC + _NO_KEY:
        raise AuthenticationFailed(f"the listener takes no key of id {key_id} (another collector's port?)")
    if not answer.startswith(MAGIC) or len(answer) <= head:
        raise AuthenticationFailed("the listener does not speak the rlharvest channel protocol")
    transcript = _transcript(first, answer)
    proof = answer[head:]
    if learner is not None:
        proven = len(proof) == _SIGNATURE and verify_learner(learner, proof, transcript)
    else:
        proven = hmac.compare_digest(proof, _mac(key, b"listener", transcript))
    if not proven:
        raise AuthenticationFailed("the listener did not prove it is the collector (it holds another key)")
    session, mine = _session(key, transcript, private, answer[len(MAGIC) + _NONCE:head], key_id, listener=False)
    conn.send_bytes(mine)
    return session
