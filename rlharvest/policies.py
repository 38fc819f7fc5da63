"""Policies as the rollout loop sees them.

A user policy is any callable TensorDict -> TensorDict (docs/collection.md, "Policies"). Plain ``nn.Module`` policies whose
forward arguments are observation names are wrapped into :class:`ObservationModule`. For speed the
rollout loop does not call the policy on a TensorDict when it can avoid it: *key-to-key* modules
(our wrapper, an unmodified ``TensorDictModule``, a ``TensorDictSequential`` of those) are called
directly on the tensors of their ``in_keys``. Everything else goes through a TensorDict built from
the step's values. A step in which a module the fast path calls past has a hook (its own or torch's
global module hooks) goes through the TensorDict too: the fast path never skips user code.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn.modules.module as _torch_module
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import (
    InteractionType,
    TensorDictModule,
    TensorDictModuleBase,
    TensorDictSequential,
)

from ._utils import NestedKey, as_tuple_key, unravel_key
from .envs.adapters import env_attr
from .envs.adapters import step_leaves as _step_leaves

__all__ = [
    "ExplorationType",
    "RandomPolicy",
    "ObservationModule",
    "wrap_policy",
    "PolicyStep",
    "make_policy_step",
]

#: The ambient exploration mode, read by stochastic policies. It *is* tensordict's
#: ``InteractionType``, so TorchRL policies honour the mode a collector sets.
ExplorationType = InteractionType


class RandomPolicy(torch.nn.Module):
    """Draws uniformly random actions from an action spec.

    Args:
        action_spec: a spec with ``rand()`` (a Composite of action keys, or one leaf spec); None to
            let the collector give it the env's ``full_action_spec``.
        action_key: where to write a leaf spec's sample.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> env = CountingEnv()
        >>> td = RandomPolicy(env.full_action_spec)(env.reset())
        >>> "action" in td.keys()
        True
    """

    def __init__(self, action_spec=None, action_key: NestedKey = "action") -> None:
        super().__init__()
        self.action_spec = action_spec
        self.action_key = action_key

    def set_action_spec_from_env(self, env) -> None:
        """Take ``env.full_action_spec`` when no spec was given (collectors call it)."""
        if self.action_spec is None:
            self.action_spec = env.full_action_spec

    def sample(self) -> dict[NestedKey, torch.Tensor]:
        """One random action per action key.

        Raises:
            RuntimeError: when no action spec was given and no collector set one.
        """
        spec = self.action_spec
        if spec is None:
            raise RuntimeError("RandomPolicy has no action_spec: pass one, or give the policy to a collector, "
                               "which sets the env's.")
        if hasattr(spec, "keys"):
            return {unravel_key(k): spec[k].rand() for k in spec.keys(True, True)}
        return {unravel_key(self.action_key): spec.rand()}

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        for key, value in self.sample().items():
            tensordict.set(key, value)
        return tensordict


class ObservationModule(torch.nn.Module):
    """Wraps a plain module reading observations by argument name and writing the action key(s)."""

    def __init__(self, module: torch.nn.Module, in_keys: Sequence[NestedKey], out_keys: Sequence[NestedKey]):
        super().__init__()
        self.module = module
        self.in_keys = [unravel_key(k) for k in in_keys]
        self.out_keys = [unravel_key(k) for k in out_keys]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        outputs = self.module(*(tensordict.get(k) for k in self.in_keys))
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        for key, value in zip(self.out_keys, outputs):
            tensordict.set(key, value)
        return tensordict


def _forward_parameters(module: torch.nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def _takes_tensordict(params: list[inspect.Parameter]) -> bool:
    if len(params) != 1:
        return False
    param = params[0]
    annotation = param.annotation
    if isinstance(annotation, str):
        return "TensorDict" in annotation
    if isinstance(annotation, type) and issubclass(annotation, TensorDictBase):
        return True
    return param.name in ("tensordict", "td")


def wrap_policy(policy: Any, env, trust_policy: bool | None = None) -> Callable:
    """The callable the rollout runs for ``policy`` on ``env`` (docs/collection.md, "Policies").

    Raises:
        TypeError: for a module whose inputs cannot be matched to observations.
        RuntimeError: for a plain module that defines ``in_keys``/``out_keys``.
    """
    if policy is None:
        return RandomPolicy(env.full_action_spec)
    if _has_static_member(policy, "set_action_spec_from_env"):
        # a spec-less random policy (ours or TorchRL's) takes the env's, as TorchRL's collectors do
        policy.set_action_spec_from_env(env)
    if trust_policy is None:
        trust_policy = isinstance(policy, RandomPolicy)
    if trust_policy or isinstance(policy, (TensorDictModuleBase, ObservationModule, RandomPolicy)):
        return policy
    if not isinstance(policy, torch.nn.Module):
        if not callable(policy):
            raise TypeError(f"policy must be callable, got {type(policy).__name__}")
        return policy
    if hasattr(policy, "in_keys") or hasattr(policy, "out_keys"):
        raise RuntimeError(
            f"{type(policy).__name__} defines in_keys/out_keys but is not a TensorDictModule: wrap it in "
            "tensordict.nn.TensorDictModule, or pass trust_policy=True."
        )
    params = [p for p in _forward_parameters(policy) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if _takes_tensordict(params):
        return policy
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    observation_names = {k if isinstance(k, str) else k[-1]: k for k in _observation_keys(env)}
    if all(name in observation_names for name in required):
        action_keys = [unravel_key(k) for k in env.action_keys]
        return ObservationModule(
            policy, [observation_names[n] for n in required], action_keys + [f"output{i}" for i in range(2, 10)]
        )
    raise TypeError(
        f"Cannot tell how to call {type(policy).__name__}: its forward arguments {required} are not all "
        f"observation keys {sorted(observation_names)}. Wrap it in a TensorDictModule, or pass "
        "trust_policy=True if it reads and writes a TensorDict."
    )


def _has_static_member(obj: Any, name: str) -> bool:
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True


def _observation_keys(env) -> list[NestedKey]:
    spec = env_attr(env, "observation_spec")
    if spec is None:
        return []
    return [unravel_key(k) for k in spec.keys(True, True)]


def policy_device_copy(policy: Any, device: torch.device | None) -> tuple[Any, Any]:
    """``(policy_to_run, weight_source)``: a copy on ``device`` if the parameters live elsewhere."""
    if device is None or not isinstance(policy, torch.nn.Module):
        return policy, policy
    tensors = list(policy.parameters()) + list(policy.buffers())
    if not tensors or all(t.device == device for t in tensors) or any(t.is_meta for t in tensors):
        # meta tensors: a stateless worker copy, which its weight-sync scheme materialises
        return policy, policy
    return copy.deepcopy(policy).to(device), policy


# ---------------------------------------------------------------------------------------------- fast path
def hooks_would_run(modules: tuple) -> bool:
    """Whether calling any of ``modules`` would run a hook: its own forward or backward (pre-)hooks, or
    torch's global module hooks (``register_module_forward_hook``...). The checks ``nn.Module.__call__``
    makes, read from plain dicts: ~0.3 us for one module, the globals included."""
    hooks = _torch_module
    if (hooks._global_forward_pre_hooks or hooks._global_forward_hooks or hooks._global_backward_pre_hooks
            or hooks._global_backward_hooks):
        return True
    for module in modules:
        if module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks:
            return True
    return False


class PolicyStep:
    """Computes a step's policy outputs from the step's root values (``{key: value}``)."""

    #: keys this step writes (the action keys at least)
    out_keys: list[NestedKey]
    #: the user's modules a fast step calls past (``TensorModuleStep`` calls what they wrap), and the
    #: step that calls them instead: taken for every step in which one of them has a hook
    bypassed: tuple = ()
    general: PolicyStep | None = None

    def __call__(self, root: dict) -> dict:
        raise NotImplementedError


class TensorModuleStep(PolicyStep):
    """Calls key-to-key stages directly on tensors: no TensorDict per step.

    Hooks are checked before every step (:func:`hooks_would_run` on ``bypassed``): a hook added to the
    policy during a run, even within a batch, runs from the next step on; that step and every one while
    a hook is there go through ``general``, which calls the policy itself.
    """

    def __init__(self, stages: list[tuple[Callable, list, list]], device: torch.device | None,
                 bypassed: tuple = (), general: PolicyStep | None = None):
        if bypassed and general is None:
            raise ValueError("a TensorModuleStep that calls past modules needs the general step that calls them")
        self.device = device
        self.bypassed, self.general = bypassed, general
        self.stages = stages
        produced: list = []
        for _, _, outs in stages:
            produced += [k for k in outs if k not in produced]
        self.out_keys = produced

    @property
    def stages(self) -> list[tuple[Callable, list, list]]:
        """``(module, in_keys, out_keys)`` of each key-to-key stage, run in order."""
        return self._stages

    @stages.setter
    def stages(self, stages: list[tuple[Callable, list, list]]) -> None:
        self._stages = stages
        # One module reading one key, on the device the values are on: the usual policy, called with
        # nothing around it (every step pays for what this call does besides the module).
        one = len(stages) == 1 and len(stages[0][1]) == 1 and self.device is None
        self._one = (stages[0][0], stages[0][1][0], stages[0][2]) if one else None

    def __call__(self, root: dict) -> dict:
        if self.bypassed and hooks_would_run(self.bypassed):
            return self.general(root)
        one = self._one
        if one is not None:
            result = one[0](root[one[1]])
            if isinstance(result, torch.Tensor):
                return {one[2][0]: result}
            return dict(zip(one[2], result))
        return self._call_stages(root)

    def _call_stages(self, root: dict) -> dict:
        values = dict(root) if len(self.stages) > 1 else root
        outputs: dict = {}
        device = self.device
        for module, in_keys, out_keys in self.stages:
            args = [values[k] for k in in_keys]
            if device is not None:
                args = [a.to(device, non_blocking=True) if a.device != device else a for a in args]
            result = module(*args)
            if isinstance(result, torch.Tensor):
                outputs[out_keys[0]] = result
                if len(self.stages) > 1:
                    values[out_keys[0]] = result
            else:
                for key, value in zip(out_keys, result):
                    outputs[key] = value
                    if len(self.stages) > 1:
                        values[key] = value
        return outputs


def step_leaves(td: TensorDictBase) -> dict:
    return _step_leaves(td)


class TensorDictStep(PolicyStep):
    """The general path: build a TensorDict of the step's root values and call the policy on it."""

    def __init__(self, policy: Callable, batch_size, device, action_keys: list[NestedKey]):
        self.policy = policy
        self.batch_size = torch.Size(batch_size)
        self.device = device
        self.action_keys = action_keys
        self.out_keys: list[NestedKey] | None = None

    def __call__(self, root: dict) -> dict:
        td = TensorDict(root, batch_size=self.batch_size, device=self.device)
        before = step_leaves(td) if self.out_keys is None else None
        result = self.policy(td)
        result = td if result is None else result
        if self.out_keys is None:
            self.out_keys = self._written_keys(before, step_leaves(result))
        return {k: result.get(k) for k in self.out_keys}

    def _written_keys(self, before: dict, after: dict) -> list[NestedKey]:
        """What the policy wrote: new or replaced entries, and the action keys. An action inside an
        entry kept whole (a heterogeneous sub-TensorDict) makes that whole entry an output."""
        written = [k for k, v in after.items() if k not in before or v is not before[k]]
        for action in self.action_keys:
            action_path = as_tuple_key(action)
            owner = next((k for k in after if as_tuple_key(k) == action_path[:len(as_tuple_key(k))]), None)
            if owner is not None and owner not in written:
                written.append(owner)
        return written


