"""The keys of the authenticated channels, and what a node holds (docs/security.md, "The key").

A collector has one *secret* (32 bytes): a fresh random one, or one stretched from a key the user
gave (:func:`stretch_authkey`: scrypt, so that guessing a weak key offline costs a scrypt per
guess). Every other key derives from it with HMAC-SHA256 (:func:`derive_key`):

* the *learner's identity* (:class:`LearnerIdentity`): an Ed25519 signing key that never leaves the
  main process; its public half is in every node's credential. The main process signs its side of
  every command channel's handshake with it: a node holding any credential cannot sign, so it
  cannot act as the learner to another node;
* *slot keys* (:func:`slot_key`): the node of rank ``r`` proves it holds its slot's key;
* the *join key* (:func:`join_key`): nodes that join (``launcher="external"``) prove they hold it,
  and may take any empty slot with it.

A node holds a :class:`NodeCredential`: the id and bytes of its key and the learner's public key.
Nodes started by hand with the collector's key itself (``RLHARVEST_AUTHKEY``) derive theirs from it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

__all__ = ["AUTHKEY_ENV", "MAX_RANK", "LearnerIdentity", "NodeCredential", "derive_key", "join_key", "new_authkey",
           "as_credential", "parse_authkey", "parse_node_key", "slot_key", "stretch_authkey", "unwrap_key", "verify_learner",
           "wrap_key"]

#: environment variable holding the collector's key (hex) for nodes started by hand
AUTHKEY_ENV = "RLHARVEST_AUTHKEY"
_MIN_KEY_BYTES = 16
#: a key with fewer distinct byte values is refused as weak (16 random bytes have ~15.5)
_MIN_DISTINCT = 8
#: scrypt's cost for a key the user gave: 16 MiB and ~0.05-0.15 s, once per process and key
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}
#: the largest rank a slot key is derived for (a key id beyond is refused before any work)
MAX_RANK = 1 << 20
#: how an encoded node key starts (then its id, 4 bytes, its key and the learner's public key)
_CREDENTIAL = b"rlharvest-node-key-1\0"
_ENCODED = len(_CREDENTIAL) + 4 + 32 + 32
_SIGNED = b"rlharvest-listener\0"


def new_authkey() -> bytes:
    """A fresh random secret (32 bytes)."""
    return os.urandom(32)


def parse_authkey(value: bytes | str, name: str = "authkey") -> bytes:
    """``value`` as key bytes: bytes, or their hex; at least 16 bytes, of at least 8 distinct values.

    Raises:
        ValueError: naming ``name`` for anything shorter, not hex, or too repetitive to be random.
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
    if len(set(value)) < _MIN_DISTINCT:
        raise ValueError(f"{name} is not a random key ({len(set(value))} distinct byte values in {len(value)} "
                         "bytes): make one with `python -c 'import secrets; print(secrets.token_hex(32))'`.")
    return bytes(value)


@functools.lru_cache(maxsize=16)
def stretch_authkey(key: bytes) -> bytes:
    """The collector's secret from a key the user gave (``authkey=``, ``RLHARVEST_AUTHKEY``, a key
    file): scrypt of it. The collector and every node holding that key compute the same secret."""
    return hashlib.scrypt(key, salt=b"rlharvest-collector-key", dklen=32, **_SCRYPT)


def derive_key(key: bytes, label: str, *parts: bytes) -> bytes:
    """A key for one purpose (``label``), derived from ``key`` and ``parts`` (e.g. a salt that
    travels): HMAC-SHA256. Whoever holds ``key`` can derive it; from it, nobody can learn ``key``."""
    return hmac.digest(key, b"rlharvest-" + label.encode() + b"\0" + b"\0".join(parts), "sha256")


def slot_key(secret: bytes, rank: int) -> bytes:
    """The key of the node of rank ``rank`` (of every generation of it), derived from the collector's
    secret: nodes the collector starts itself get only theirs."""
    return derive_key(secret, "slot", rank.to_bytes(8, "big"))


