"""The key file of nodes that join from anywhere (``launcher="external"``, docs/elastic.md), both sides.

:class:`JoinKey` writes the node key of joining nodes (:class:`~.keys.NodeCredential`: the join
key and the learner's public key, never the collector's secret) where a joining node reads it (a
file only its owner may read, in a folder only its owner may enter), and removes it when the
collector shuts down or its process exits; :func:`read_key_file` is how a node opens and checks
such a file;
:func:`join_argv` is the command a node runs. The engine gives an empty slot back to the node that
joined it (``collectors/engine/extras.py``).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import weakref

from .keys import NodeCredential

__all__ = ["JoinKey", "join_argv", "read_key_file"]


class JoinKey:
    """The node key of joining nodes, derived from the collector's secret ``authkey``, in
    ``<private temporary folder>/authkey``, mode 0600; removed by :meth:`remove`, or when this
    object is collected or the interpreter exits (a process killed with SIGKILL cannot remove it:
    docs/security.md)."""

    def __init__(self, authkey: bytes) -> None:
        self.folder = tempfile.mkdtemp(prefix="rlharvest-join-")  # mode 0700
        self.path = os.path.join(self.folder, "authkey")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(NodeCredential.for_joining(authkey).encode())

    def remove(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        return f"JoinKey(path={self.path!r})"


def _check_folders(path: str, flag: str) -> None:
    """Every folder on the way to ``path`` must be this user's or root's, and writable by no other
    user unless sticky (as ``/tmp``): whoever may rename an entry of one could replace the key.

    Raises:
        PermissionError: naming ``flag``, ``path`` and the folder.
    """
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    while True:
        info = os.stat(folder)
        if info.st_uid not in (os.getuid(), 0):
            raise PermissionError(f"{flag} {path!r} is in a folder of another user (uid {info.st_uid}: {folder!r}), "
                                  "who could replace the key: keep it in a folder of yours.")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise PermissionError(f"{flag} {path!r} is in a folder other users may write ({folder!r}): keep the key "
                                  "in a folder only you can write.")
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent


def read_key_file(path: str, flag: str = "--key-file") -> str:
    """The key in the file ``path`` (given as the command's ``flag``), once it is checked: a regular
    file (not a symbolic link) of this user that no other user may read or write, in folders no
    other user owns or may write (who could replace it). The file is checked once open, so it
    cannot be swapped between the check and the read.

    Raises:
        PermissionError: naming ``flag`` and ``path``, for a file or folder others may change or read.
        OSError: when it cannot be opened (missing, a symbolic link: ``ELOOP``).
    """
    _check_folders(path, flag)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NOCTTY", 0))
    except OSError as err:
        if os.path.islink(path):
            raise PermissionError(f"{flag} {path!r} is a symbolic link: give the key file itself.") from err
        raise
    with os.fdopen(fd) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"{flag} {path!r} is not a regular file.")
        if info.st_uid != os.getuid():
            raise PermissionError(f"{flag} {path!r} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): "
                                  "whoever owns it can read or replace the key.")
        if info.st_mode & 0o077:
            raise PermissionError(f"{flag} {path!r} is readable by other users: chmod 600 it.")
        return handle.read(4096).strip()


def join_argv(host: str, port: int, key_path: str) -> list[str]:
    """The argv of a node that joins the collector listening at ``host:port``: this interpreter
    (``sys.executable``; on a host where it lives elsewhere, change the first word)."""
    return [sys.executable, "-m", "rlharvest", "node", "--join", f"{host}:{port}", "--key-file", key_path]