class RandomStep(PolicyStep):
    """Random actions from the env's action spec (init_random_frames, policy=None, a ``RandomPolicy``).

    A user's ``RandomPolicy`` is checked for hooks before every step, as :class:`TensorModuleStep` does.
    """

    def __init__(self, env, random_policy: RandomPolicy | None = None, general: PolicyStep | None = None):
        self.env = env
        self.random_policy = random_policy or RandomPolicy(env.full_action_spec)
        self.out_keys = [unravel_key(k) for k in env.action_keys]
        if general is not None:
            self.bypassed, self.general = (self.random_policy,), general

    def __call__(self, root: dict) -> dict:
        if self.bypassed and hooks_would_run(self.bypassed):
            return self.general(root)
        return self.random_policy.sample()


def _plain_tdmodule_stage(module) -> tuple | None:
    if type(module) is not TensorDictModule:
        return None
    if getattr(module, "_kwargs", None) or getattr(module, "out_to_in_map", False):
        return None
    if not isinstance(module.in_keys, list) or getattr(module, "method", None) not in (None, "forward"):
        return None
    if getattr(module, "method_kwargs", None) or getattr(module, "strict", False):
        return None
    in_keys = [unravel_key(k) for k in module.in_keys]
    out_keys = [unravel_key(k) for k in module.out_keys]
    return module.module, in_keys, out_keys


