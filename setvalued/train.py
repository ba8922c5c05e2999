"""The stable import path of the trainer: ``setvalued.train.fit(config, seed, ...)`` is what
scripts, plugins, the GPU check and docs/interfaces.md (section 4) name. The trainer itself is
the ``setvalued.training`` package."""

from setvalued.training import DEFAULT_CONFIG, NonFiniteLossError, Trial, fit, probe, resolve_config

__all__ = ["DEFAULT_CONFIG", "NonFiniteLossError", "Trial", "fit", "probe", "resolve_config"]