def wrap_key(key: bytes, kek: bytes) -> bytes:
    """``key`` (32 bytes) encrypted for the holder of ``kek``: a fresh 16-byte nonce, then ``key``
    XOR HMAC-SHA256(``kek``, nonce). Sent over an authenticated channel, so it is not altered either."""
    nonce = os.urandom(16)
    return nonce + bytes(a ^ b for a, b in zip(key, derive_key(kek, "wrap", nonce)))


def unwrap_key(wrapped: bytes, kek: bytes) -> bytes:
    """The key :func:`wrap_key` wrapped under ``kek``.

    Raises:
        ValueError: for anything but 48 bytes.
    """
    if not isinstance(wrapped, bytes) or len(wrapped) != 48:
        raise ValueError("a wrapped key takes 48 bytes")
    return bytes(a ^ b for a, b in zip(wrapped[16:], derive_key(kek, "wrap", wrapped[:16])))


def join_key(secret: bytes) -> bytes:
    """The key nodes that join prove they hold (key id 0): it takes any empty slot, nothing more."""
    return derive_key(secret, "join")


class LearnerIdentity:
    """The main process's signing key, derived from the collector's secret (never in a repr)."""

    def __init__(self, secret: bytes) -> None:
        self._private = Ed25519PrivateKey.from_private_bytes(derive_key(secret, "learner-identity"))
        #: the public key (32 bytes) every node's credential holds
        self.public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, transcript: bytes) -> bytes:
        return self._private.sign(_SIGNED + transcript)

    def __repr__(self) -> str:
        return f"LearnerIdentity(public={self.public.hex()[:16]}...)"


def verify_learner(public: bytes, signature: bytes, transcript: bytes) -> bool:
    """Whether ``signature`` is the learner's (of public key ``public``) over ``transcript``."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, _SIGNED + transcript)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class NodeCredential:
    """What a node proves and checks with: its key (``key_id`` 0: the join key, else its rank's slot
    key) and the learner's public key, which the main process's signature must match.

    Its text form (:meth:`encode`: hex, as a collector's key, of a prefix, the id and both keys) is
    what a key file of ``join_command()`` holds, and what the collector puts in the start arguments
    of the nodes it starts.
    """

    key_id: int
    key: bytes = field(repr=False)
    learner: bytes

    @classmethod
    def for_slot(cls, secret: bytes, rank: int) -> NodeCredential:
        return cls(rank, slot_key(secret, rank), LearnerIdentity(secret).public)

    @classmethod
    def for_joining(cls, secret: bytes) -> NodeCredential:
        return cls(0, join_key(secret), LearnerIdentity(secret).public)

    def encode(self) -> str:
        return (_CREDENTIAL + self.key_id.to_bytes(4, "big") + self.key + self.learner).hex()

    @classmethod
    def decode(cls, text: str, name: str = "the node key") -> NodeCredential:
        """Raises:
            ValueError: naming ``name`` for anything but an encoded credential."""
        credential = _credential_of(text)
        if credential is None:
            raise ValueError(f"{name} is not a node key of this rlharvest version (what join_command()'s key file "
                             "holds)")
        return credential


def as_credential(value: NodeCredential | bytes) -> NodeCredential | None:
    """``value`` as a node credential: itself, or its encoded bytes (a key file's hex, decoded);
    None for anything else (a key)."""
    if isinstance(value, NodeCredential):
        return value
    if not (isinstance(value, (bytes, bytearray)) and len(value) == _ENCODED and value.startswith(_CREDENTIAL)):
        return None
    start = len(_CREDENTIAL) + 4
    key_id = int.from_bytes(value[len(_CREDENTIAL):start], "big")
    return NodeCredential(key_id, bytes(value[start:start + 32]), bytes(value[start + 32:])) \
        if key_id <= MAX_RANK else None


def _credential_of(text: str) -> NodeCredential | None:
    try:
        return as_credential(bytes.fromhex(text.strip()))
    except ValueError:  # not hex
        return None


def parse_node_key(text: str, name: str) -> NodeCredential | bytes:
    """What a key file or ``RLHARVEST_AUTHKEY`` holds: a node credential (what ``join_command()``'s
    file holds), or the collector's key in hex, returned as the collector's secret (stretched).

    Raises:
        ValueError: naming ``name``.
    """
    return _credential_of(text) or stretch_authkey(parse_authkey(text, name))