def _bypassed(policy) -> tuple:
    """The modules a fast step would call past for ``policy``: the wrappers whose ``__call__`` it skips."""
    if type(policy) is TensorDictSequential:
        return (policy, *policy.module)
    return (policy,) if isinstance(policy, torch.nn.Module) else ()


def _stages_of(policy) -> list[tuple] | None:
    if isinstance(policy, ObservationModule):
        return [(policy.module, policy.in_keys, policy.out_keys)]
    stage = _plain_tdmodule_stage(policy)
    if stage is not None:
        return [stage]
    if type(policy) is TensorDictSequential and not getattr(policy, "partial_tolerant", False):
        if getattr(policy, "selected_out_keys", None):
            return None
        stages = [_plain_tdmodule_stage(m) for m in policy.module]
        return stages if all(s is not None for s in stages) else None
    return None


def make_policy_step(policy: Callable, env, root_keys: set, device: torch.device | None) -> PolicyStep:
    """The fastest :class:`PolicyStep` that computes exactly what ``policy`` would.

    A policy that already is a :class:`PolicyStep` (rlharvest's inference client, whose policy runs
    elsewhere) is used as it is. A fast step (:class:`TensorModuleStep`, :class:`RandomStep`) looks for
    hooks on the modules it calls past before every step: one added during a run runs from the next
    step on, through a :class:`TensorDictStep` of ``policy``; one there from the start means no fast step.
    """
    if isinstance(policy, PolicyStep):
        return policy
    general = TensorDictStep(policy, env.batch_size, device, [unravel_key(k) for k in env.action_keys])
    bypassed = _bypassed(policy)
    if bypassed and hooks_would_run(bypassed):
        return general  # the hooks' outputs are found on the first step, as any policy's
    if type(policy) is RandomPolicy:  # a subclass's forward is the user's
        step = RandomStep(env, policy, general)
    else:
        stages = _stages_of(policy)
        available = set(root_keys)
        for _, in_keys, out_keys in stages or ():
            if not set(in_keys) <= available:
                return general
            available |= set(out_keys)
        if stages is None:
            return general
        step = TensorModuleStep(stages, device, bypassed, general)
    general.out_keys = list(step.out_keys)  # a hook added later changes values, not the batch's layout
    return step


class WeakPolicyRef:
    """A weak reference to a module (or a strong one to anything that cannot be weakly referenced)."""

    def __init__(self, obj: Any) -> None:
        try:
            self._ref = weakref.ref(obj)
            self._strong = None
        except TypeError:
            self._ref, self._strong = None, obj

    def __call__(self) -> Any:
        return self._ref() if self._ref is not None else self._strong
