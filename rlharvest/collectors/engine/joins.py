"""The collector's side of nodes that join from anywhere (``launcher="external"``, docs/elastic.md).

:class:`JoinKey` writes the collector's key where a joining node reads it (a file only its owner
may read, in a folder only its owner may enter); :func:`join_argv` is the command a node runs
(``extras.ExternalJoins`` gives an empty slot back to the node that joined it).
"""

from __future__ import annotations

import os
import shutil
import tempfile

__all__ = ["JoinKey", "join_argv"]


class JoinKey:
    """The collector's key (hex) in ``<private temporary folder>/authkey``, mode 0600; removed by :meth:`remove`."""

    def __init__(self, authkey: bytes) -> None:
        self.folder = tempfile.mkdtemp(prefix="rlharvest-join-")  # mode 0700
        self.path = os.path.join(self.folder, "authkey")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(authkey.hex())

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def join_argv(host: str, port: int, key_path: str) -> list[str]:
    """The argv of a node that joins the collector listening at ``host:port``."""
    return ["python", "-m", "rlharvest", "node", "--join", f"{host}:{port}", "--key-file", key_path]

