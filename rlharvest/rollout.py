"""THE rollout loop: the one piece of code that steps an env with a policy and fills a batch.

Every collector runs it: ``Collector`` in the calling process, worker processes, torch.distributed
nodes and RPC nodes through the worker loop. Per step it only moves references around (the env and
the policy produce the values; the loop keeps them in a list); every :data:`CHUNK_STEPS` steps it
stacks each key of the steps so far into its rows of a preallocated TensorDict of shape
``(*batch_size, T)`` with the time dim named ``"time"``, and lets the steps go. This keeps per-frame
bookkeeping to a few microseconds, and keeps the steps alive too briefly for Python's garbage
collector to promote them: a batch held whole until its end made it scan the whole heap every few
batches (docs/archive/performance-history.md, "The garbage collector and the batch's steps").

Auto-reset invariant (docs/envs.md): the root of step ``t`` is the state before acting, ``("next", *)``
is the outcome including the terminal observation, and a sub-env whose step ended is reset before
step ``t + 1``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import set_interaction_type

from ._batching import or_flag, owner_of, truncate_inside, value_meta
from ._utils import TRAJ_IDS, NestedKey, as_tuple_key, unravel_key
from .batch_buffer import BatchBuffer, Layout
from .envs.adapters import EnvAdapter, env_attr, make_env_adapter
from .envs.checks import check_policy_actions, check_step_specs, first_step
from .episodes import EpisodeEnds, LocalTrajectoryCounter, TrajectoryCounter, trajectory_ids
from .policies import ExplorationType, PolicyStep, RandomStep, make_policy_step

__all__ = ["CHUNK_STEPS", "Rollout", "RolloutSettings", "RolloutTimes", "TrajectoryCounter", "LocalTrajectoryCounter"]

#: Steps kept before they are written into the batch's buffer. A step keeps ~6 objects the garbage
#: collector tracks (its dicts, tuple and tensors); 64 steps stay under its first threshold (700), so
#: the steps are gone before a collection could move them to the generation whose growth triggers a
#: scan of the whole heap.
CHUNK_STEPS = 64


@dataclass
class RolloutTimes:
    """Seconds spent in rollouts, split between the env (steps and the loop's own bookkeeping) and
    the policy. Cumulative since the rollout was built.

    The batch's duration is measured exactly (two clock reads per batch); its split is estimated
    from one step per batch timed in full, a different step each batch, so no step pays more than
    an integer comparison for it.
    """

    env: float = 0.0
    policy: float = 0.0

    def add(self, seconds: float, probe_policy: float, probe_total: float) -> None:
        share = probe_policy / probe_total if probe_total > 0 else 0.0
        self.policy += seconds * share
        self.env += seconds * (1.0 - share)


@dataclass(frozen=True)
class RolloutSettings:
    """What the loop needs to know besides the env and the policy (built from a collector config)."""

    time_steps: int
    max_frames_per_traj: int = 0
    set_truncated: bool = False
    track_policy_version: bool = False
    exploration_type: Any = ExplorationType.RANDOM
    storing_device: torch.device | None = None
    policy_device: torch.device | None = None
    env_device: torch.device | None = None
    use_buffers: bool = True
    #: keep ``("collector", "traj_ids")`` (False: no id bookkeeping)
    track_traj_ids: bool = True
    #: drop the observations from ``("next", ...)`` (they are the next step's root entries)
    compact_obs: bool = False
    #: stack steps lazily (envs with dynamic specs, whose shapes change between steps)
    lazy_stack: bool = False


class Rollout:
    """Steps ``env`` with ``policy`` and assembles batches of ``settings.time_steps`` steps.

    Args:
        env: any env of the protocol (docs/envs.md).
        policy: the (already wrapped) policy callable.
        settings: loop options.
        traj_counter: where fresh trajectory ids come from.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> from rlharvest.policies import RandomPolicy
        >>> env = CountingEnv()
        >>> rollout = Rollout(env, RandomPolicy(env.full_action_spec), RolloutSettings(time_steps=4),
        ...                   LocalTrajectoryCounter())
        >>> rollout.collect().batch_size
        torch.Size([4])
    """

    def __init__(self, env, policy: Callable, settings: RolloutSettings, traj_counter: TrajectoryCounter):
        self.env = env
        self.settings = settings
        self.adapter: EnvAdapter = make_env_adapter(env)
        self.batch_size = torch.Size(env.batch_size)
        self.time_dim = len(self.batch_size)
        self.traj_counter = traj_counter
        self.policy_version = 0
        self.batches = BatchBuffer(self.batch_size, settings.time_steps, settings.storing_device,
                                   reuse=settings.use_buffers, lazy=settings.lazy_stack)
        self._compact_keys: frozenset | None = None
        self._limit = settings.max_frames_per_traj if settings.max_frames_per_traj else 0
        if self._limit and self.batch_size and not env_attr(env, "partial_reset", True):
            raise ValueError(f"max_frames_per_traj={self._limit} resets each sub-env whose trajectory reaches "
                             f"it, and no other, which {env!r} cannot do (partial_reset is False): give the env "
                             "a time limit of its own (e.g. gymnasium's max_episode_steps) instead.")
        self._add_truncated = bool(self._limit) and not self.adapter.has_truncated
        self._policy_lock = threading.RLock()
        self.times = RolloutTimes()
        self._probe = 0
        self._ends = EpisodeEnds(self.batch_size)
        self.reset()
        self.policy_step: PolicyStep = make_policy_step(policy, env, set(self._root), settings.policy_device)
        self.random_step = RandomStep(env)
        # The policy's first action is checked against the env's action keys and spec (once: the
        # loop never checks values per step); one that the spec does not hold is taken as TorchRL's
        # envs take it, with a warning. Random actions come from the spec itself.
        self._actions_checked = isinstance(self.policy_step, RandomStep)
        self._move_actions = (
            settings.env_device is not None and settings.policy_device is not None
            and settings.env_device != settings.policy_device
        )

    # ------------------------------------------------------------------ state
    @property
    def n_envs(self) -> int:
        return int(np.prod(self.batch_size)) if self.batch_size else 1

    @property
    def traj_ids(self):
        """The trajectory each sub-env is in after the last batch: a tensor of the env batch shape (an int
        for one env). A batched env's new ids are handed out at the end of each chunk of steps."""
        return self._traj

    def ended_rows(self):
        """The sub-envs that ended an episode in the batch being collected (or the last one, between
        batches): a bool tensor of the env batch shape (a bool for one env). For an ``interruptor``'s
        ``between_steps`` check: it costs nothing to the steps of a batch nobody asks."""
        return self._ends.ended()

    def reset(self, mask=None) -> None:
        """Reset all sub-envs (or those in ``mask``) and give them fresh trajectory ids."""
        if mask is None:
            self.stepped_since_reset = False
            self._root = self.adapter.reset(None)
            first = self.traj_counter.take(self.n_envs)
            if self.batch_size:
                self._traj = torch.arange(first, first + self.n_envs, dtype=torch.int64).reshape(self.batch_size)
                self._count = torch.zeros(self.batch_size, dtype=torch.int64)
            else:
                self._traj, self._count = first, 0
            return
        mask = torch.as_tensor(mask, dtype=torch.bool).reshape(self.batch_size)
        self._root = self.adapter.reset_rows(self._root, mask)
        self._traj = self._renumber(self._traj, mask)
        self._count = torch.where(mask, 0, self._count)

    def _renumber(self, traj, done):
        """New ids for the sub-envs in ``done``: the next ones of the counter, in row-major order."""
        if not self.batch_size:
            return self.traj_counter.take(1)
        return trajectory_ids(traj, [(0, done)], 1, self.traj_counter.take)[1]  # as an end at step 0 gives

    def episode_state(self) -> dict[str, Any]:
        """The episodes in flight: the root the next step acts on, trajectory ids, step counts
        (``max_frames_per_traj``). With the env's own state, :meth:`load_episode_state` continues them."""
        return {"root": self._root, "traj": self._traj, "count": self._count,
                "stepped_since_reset": self.stepped_since_reset}

    def load_episode_state(self, state: dict[str, Any]) -> None:
        """Continue the episodes of :meth:`episode_state` (the env's own state was put back first)."""
        self._root, self._traj, self._count = dict(state["root"]), state["traj"], state["count"]
        self.stepped_since_reset = bool(state["stepped_since_reset"])

    @property
    def root(self) -> dict:
        """The root values the next step acts on (read-only: the loop owns them)."""
        return self._root

    @property
    def policy_lock(self) -> threading.RLock:
        """Held while the policy runs; weight updates from other threads take it too."""
        return self._policy_lock

    # ------------------------------------------------------------------ the loop
    def collect(self, *, random: bool = False, between_steps: Callable[[], bool] | None = None) -> TensorDictBase:
        """Run one batch of ``time_steps`` steps and return it.

        Args:
            random: draw actions from the action spec instead of the policy.
            between_steps: called after every step; returning True stops the batch early (the
                remaining steps get trajectory id -1).
        """
        steps: list[tuple[dict, dict, dict, Any, Any, int]] = []
        append = steps.append
        ends = self._ends.start()  # a batched env's new trajectory ids come when the chunk is written
        chunk = CHUNK_STEPS if self.batches.writes_chunks else 0
        written = 0  # steps already in the buffer
        act = self.random_step if random else self.policy_step
        adapter, limit, lock = self.adapter, self._limit, self._policy_lock
        # Every name the loop uses is local: each step pays only for the env, the policy and a few
        # references moved (docs/archive/performance-history.md, "Where each microsecond of a frame goes").
        env_step, next_root_of = adapter.step, adapter.next_root
        scalar = not self.batch_size  # one env: done is a Python bool (a batch: a bool tensor, see _restart)
        move = self._to_env_device if self._move_actions else None
        last_step = self.settings.time_steps - 1 if self.settings.set_truncated else -1
        root, traj, count = self._root, self._traj, self._count
        probe = self._probe = (self._probe + 1) % self.settings.time_steps  # the step timed in full
        check = not (random or self._actions_checked)
        misfits = None  # the first action's, when the env's spec does not hold it
        start = probe_start = probe_acted = probe_end = time.perf_counter()
        with torch.no_grad(), set_interaction_type(self.settings.exploration_type):
            for t in range(self.settings.time_steps):
                if t == probe:
                    probe_start = time.perf_counter()
                with lock:
                    actions = act(root)
                    version = self.policy_version
                if check:  # before the env steps with it: its error would not name the policy
                    misfits = check_policy_actions(self.env, actions)
                    self._actions_checked, check = True, False
                if t == probe:
                    probe_acted = time.perf_counter()
                if misfits:  # the first step, with actions the env's spec does not hold
                    nxt, done, next_root = first_step(env_step, misfits, root, actions if move is None else move(actions))
                    misfits = None
                else:
                    nxt, done, next_root = env_step(root, actions if move is None else move(actions))
                if t == probe:
                    probe_end = time.perf_counter()
                env_done = done
                if limit or t == last_step:
                    nxt, done = self._truncate(nxt, done, count, t == last_step)
                append((root, actions, nxt, traj, count, version))
                if done if scalar else done.any():
                    root, traj, count = self._restart(nxt, root, next_root, done, env_done, traj, count, ends,
                                                      len(steps) - 1)
                else:
                    root = next_root if next_root is not None else next_root_of(nxt, root)
                    if limit:
                        count = count + 1
                if len(steps) == chunk:
                    chunk, written, traj = self._write_chunk(steps, written, random, ends, traj)
                if between_steps is not None and between_steps():
                    break
        batch, traj = self._assemble(steps, random, written, ends, traj)
        self._root, self._traj, self._count = root, traj, count
        self.stepped_since_reset = True
        self.times.add(time.perf_counter() - start, probe_acted - probe_start, probe_end - probe_start)
        return batch

    def _to_env_device(self, actions: dict) -> dict:
        device = self.settings.env_device
        return {k: v.to(device, non_blocking=True) for k, v in actions.items()}

    def _truncate(self, nxt: dict, done, count, end_of_batch: bool):
        """Apply ``max_frames_per_traj`` and ``set_truncated`` to a step's next values: every
        truncated flag of the hit sub-envs is set, and their done flags with it."""
        done = self.adapter.done_rows(done)
        hit = (count + 1 >= self._limit) if self._limit else False
        if end_of_batch:
            hit = True if not self.batch_size else torch.ones(self.batch_size, dtype=torch.bool)
        if not self._add_truncated and not (hit if not self.batch_size else bool(hit.any())):
            return nxt, done
        nxt = dict(nxt)
        for truncated_key, done_key in self.adapter.truncation_keys:
            owner = owner_of(nxt, done_key)
            if owner is not None:  # the flags live inside an entry kept whole (e.g. per agent)
                nxt[owner] = truncate_inside(nxt[owner], owner, truncated_key, done_key, hit, self.batch_size)
                continue
            like = nxt[done_key]
            nxt[truncated_key] = or_flag(nxt.get(truncated_key), hit, like, self.batch_size)
            nxt[done_key] = or_flag(like, hit, like, self.batch_size)
        return nxt, (done or hit) if not self.batch_size else done | hit

    def _restart(self, nxt, root, next_root, done, env_done, traj, count, ends: EpisodeEnds, step: int):
        """Root, trajectory ids and step counts after a step in which some sub-envs ended (noted in
        ``ends``: a batched env's new ids come with the chunk's)."""
        adapter = self.adapter
        done, env_done = adapter.done_rows(done), adapter.done_rows(env_done)
        if next_root is not None:
            # The env already reset what it considered done; reset what we truncated on top of it.
            extra = (done and not env_done) if not self.batch_size else done & ~env_done
            root = adapter.reset_rows(next_root, extra) if adapter.any_done(extra) else next_root
        else:
            root = adapter.reset_rows(adapter.next_root(nxt, root), done)
        ends.add(step, done)
        if not self.batch_size:
            return root, self._renumber(traj, done), 0
        # step counts serve max_frames_per_traj only
        return root, traj, torch.where(done, 0, count + 1) if self._limit else count

    # ------------------------------------------------------------------ batch assembly
    def _policy_outputs(self, root: dict) -> dict:
        """What the policy writes for ``root``: one call whose result is only used for its layout.

        A batch of random actions has the same keys as a policy batch (the policy's other outputs,
        Q-values or log-probabilities, are zero), so a buffer laid out by a random first batch
        still holds the policy's batches.
        """
        with torch.no_grad(), set_interaction_type(self.settings.exploration_type), self._policy_lock:
            return self.policy_step(dict(root))

    def _build_layout(self, step, random: bool) -> Layout:
        root, actions, nxt, _, _, _ = step
        if random and not isinstance(self.policy_step, RandomStep):
            actions = {**self._policy_outputs(root), **actions}
        layout: Layout = {}
        flag_shape = (*self.batch_size, 1)
        for key, value in root.items():
            layout[key] = value_meta(value)
        for key in self.adapter.implicit_root_flags + (["truncated"] if self._add_truncated else []):
            layout.setdefault(unravel_key(key), (flag_shape, torch.bool))
        for key, value in actions.items():
            layout[key] = value_meta(value)
        for key, value in nxt.items():
            if key not in self._compacted(root, nxt):
                layout[unravel_key(("next", key))] = value_meta(value)
        if self._add_truncated:
            layout[("next", "truncated")] = (flag_shape, torch.bool)
        if self._limit:
            layout["step_count"] = layout[("next", "step_count")] = (flag_shape, torch.int64)
        if self.settings.track_policy_version:
            layout["policy_version"] = layout[("next", "policy_version")] = (tuple(self.batch_size), torch.int64)
        if self.settings.track_traj_ids:
            layout[TRAJ_IDS] = (tuple(self.batch_size), torch.int64)
        return layout

    def _compacted(self, root: dict, nxt: dict) -> frozenset:
        """The ``("next", ...)`` entries ``compact_obs`` drops: the observations and state the next
        root carries (rewards and done flags stay)."""
        if not self.settings.compact_obs:
            return frozenset()
        if self._compact_keys is None:
            observations = set(root) | set(self.adapter.observation_keys)
            kept = {"done", "terminated", "truncated"}
            self._compact_keys = frozenset(
                k for k in nxt if k in observations and as_tuple_key(k)[-1] not in kept
                and k not in self.adapter.reward_keys
            )
        return self._compact_keys

    @property
    def layout(self) -> Layout | None:
        """``{key: (per-step shape, dtype)}`` once the first batch ran, else None."""
        return self.batches.layout

    @property
    def public(self) -> bool:
        """Whether the batches are known to have no private key (``_``-prefixed), once the first batch ran."""
        return self.batches.public

    @property
    def buffer(self) -> TensorDictBase | None:
        """The buffer batches are written into (once the first batch ran; None without ``use_buffers``)."""
        return self.batches.buffer

    def fake_batch(self) -> TensorDictBase:
        """A zero batch with the keys, shapes and dtypes of the batches this loop collects.

        Before the first batch, the layout comes from the env's ``fake_tensordict()`` (one
        transition from its specs) and one policy call on its root, as for a random warm-up.

        Raises:
            NotImplementedError: before the first batch, for an env without ``fake_tensordict``.
        """
        layout = self.batches.layout
        if layout is None:
            make_fake = env_attr(self.env, "fake_tensordict")
            if make_fake is None:
                raise NotImplementedError(f"{type(self.env).__name__} has no fake_tensordict(): collect one batch "
                                          "first, whose layout is then known.")
            transition = make_fake()
            next_values = {k: transition.get(("next", *((k,) if isinstance(k, str) else k)))
                           for k in transition.get("next").keys(True, True)}
            action_keys = {unravel_key(k) for k in env_attr(self.env, "action_keys", ["action"])}
            root = {k: transition.get(k) for k in transition.exclude("next").keys(True, True) if k not in action_keys}
            actions = self._policy_outputs(root)
            layout = self._build_layout((root, actions, next_values, None, None, None), random=False)
        return self.batches.allocate(layout)

    def resize(self, time_steps: int) -> None:
        """Batches of ``time_steps`` steps from the next one on, in a buffer allocated at that size."""
        self.settings, self._probe = replace(self.settings, time_steps=int(time_steps)), 0
        self.batches.resize(time_steps)

    def hand_out_batches(self) -> None:
        """Each batch in a buffer of its own, which the caller keeps (``BatchBuffer.hand_out_batches``)."""
        self.batches.hand_out_batches()

    def set_buffer(self, buffer: TensorDictBase) -> None:
        """Write future batches into ``buffer`` (same layout), e.g. one living in shared memory."""
        self.batches.set_buffer(buffer)

    def _know_layout(self, step, random: bool) -> None:
        """The batch layout, from the first step ever collected."""
        if self.batches.layout is None:
            layout = self._build_layout(step, random)
            check_step_specs(self.env, step[0], step[2])
            self.batches.set_layout(layout)

    def _write_chunk(self, steps: list, offset: int, random: bool, ends: EpisodeEnds, traj) -> tuple[int, int, Any]:
        """Write ``steps`` into the buffer's rows from ``offset`` on and empty the list (and ``ends``);
        returns the next chunk's size, the steps written and the trajectory ids after them. Nothing is
        written when the batch cannot go into a buffer (values kept whole): it is stacked at its end
        (chunk size 0)."""
        self._know_layout(steps[0], random)
        if not self.batches.writes_chunks:
            return 0, offset, traj
        columns, traj = self._columns(steps, ends, traj)
        self.batches.write(columns, offset)
        count = len(steps)
        steps.clear()
        ends.written()
        return count, offset + count, traj

    def _assemble(self, steps: list, random: bool, written: int, ends: EpisodeEnds, traj) -> tuple[TensorDictBase, Any]:
        """The batch, and the trajectory ids after it: ``written`` steps are in the buffer already,
        ``steps`` follow them (``traj``: the ids after the last written chunk, when no step follows)."""
        if not steps:
            return self.batches.finish({}, written, 0), traj
        self._know_layout(steps[0], random)
        columns, traj = self._columns(steps, ends, traj)
        ends.written()
        return self.batches.finish(columns, written, len(steps)), traj

    def _columns(self, steps: list, ends: EpisodeEnds, traj) -> tuple[dict[NestedKey, Any], Any]:
        """Per-key lists of per-step values, in time order, and the trajectory ids after the steps
        (``traj``: the loop's; for one env, the ids it renumbered as it ended)."""
        roots, actions, nexts, trajs, counts, versions = zip(*steps)
        columns: dict[NestedKey, list] = {}
        for key in roots[0]:
            columns[key] = [r[key] for r in roots]
        for key in actions[0]:
            columns[key] = [a[key] for a in actions]
        dropped = self._compacted(roots[0], nexts[0])
        for key in nexts[0]:
            if key not in dropped:
                columns[unravel_key(("next", key))] = [x[key] for x in nexts]
        if self.batch_size:
            ids, traj = trajectory_ids(trajs[0], ends.chunk, len(steps), self.traj_counter.take)
            if self.settings.track_traj_ids:
                columns[TRAJ_IDS] = ids
        elif self.settings.track_traj_ids:
            columns[TRAJ_IDS] = list(trajs)
        if self._limit:
            if self.batch_size:
                counts = [c.unsqueeze(-1) for c in counts]
            columns["step_count"] = list(counts)
            columns[("next", "step_count")] = [c + 1 for c in counts]
        if self.settings.track_policy_version:
            batch = self.batch_size
            column = [torch.full(batch, v, dtype=torch.int64) for v in versions] if batch else list(versions)
            columns["policy_version"] = columns[("next", "policy_version")] = column
        return columns, traj

