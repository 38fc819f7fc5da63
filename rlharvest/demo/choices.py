"""What ``rlharvest demo`` lets one choose, without importing torch: the CLI builds its parser from
these (``rlharvest --help`` stays quick), ``run.py`` runs with them."""

__all__ = ["COLLECTORS", "DEFAULT_FRAMES", "TARGET_RETURN"]

#: the collectors the demo can gather its experience with (``--collector``)
COLLECTORS = ("single", "multisync", "multiasync", "distributed", "rpc")
#: default frame budget: an upper bound (training stops as soon as the target is reached)
DEFAULT_FRAMES = 100_000
#: CartPole-v1 counts as solved once the mean return of the last 20 episodes reaches it
TARGET_RETURN = 475.0
