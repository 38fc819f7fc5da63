"""Typed options, one frozen dataclass per collector: each parses and validates its collector's
constructor arguments once, and hands its engine ready objects (how batches gather, when weights are
pushed, how it runs free, the parts its backend adds: ``engine/contract.py``), builds the backend and
the worker specs (docs/architecture.md). The engine reads nothing else of a collector's arguments.

``local.py`` (``Collector``), ``mp.py`` (worker processes), ``nodes.py`` (what every node collector
shares) with ``torchdist.py``, ``rpc.py`` and ``ray.py``, ``async_batched.py``; ``network.py``
(addresses, ports, key), ``autoscale.py`` (``Autoscale``), ``common.py``.
"""
