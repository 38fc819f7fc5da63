"""See a running collector: a live page, ``/api/stats`` and Prometheus ``/metrics``
(docs/monitoring.md).

* ``server.py``: :class:`Monitor`, the HTTP server (a daemon thread of the learner's process);
* ``reading.py``: what it reads of a collector (its ``stats()`` snapshot and its fleet events);
* ``metrics.py``: the Prometheus metric families (``prometheus-client``, the ``monitor`` extra);
* ``static/``: the page (one HTML, one JS, one CSS file; no CDN, no internet needed).
"""

from .server import Monitor

__all__ = ["Monitor"]
