"""The env transforms a TorchRL policy needs, and what a collector does about them
(``auto_register_policy_transforms``; docs/torchrl-compatibility.md, "TorchRL's next release").

TorchRL's recurrent modules (``LSTMModule``, ``GRUModule``, any module with a
``make_tensordict_primer()``) read an ``is_init`` flag, which an ``InitTracker`` transform writes,
and a recurrent state, which a ``TensorDictPrimer`` declares in the env's specs. rlharvest never
adds them unasked and never changes the env object it is given:

* ``True``: the collector steps a new ``TransformedEnv`` around the given env with the missing
  transforms appended (logged, by name); the given object is left as it was;
* ``None`` (the default, as in TorchRL 0.14 and its next release): nothing is appended; a
  ``FutureWarning`` names what is missing and the line that adds it;
* ``False``: nothing is appended, nothing said.

Without ``True``, a policy that reads ``is_init`` from an env that has none is refused when the
collector is built (a ``KeyError``, as TorchRL's first policy call raises), not at its first batch.
Only TorchRL objects are concerned: without ``torchrl`` imported, there is nothing to detect.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
import weakref
from typing import Any

import torch
from tensordict.nn import TensorDictModuleBase

from .._utils import as_tuple_key, user_stacklevel
from .factory import env_keys

__all__ = ["missing_policy_transforms", "env_for_policy", "appended_by_collector"]

logger = logging.getLogger(__name__)

#: the envs :func:`env_for_policy` built around a user's env, by ``id`` (any env, hashable or not, is
#: looked up by identity)
_WRAPPERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

INIT_KEY = "is_init"
#: what the user can write instead of asking the collector (TorchRL's public helper)
_ONE_LINE = ("env = env.append_transform(get_env_transforms_from_module(policy))  "
             "# from torchrl.modules.utils import get_env_transforms_from_module")


def _reads_init_flag(policy: torch.nn.Module) -> bool:
    """Whether a TensorDict module inside ``policy`` lists ``is_init`` among its inputs (a module that
    declares no ``in_keys``, such as a ``TensorDictModuleBase`` with its own ``__call__``, reads none we
    can know of)."""
    return any(as_tuple_key(key)[-1] == INIT_KEY for module in policy.modules()
               if isinstance(module, TensorDictModuleBase) for key in getattr(module, "in_keys", ()))


def _primers(policy: torch.nn.Module, transforms: Any) -> list:
    """The ``TensorDictPrimer`` transforms the modules of ``policy`` declare (TorchRL's helper)."""
    utils = importlib.import_module("torchrl.modules.utils")
    primer = utils.get_primers_from_module(policy, warn=False, strict=False)
    if primer is None:
        return []
    return list(primer) if isinstance(primer, transforms.Compose) else [primer]


def missing_policy_transforms(env: Any, policy: Any) -> list:
    """The transforms ``policy`` needs that ``env``'s specs lack: an ``InitTracker`` when a module reads
    ``is_init`` or declares a recurrent state, and each declared ``TensorDictPrimer`` whose keys the
    env does not have. Detection is by the specs, so an env that has them (inside a ``SerialEnv``
    too) needs nothing. Empty for a policy that is not an ``nn.Module``, or without TorchRL imported.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> missing_policy_transforms(CountingEnv(), torch.nn.Identity())
        []
    """
    if not isinstance(policy, torch.nn.Module) or "torchrl" not in sys.modules:
        return []
    transforms = importlib.import_module("torchrl.envs.transforms")
    keys = env_keys(env)
    primers = [primer for primer in _primers(policy, transforms)
               if not isinstance(primer, transforms.TensorDictPrimer)
               or not {as_tuple_key(key) for key in primer.primers.keys(True, True)} <= keys]
    needs_tracker = (primers or _reads_init_flag(policy)) and not _has_init_flag(keys)
    return [transforms.InitTracker(init_key=INIT_KEY)] * bool(needs_tracker) + primers


def _has_init_flag(keys: set) -> bool:
    """Whether one of the env's keys (tuples) is an ``is_init`` flag (nested ones too, per agent)."""
    return any(key[-1] == INIT_KEY for key in keys)


def _describe(transforms: list) -> str:
    names = []
    for transform in transforms:
        primed = getattr(transform, "primers", None)
        keys = f"({', '.join(map(str, primed.keys(True, True)))})" if primed is not None else ""
        names.append(type(transform).__name__ + keys)
    return ", ".join(names)


def _appended(env: Any, transforms: list, owner: str) -> Any:
    """A new ``TransformedEnv`` stepping ``env`` through ``transforms``; ``env`` itself is unchanged
    (TorchRL's ``append_transform`` would change a ``TransformedEnv`` in place)."""
    envs = importlib.import_module("torchrl.envs")
    if not isinstance(env, envs.EnvBase):
        raise ValueError(f"auto_register_policy_transforms=True: the policy needs {_describe(transforms)}, which are "
                         f"TorchRL transforms, but {owner}'s env is a {type(env).__name__}, not a TorchRL env. Build "
                         "the env with TorchRL, or give the policy what it reads some other way.")
    wrapper = envs.TransformedEnv(env, envs.Compose(*transforms), auto_unwrap=False)
    _WRAPPERS[id(wrapper)] = wrapper
    return wrapper


def appended_by_collector(env: Any) -> bool:
    """Whether ``env`` is a ``TransformedEnv`` that :func:`env_for_policy` built around a user's env
    (``env.base_env``), where TorchRL would have appended the transforms to the user's env itself.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> appended_by_collector(CountingEnv())
        False
    """
    return _WRAPPERS.get(id(env)) is env


def env_for_policy(auto_register: bool | None, env: Any, policy: Any, owner: str) -> Any:
    """The env a collector steps ``policy`` in: ``env``, or with ``auto_register=True`` a new
    ``TransformedEnv`` around it with the transforms the policy needs (:func:`missing_policy_transforms`).

    Raises:
        KeyError: without ``auto_register``, for a policy that reads ``is_init`` from an env without
            it (its first step would raise it), naming what to add.
        ValueError: with ``auto_register``, when the env is not a TorchRL env and needs transforms.
    """
    missing = missing_policy_transforms(env, policy)
    if not missing:
        return env
    names = _describe(missing)
    if auto_register:
        logger.info("%s: stepping the env with %s appended (auto_register_policy_transforms=True); the env object "
                    "given is unchanged.", owner, names)
        return _appended(env, missing, owner)
    if auto_register is None:
        warnings.warn(f"The env given to {owner} lacks transforms its policy needs ({names}). rlharvest does not add "
                      "them unasked: pass auto_register_policy_transforms=True to step a copy of your env with them "
                      f"appended (your env object stays as it is), or add them yourself: {_ONE_LINE}. "
                      "auto_register_policy_transforms=False silences this warning.",
                      FutureWarning, stacklevel=user_stacklevel())
    if _reads_init_flag(policy) and not _has_init_flag(env_keys(env)):
        raise KeyError(f"{owner}: the policy reads {INIT_KEY!r}, which the env does not have (its first step would "
                       f"fail). Pass auto_register_policy_transforms=True, or add the transforms: {_ONE_LINE}.")
    return env
