"""Loss landscapes: level sets of ``s -> loss(s, y)`` over the scaled 2-simplex, L = 3 classes.

The figures of [Gar23] ch. 4 (= [GSJS22]), drawn from the registered losses themselves, no
training:

- ``fig1``: [Gar23] Fig. 4.1 / [GSJS22] Fig. 1, K = 2, y = 3: the 0/1 top-K error, CE, the
  Lapin, calibrated and convex hinges, the smoothed hinge of [BZK18] at two tau, the noised
  balanced hinge at two epsilon, the noised imbalanced hinge;
- ``fig6``: [Gar23] Fig. 4.6 / [GSJS22] Fig. 6, the same panels with K = 1, y = 2;
- ``fig4``: [Gar23] Fig. 4.4 / [GSJS22] Fig. 4, effect of M on the noised balanced hinge
  (epsilon = 1), K = 1 (top row) and K = 2 (bottom row);
- ``fig5``: [Gar23] Fig. 4.5 / [GSJS22] Fig. 5, effect of epsilon with M = 50, same rows.

As in the papers: the scores run over ``2 * Delta^2`` (s >= 0, s_1 + s_2 + s_3 = 2), the true
class at the top vertex; every panel is min-max rescaled to [0, 1]; the losses are
"harmonized to display a margin equal to 1" (the hinges and the smooth SVM have margin 1; the
imbalanced hinge gets ``max_margin = 1``, ``scale = 1`` and equal class counts, so its margin
is 1 for every class); the noised losses of Fig. 4.1/4.6 are averaged over 100 replications
(each a fresh draw of the M noise vectors, shared by every point of the grid, from a fixed
seed: the same draws for every panel). The parameter values of
the panels are not printed in the papers; the ones here are the papers' training settings
(tau in {0.1, 1}, epsilon in {0.2, 1}, M = 10) or, for Fig. 4.4/4.5, spread over the range the
papers discuss; Fig. 4.4/4.5 show one draw (no averaging), which is what M and epsilon act on.

Any registered loss that takes one score vector and a class index can be drawn
(``--loss NAME --param epsilon=0.1,1.0``: one panel per combination of the listed values);
``topk_error`` is the 0/1 top-K loss ``1{s_[K] > s_y}`` of [Gar23] eq. 4.3, which is a metric,
not a registered loss.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from setvalued.losses.parameters import CONTEXT_KEYS, LOSS_PARAMETERS
from setvalued.params import Param, ParameterError, check_parameters

__all__ = [
    "Panel",
    "Landscape",
    "FIGURES",
    "TOPK_ERROR",
    "LandscapeError",
    "figure_panels",
    "custom_panels",
    "parse_param",
    "simplex_grid",
    "draws_noise",
    "evaluate",
    "rescale",
    "compute",
    "draw",
    "figure_size_px",
]

NUM_CLASSES = 3
#: the simplex is scaled by this ([Gar23] Fig. 4.1: s in 2 * Delta^2)
SIMPLEX_SCALE = 2.0
#: the 0/1 top-K loss, drawn beside the registered losses (its k is declared as the hinges' k)
TOPK_ERROR = "topk_error"
TOPK_ERROR_PARAMETERS = {"k": LOSS_PARAMETERS["hinge_topk"]["k"]}
#: the settings that make every loss's margin 1 on three classes of equal size
HARMONIZED = {"noised_topk_imbalanced": {"max_margin": 1.0, "scale": 1.0}}
OUTPUT_SUFFIXES = (".png", ".svg", ".pdf")
#: inches per panel and dots per inch of the drawing (a PNG is columns * 240 by rows * 230 + 40 px)
PANEL_WIDTH_IN, PANEL_HEIGHT_IN, TITLE_HEIGHT_IN, DPI = 2.4, 2.3, 0.4, 100


class LandscapeError(ValueError):
    """A bad option of the landscape command: the message names the option and what it accepts."""


@dataclass(frozen=True)
class Panel:
    """One level-set plot: a loss (registry name or ``topk_error``) with its parameters."""

    title: str
    loss: str
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FigurePreset:
    caption: str
    panels: tuple[Panel, ...]
    columns: int
    target: int  # the true class, 1-based as in the captions
    replications: int  # noise draws averaged for the noised losses


def _hinge_panels(k: int) -> tuple[Panel, ...]:
    """The ten panels of [Gar23] Fig. 4.1 (a)-(j) for one K."""
    return (
        Panel(f"(a) top-{k} error", TOPK_ERROR, {"k": k}),
        Panel("(b) cross-entropy", "ce"),
        Panel("(c) Lapin hinge", "hinge_topk", {"k": k}),
        Panel("(d) calibrated hinge", "calibrated_hinge_topk", {"k": k}),
        Panel("(e) convex hinge", "cvx_hinge_topk", {"k": k}),
        Panel("(f) smoothed hinge τ=1", "smooth_topk_svm", {"k": k, "tau": 1.0}),
        Panel("(g) smoothed hinge τ=0.1", "smooth_topk_svm", {"k": k, "tau": 0.1}),
        Panel("(h) noised bal. ε=1", "noised_topk", {"k": k, "epsilon": 1.0, "n_samples": 10}),
        Panel("(i) noised bal. ε=0.2", "noised_topk", {"k": k, "epsilon": 0.2, "n_samples": 10}),
        Panel("(j) noised imbal. ε=0.2", "noised_topk_imbalanced", {"k": k, "epsilon": 0.2, "n_samples": 10}),
    )


_SAMPLE_COUNTS = (1, 3, 10, 50)
_EPSILONS = (0.01, 0.1, 1.0, 10.0)

FIGURES: dict[str, FigurePreset] = {
    "fig1": FigurePreset(
        "[Gar23] Fig. 4.1 / [GSJS22] Fig. 1: L = 3, K = 2, y = 3",
        _hinge_panels(2),
        columns=5,
        target=3,
        replications=100,
    ),
    "fig6": FigurePreset(
        "[Gar23] Fig. 4.6 / [GSJS22] Fig. 6: L = 3, K = 1, y = 2",
        _hinge_panels(1),
        columns=5,
        target=2,
        replications=100,
    ),
    "fig4": FigurePreset(
        "[Gar23] Fig. 4.4 / [GSJS22] Fig. 4: effect of M on the noised balanced hinge, ε = 1 "
        "(top K = 1, bottom K = 2; one draw)",
        tuple(
            Panel(f"K={k}, M={m}", "noised_topk", {"k": k, "epsilon": 1.0, "n_samples": m})
            for k in (1, 2)
            for m in _SAMPLE_COUNTS
        ),
        columns=len(_SAMPLE_COUNTS),
        target=3,
        replications=1,
    ),
    "fig5": FigurePreset(
        "[Gar23] Fig. 4.5 / [GSJS22] Fig. 5: effect of ε on the noised balanced hinge, M = 50 "
        "(top K = 1, bottom K = 2; one draw)",
        tuple(
            Panel(f"K={k}, ε={eps:g}", "noised_topk", {"k": k, "epsilon": eps, "n_samples": 50})
            for k in (1, 2)
            for eps in _EPSILONS
        ),
        columns=len(_EPSILONS),
        target=3,
        replications=1,
    ),
}


# ----------------------------------------------------------------------------------------
# options: which panels
# ----------------------------------------------------------------------------------------


def _declared(loss: str) -> dict[str, Param]:
    if loss == TOPK_ERROR:
        return TOPK_ERROR_PARAMETERS
    from setvalued.registry import entries  # the built-ins and the installed plugins

    losses = entries("loss")
    if loss not in losses:
        raise LandscapeError(
            f"--loss: unknown loss {loss!r}; expected one of: {', '.join(sorted([*losses, TOPK_ERROR]))}"
        )
    return dict(losses[loss].parameters)


def _parse_value(param: Param, text: str) -> Any:
    """One value of ``--param`` as its declared type (the declaration then checks its range)."""
    text = text.strip()
    if param.type == "int":
        try:
            return int(text)
        except ValueError:
            return text
    if param.type == "float":
        try:
            return float(text)
        except ValueError:
            return text
    if param.type == "bool":
        return {"true": True, "false": False}.get(text.lower(), text)
    return text


def parse_param(loss: str, option: str) -> tuple[str, list]:
    """``"epsilon=0.1,1.0"`` -> ``("epsilon", [0.1, 1.0])``, each value checked by its declaration."""
    declared = _declared(loss)
    name, sep, values = option.partition("=")
    name = name.strip()
    if not sep or not name or not values.strip():
        raise LandscapeError(f"--param {option!r}: expected NAME=VALUE[,VALUE...], e.g. epsilon=0.1,1.0")
    if name not in declared:
        raise LandscapeError(
            f"--param {option!r}: loss {loss!r} has no parameter {name!r}; accepted: {', '.join(declared) or '(none)'}"
        )
    checked = []
    for text in values.split(","):
        try:
            checked.append(declared[name].check(name, _parse_value(declared[name], text), owner=loss))
        except ParameterError as error:
            raise LandscapeError(f"--param {option!r}: {error}") from None
    return name, checked


def custom_panels(loss: str, options: Sequence[str]) -> tuple[Panel, ...]:
    """One panel per combination of the values of ``--param NAME=V1,V2`` options."""
    _declared(loss)
    grid: dict[str, list] = {}
    for option in options:
        name, values = parse_param(loss, option)
        if name in grid:
            raise LandscapeError(f"--param {name} given twice; list its values once: {name}=V1,V2")
        grid[name] = values
    panels = []
    for combination in itertools.product(*grid.values()):
        params = dict(zip(grid, combination))
        label = ", ".join(
            f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}" for name, value in params.items()
        )
        panels.append(Panel(f"{loss} {label}".strip(), loss, params))
    return tuple(panels)


def figure_panels(name: str) -> FigurePreset:
    try:
        return FIGURES[name]
    except KeyError:
        raise LandscapeError(f"--figure: unknown figure {name!r}; expected one of: {', '.join(FIGURES)}") from None


def _build(panel: Panel):
    """The loss module of a panel (None for the 0/1 error), its parameters checked."""
    if panel.loss == TOPK_ERROR:
        params = check_parameters(TOPK_ERROR_PARAMETERS, panel.params, owner=TOPK_ERROR)
        if params["k"] > NUM_CLASSES - 1:
            raise LandscapeError(
                f"{TOPK_ERROR}: k must be <= {NUM_CLASSES - 1} on {NUM_CLASSES} classes, got {params['k']}"
            )
        return None
    from setvalued.losses import LOSSES, build_loss, loss_parameters
    from setvalued.registry import PluginError

    _declared(panel.loss)  # raises, naming the losses
    try:
        loss_parameters(panel.loss)  # a plugin's class is registered on first use
    except PluginError as error:
        raise LandscapeError(f"--loss: {error}") from None
    cls = LOSSES.get(panel.loss)
    if cls is None:
        raise LandscapeError(f"--loss: {panel.loss!r} is declared but not registered")
    if cls.head == "two_head" or cls.requires_indices:
        why = "two heads" if cls.head == "two_head" else "the training-set indices of the batch"
        raise LandscapeError(f"--loss: {panel.loss!r} cannot be drawn over one score vector: it needs {why}")
    params = {**HARMONIZED.get(panel.loss, {}), **panel.params}
    context = dict(zip(CONTEXT_KEYS, ([1] * NUM_CLASSES, NUM_CLASSES, NUM_CLASSES)))
    try:
        return build_loss(panel.loss, reduction="none", **params, **context)
    except ValueError as error:
        raise LandscapeError(f"{panel.title}: {error}") from None


# ----------------------------------------------------------------------------------------
# the values
# ----------------------------------------------------------------------------------------


@dataclass
class Landscape:
    """One panel's values: ``points`` (P, 3) scores on the scaled simplex, ``values`` the raw
    losses there, ``scaled`` the same min-max rescaled to [0, 1]."""

    panel: Panel
    points: Any
    values: Any
    scaled: Any


def simplex_grid(resolution: int, scale: float = SIMPLEX_SCALE):
    """Every ``scale * (i, j, resolution - i - j) / resolution``: (P, 3) float64, P = (r+1)(r+2)/2."""
    import torch

    rows = [(i, j, resolution - i - j) for i in range(resolution + 1) for j in range(resolution + 1 - i)]
    return torch.tensor(rows, dtype=torch.float64) * (scale / resolution)


def topk_error(scores, targets, k: int):
    """The 0/1 top-K loss ``1{s_[k] > s_y}`` ([Gar23] eq. 4.3): ties count as correct."""
    kth = scores.topk(k, dim=1).values[:, -1]
    return (kth > scores.gather(1, targets.unsqueeze(1)).squeeze(1)).to(scores.dtype)


def draws_noise(loss) -> bool:
    """Whether a loss draws noise that a caller may fix (its ``per_sample`` takes ``noise``)."""
    per_sample = getattr(loss, "per_sample", None)
    return per_sample is not None and "noise" in inspect.signature(per_sample).parameters


def evaluate(panel: Panel, points, target: int, replications: int = 1, seed: int = 0):
    """The loss of ``panel`` at each row of ``points`` (P, 3) for the 0-based class ``target``.

    A loss that draws noise is averaged over ``replications`` draws of its M noise vectors
    (from ``seed``, without touching the global random state); within a replication every
    point gets the same draws, so each replication is a continuous function of the scores and
    the level sets have no meshing noise ([Gar23] Fig. 4.1 averages 100 replications to avoid
    "meshing artifacts").
    """
    import torch

    loss = _build(panel)
    targets = torch.full((points.shape[0],), target, dtype=torch.long)
    if loss is None:
        return topk_error(points, targets, panel.params.get("k", TOPK_ERROR_PARAMETERS["k"].default))
    with torch.no_grad():
        if not draws_noise(loss):
            return loss(points, targets).double()
        generator = torch.Generator().manual_seed(seed)
        total = torch.zeros(points.shape[0], dtype=torch.float64)
        for _ in range(replications):
            noise = torch.randn(loss.n_samples, NUM_CLASSES, generator=generator, dtype=torch.float64)
            total += loss.per_sample(points, targets, noise=noise.expand(points.shape[0], -1, -1)).double()
    return total / replications


def rescale(values):
    """Min-max rescaled to [0, 1]; a constant panel is all 0."""
    low, high = values.min(), values.max()
    if high <= low:
        return values * 0.0
    return (values - low) / (high - low)


def compute(
    panels: Sequence[Panel], target: int, resolution: int = 100, replications: int = 100, seed: int = 0
) -> list[Landscape]:
    """Every panel's values on the same grid; ``target`` is 1-based as in the papers' captions."""
    for panel in panels:  # every panel's loss and parameters checked before anything is computed
        _build(panel)
    points = simplex_grid(resolution)
    out = []
    for panel in panels:
        values = evaluate(panel, points, target - 1, replications, seed)
        out.append(Landscape(panel, points, values, rescale(values)))
    return out


# ----------------------------------------------------------------------------------------
# the drawing
# ----------------------------------------------------------------------------------------


def figure_size_px(count: int, columns: int) -> tuple[int, int]:
    """(width, height) in pixels of a drawing of ``count`` panels in ``columns`` columns."""
    columns = min(columns, count)
    rows = math.ceil(count / columns)
    return (round(columns * PANEL_WIDTH_IN * DPI), round((rows * PANEL_HEIGHT_IN + TITLE_HEIGHT_IN) * DPI))


def _plane(points, target: int):
    """2-D positions: the true class at the top vertex, the other two at the bottom corners."""
    others = [c for c in range(NUM_CLASSES) if c != target]
    weights = points / SIMPLEX_SCALE
    x = weights[:, others[1]] + 0.5 * weights[:, target]
    y = weights[:, target] * (math.sqrt(3) / 2)
    return x.numpy(), y.numpy(), others


def draw(landscapes: Sequence[Landscape], target: int, path: Path, title: str = "", columns: int = 5) -> Path:
    """Filled level sets of every panel (rescaled values, 20 levels) into ``path`` (.png, .svg or .pdf)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.tri as mtri
    import numpy as np

    width, height = figure_size_px(len(landscapes), columns)
    columns = min(columns, len(landscapes))
    rows = math.ceil(len(landscapes) / columns)
    figure = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    top = 1 - TITLE_HEIGHT_IN * DPI / height
    grid = figure.add_gridspec(rows, columns, left=0.02, right=0.98, bottom=0.02, top=top, hspace=0.25, wspace=0.08)
    levels = np.linspace(0.0, 1.0, 21)
    levels[-1] += 1e-9  # a filled band holds (low, high]: the maximum itself must fall inside one
    for index, landscape in enumerate(landscapes):
        axes = figure.add_subplot(grid[index // columns, index % columns])
        x, y, others = _plane(landscape.points, target - 1)
        triangulation = mtri.Triangulation(x, y)
        scaled = landscape.scaled.numpy()
        axes.tricontourf(triangulation, scaled, levels=levels, cmap="viridis", vmin=0.0, vmax=1.0)
        if len(np.unique(scaled)) > 2:  # level lines; a step (the 0/1 error) would crowd them on its edge
            axes.tricontour(triangulation, scaled, levels=levels[1:-1:2], colors="white", linewidths=0.3)
        axes.plot([0, 1, 0.5, 0], [0, 0, math.sqrt(3) / 2, 0], color="black", linewidth=0.6)
        axes.text(0.5, math.sqrt(3) / 2 + 0.03, f"y={target}", ha="center", va="bottom", color="red", fontsize=7)
        axes.text(0.0, -0.03, str(others[0] + 1), ha="center", va="top", fontsize=7)
        axes.text(1.0, -0.03, str(others[1] + 1), ha="center", va="top", fontsize=7)
        title_text = landscape.panel.title
        if float(landscape.values.max()) == float(landscape.values.min()):  # nothing to see: say so
            title_text += f" (constant {float(landscape.values.min()):.3g})"
        axes.set_title(title_text, fontsize=8)
        axes.set_xlim(-0.08, 1.08)
        axes.set_ylim(-0.12, math.sqrt(3) / 2 + 0.14)
        axes.set_aspect("equal")
        axes.axis("off")
    if title:
        figure.suptitle(title, fontsize=9, y=1 - 0.1 * TITLE_HEIGHT_IN * DPI / height, va="top")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


# ----------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------


def _check_count(option: str, value: int, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LandscapeError(f"{option} must be an integer in [{low}, {high}], got {value!r}")
    return value


def render(
    figure: str | None = None,
    loss: str | None = None,
    params: Sequence[str] = (),
    out: str | Path | None = None,
    target: int | None = None,
    resolution: int = 100,
    replications: int | None = None,
    seed: int = 0,
    columns: int | None = None,
) -> Path:
    """What ``studies landscape`` does: check the options, compute every panel, draw, return the path.

    ``figure`` names a preset of :data:`FIGURES` (default ``fig1``); ``loss`` with ``params``
    (``"epsilon=0.1,1.0"``) draws one loss instead. ``target`` is the true class, 1-based
    (default: the figure's, else 3); ``replications`` the noise draws averaged per point
    (default: the figure's, else 100).
    """
    if figure is not None and loss is not None:
        raise LandscapeError("--figure and --loss exclude each other: draw a paper's figure or one loss")
    if params and loss is None:
        raise LandscapeError("--param needs --loss (the figures fix their own parameters)")
    if loss is not None:
        panels = custom_panels(loss, params)
        preset = None
        title = f"{loss} on 2·Δ², L = {NUM_CLASSES}"
    else:
        preset = figure_panels(figure or "fig1")
        panels, title = preset.panels, preset.caption
    target = _check_count(
        "--target", target if target is not None else (preset.target if preset else 3), 1, NUM_CLASSES
    )
    resolution = _check_count("--resolution", resolution, 2, 1000)
    replications = _check_count(
        "--replications",
        replications if replications is not None else (preset.replications if preset else 100),
        1,
        10000,
    )
    columns = _check_count("--columns", columns if columns is not None else (preset.columns if preset else 4), 1, 50)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise LandscapeError(f"--seed must be an integer, got {seed!r}")
    path = Path(out) if out is not None else Path(f"landscape_{figure or loss or 'fig1'}.png")
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise LandscapeError(f"--out {str(path)!r}: the file must end in one of {', '.join(OUTPUT_SUFFIXES)}")
    landscapes = compute(panels, target, resolution, replications, seed)
    return draw(landscapes, target, path, title=title, columns=columns)
