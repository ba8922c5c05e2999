"""The design blocks of a study file: how the configs of a study are chosen.

``grid`` (cartesian product), ``sensitivity`` (one parameter at a time), ``random`` and
``optuna`` (sampled from a :class:`Distribution` per parameter) and ``single`` (the variants as
they are). Each block addresses the trial config by dotted paths (``loss.epsilon``);
``studies.studyfile.configs`` builds the configs a block describes.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from studies.studyfile.schema import StrictModel

__all__ = [
    "Distribution",
    "GridBlock",
    "SensitivityBlock",
    "RandomBlock",
    "OptunaBlock",
    "SingleBlock",
    "DesignBlock",
    "BLOCK_CLASSES",
    "DOTTED_PATH",
]

#: a dotted config path such as loss.epsilon
DOTTED_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class Distribution(StrictModel):
    """One sampled parameter of a random/optuna block: exactly one of the four keys.

    ``uniform: [low, high]``, ``loguniform: [low, high]`` (low > 0), ``int: [low, high]``
    (both included), ``choice: [v1, v2, ...]``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    uniform: list[float] | None = None
    loguniform: list[float] | None = None
    integer: list[Annotated[int, Field(strict=True)]] | None = Field(None, alias="int")
    choice: list[Any] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Distribution:
        given = [k for k in ("uniform", "loguniform", "int", "choice") if self._get(k) is not None]
        if len(given) != 1:
            raise ValueError(
                "expected exactly one of uniform: [low, high], loguniform: [low, high], "
                f"int: [low, high], choice: [values...]; got {given or 'none'}"
            )
        kind = given[0]
        values = self._get(kind)
        if kind == "choice":
            if not values:
                raise ValueError("choice needs at least one value")
            return self
        if len(values) != 2:
            raise ValueError(f"{kind} needs [low, high], got {values}")
        low, high = values
        if not low < high:
            raise ValueError(f"{kind} needs low < high, got [{low}, {high}]")
        if kind == "loguniform" and low <= 0:
            raise ValueError(f"loguniform needs 0 < low < high, got [{low}, {high}]")
        return self

    def _get(self, kind: str) -> Any:
        return self.integer if kind == "int" else getattr(self, kind)

    @property
    def kind(self) -> str:
        """uniform, loguniform, int or choice."""
        return next(k for k in ("uniform", "loguniform", "int", "choice") if self._get(k) is not None)

    @property
    def bounds(self) -> list[Any]:
        """[low, high] or the list of choices."""
        return self._get(self.kind)

    def corner_values(self) -> list[Any]:
        """Values checked at load time: both bounds, or every choice."""
        return list(self.bounds)


class BlockBase(StrictModel):
    """What every design block has: the variants it applies to (default: all)."""

    variants: list[str] | None = Field(None, min_length=1)

    @field_validator("parameters", check_fields=False)
    @classmethod
    def _dotted_paths(cls, parameters: dict[str, Any]) -> dict[str, Any]:
        return _check_paths(parameters)

    def configs_per_variant(self) -> int:
        """How many configs the block gives each of its variants, computed from its sizes
        alone (nothing is expanded): the bound that is checked before the design is built."""
        raise NotImplementedError

    @property
    def parameter_paths(self) -> list[str]:
        return list(getattr(self, "parameters", {}) or {})


def _check_paths(parameters: dict[str, Any]) -> dict[str, Any]:
    for path in parameters:
        if not re.match(DOTTED_PATH, path):
            raise ValueError(f"{path!r} is not a dotted config path such as loss.epsilon")
    return parameters


class GridBlock(BlockBase):
    """Cartesian product of the listed values, for every variant of the block."""

    kind: Literal["grid"]
    parameters: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(min_length=1)

    def configs_per_variant(self) -> int:
        return math.prod(len(values) for values in self.parameters.values())


class SensitivityBlock(BlockBase):
    """One parameter at a time around each variant's own value; the base config is one cell."""

    kind: Literal["sensitivity"]
    parameters: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(min_length=1)

    def configs_per_variant(self) -> int:
        return 1 + sum(len(values) for values in self.parameters.values())


class RandomBlock(BlockBase):
    """``n_configs`` configs sampled from the distributions, deterministic in ``sampler_seed``."""

    kind: Literal["random"]
    n_configs: int = Field(ge=1)
    parameters: dict[str, Distribution] = Field(min_length=1)
    sampler_seed: int = 0

    def configs_per_variant(self) -> int:
        return self.n_configs


class MedianPruner(StrictModel):
    """Optuna's ``MedianPruner``: a config stops when its seed mean at an epoch is worse than
    the median of the completed configs' means at that epoch."""

    kind: Literal["median"]
    n_startup_trials: int = Field(5, ge=0)
    n_warmup_steps: int = Field(0, ge=0)  # epochs done before any pruning
    interval_steps: int = Field(1, ge=1)
    n_min_trials: int = Field(1, ge=1)


class SuccessiveHalvingPruner(StrictModel):
    """Optuna's ``SuccessiveHalvingPruner`` (asynchronous successive halving) on the seed means."""

    kind: Literal["successive_halving"]
    min_resource: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"  # epochs
    reduction_factor: int = Field(4, ge=2)
    min_early_stopping_rate: int = Field(0, ge=0)


class HyperbandPruner(StrictModel):
    """Optuna's ``HyperbandPruner`` on the seed means."""

    kind: Literal["hyperband"]
    min_resource: int = Field(1, ge=1)  # epochs
    max_resource: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    reduction_factor: int = Field(3, ge=2)


Pruner = Annotated[MedianPruner | SuccessiveHalvingPruner | HyperbandPruner, Field(discriminator="kind")]
PRUNER_CLASSES = {"median": MedianPruner, "successive_halving": SuccessiveHalvingPruner, "hyperband": HyperbandPruner}


class OptunaBlock(BlockBase):
    """``n_configs`` proposals from an Optuna sampler; each runs on every seed (seed mean told).
    With a ``pruner``, Optuna's pruner gets each config's seed mean after every epoch as its
    intermediate value and may stop the config (all its seeds): the trial ends PRUNED."""

    kind: Literal["optuna"]
    n_configs: int = Field(ge=1)
    parameters: dict[str, Distribution] = Field(min_length=1)
    sampler: Literal["tpe", "random", "cmaes", "gp", "qmc"] = "tpe"
    sampler_seed: int | None = 0
    pruner: Pruner | None = None

    def configs_per_variant(self) -> int:
        return self.n_configs


class SingleBlock(BlockBase):
    """The variants as they are."""

    kind: Literal["single"]

    def configs_per_variant(self) -> int:
        return 1


DesignBlock = Annotated[
    GridBlock | SensitivityBlock | RandomBlock | OptunaBlock | SingleBlock, Field(discriminator="kind")
]
BLOCK_CLASSES = {
    "grid": GridBlock,
    "sensitivity": SensitivityBlock,
    "random": RandomBlock,
    "optuna": OptunaBlock,
    "single": SingleBlock,
}
