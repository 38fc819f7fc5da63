"""RPCCollector: nodes driven over torch.distributed.rpc (TensorPipe).

Everything but the wire is :class:`~.nodes.NodeCollector`'s: trajectory ids (``k * W + i``),
automatic weight pushes, launchers (DistributedCollector's arguments, ``options/nodes.py``). Its nodes are
the workers of the ``rpc`` backend (``rlharvest.transport.rpc``): they run the worker loop in pull
mode (one RPC per command) and receive weights through RPCWeightSyncScheme.
"""

from __future__ import annotations

from ...weight_update.rpc import RPCWeightSyncScheme
from .._specs import has_weights
from .._signatures import bind_arguments, derived_signature, keyword, method_signature
from ..options.nodes import RPCOptions
from .torchdist import DistributedCollector
from .nodes import NodeCollector

__all__ = ["RPCCollector"]


class RPCCollector(NodeCollector):
    """Collect with one node per env constructor, commanded over torch RPC.

    Takes DistributedCollector's arguments except ``update_interval``, plus:

    Keyword Args:
        visible_devices: one device per node (device map for tensors sent to that node).
        tensorpipe_options: merged over ``{"num_worker_threads": 16, "rpc_timeout": 10000,
            "_transports": ["uv"]}``.
        trajs_per_batch, trajs_per_write, traj_format: batches of complete trajectories, assembled on
            this process from the nodes' batches, as :class:`~rlharvest.collectors.Collector` does
            (docs/trajectories.md).

    ``bind_address`` is where the store listens (DistributedCollector's default: loopback with
    ``"mp"``, where TensorPipe listens on loopback too). torch RPC authenticates nobody, whatever the
    address: see docs/security.md before exposing its ports.

    Remote references to the node collectors are in ``collector_rrefs`` (``collector_infos``
    holds their RPC worker infos), e.g. to attach an ``RPCWeightUpdater``.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = RPCCollector([CountingEnv] * 2, frames_per_batch=10, total_frames=20,
        ...                          launcher="mp", sync=True)                   # doctest: +SKIP
        >>> [tuple(b.shape) for b in collector]                                  # doctest: +SKIP
        [(2, 5), (2, 5)]
    """

    __signature__ = derived_signature(
        DistributedCollector.__init__, drop=("update_interval", "authkey", "handshake_timeout"), after="tcp_port",
        add=(keyword("visible_devices", annotation="Sequence | None"), keyword("tensorpipe_options", annotation="dict | None"),
             keyword("trajs_per_batch", annotation="int | None"), keyword("trajs_per_write", annotation="int | None"),
             keyword("traj_format", annotation="str | None")))

    def __init__(self, *args, **kwargs) -> None:
        arguments = bind_arguments(type(self).__name__, self.__signature__, args, kwargs)
        self.collector_rrefs: list = []
        self.collector_infos: list = []
        self._retired_rrefs: list = []
        self._construct(arguments)

    __init__.__signature__ = method_signature(__signature__)

    _stateless_nodes = False  # RPC nodes get the policy with its weights (no initial sync)

    def _parse(self, arguments: dict) -> RPCOptions:
        # No automatic pushes every update_interval batches; torch RPC authenticates nobody (docs/security.md).
        return RPCOptions.parse(type(self).__name__, update_interval=None, **arguments)

    @property
    def visible_devices(self):
        return self._options.visible_devices

    @property
    def tensorpipe_options(self) -> dict:
        return self._options.tensorpipe_options

    def _setup_schemes(self, weight_updater, schemes) -> None:
        weighted = has_weights(self.policy) or self.policy_factory is not None
        if weight_updater is None and schemes is None:
            schemes = {"policy": RPCWeightSyncScheme()} if weighted else {}
        self._legacy = weight_updater is not None
        self._sender_schemes = {} if self._legacy else dict(schemes or {})
        self._weight_sync_schemes = None if self._legacy else self._sender_schemes

    def _start_nodes(self, count: int) -> None:
        super()._start_nodes(count)
        handles = self._requests.handles
        self.collector_infos = [h.info for h in handles]
        self.collector_rrefs = [h.collector_rref(self._worker_timeout) for h in handles]

    def _before_replacement(self, worker: int) -> None:
        super()._before_replacement(worker)
        # The old node's RRef is deleted only once the agent is gone: deleting it now would message
        # an owner that left the group.
        self._retired_rrefs.append(self.collector_rrefs[worker])

    def _grown(self, count: int) -> None:
        super()._grown(count)
        for handle in self._requests.handles[-count:]:  # what users see lists the new nodes too
            self.collector_infos.append(handle.info)
            self.collector_rrefs.append(handle.collector_rref(self._worker_timeout))

    def _after_replacement(self, worker: int) -> None:
        handle = self._requests.handles[worker]  # a new RPC name: what users see follows it
        self.collector_infos[worker] = handle.info
        self.collector_rrefs[worker] = handle.collector_rref(self._worker_timeout)

    # ------------------------------------------------------------------ running free
    def start(self) -> None:
        """Collect in the background into the replay buffer until :meth:`async_shutdown`.

        RPC nodes only act on calls (nothing on a node runs between two of them), so a thread of this
        process keeps requesting batches, as iteration does, and writes them into the buffer.

        Raises:
            RuntimeError: without a replay buffer, or when already running.
        """
        self._start_thread()

    def _pause_impl(self):
        yield from self._pause_thread()

    def _close_workers(self, timeout: float) -> None:
        self.collector_rrefs = []  # the nodes' RRefs go while their owners still answer
        super()._close_workers(timeout)
        self._retired_rrefs = []
