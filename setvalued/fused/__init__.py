"""Seeds fused into one model (issue 35): N trials of one config trained as one array.

- ``array``: ``fit_array`` and ``Array`` (the members, each the ``Trial`` of its seed; one step
  for all), ``fusion_problem``/``probe_config`` (the one-batch probe that refuses a model);
- ``step``: ``FusedStep``, the members' models stacked (``torch.func``) and one forward,
  backward and SGD step for all; ``RandomState``, a member's random state;
- ``running_metrics``: the members' training metrics folded at once.
"""

from setvalued.fused.array import STOP, Array, ArrayCallback, FusionError, fit_array, fusion_problem, probe_config
from setvalued.fused.running_metrics import FusedRunningMetrics
from setvalued.fused.step import FusedStep, RandomState

__all__ = [
    "STOP",
    "Array",
    "ArrayCallback",
    "FusedRunningMetrics",
    "FusedStep",
    "FusionError",
    "RandomState",
    "fit_array",
    "fusion_problem",
    "probe_config",
]
