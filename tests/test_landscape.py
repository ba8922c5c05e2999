"""`studies landscape` (studies/landscape.py): the level sets are the registered losses' own
values, the 0/1 panel is the top-K error, and the command draws a file of the designed size
or refuses bad options by name."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from setvalued.losses import build_loss
from studies import landscape
from studies.cli import main
from studies.landscape import Panel


def _direct(panel: Panel, point, target: int) -> float:
    """The loss at one score vector, built and called here without the landscape code."""
    loss = build_loss(panel.loss, reduction="none", num_classes=3, class_counts=[1, 1, 1], **panel.params)
    return float(loss(torch.tensor([point], dtype=torch.float64), torch.tensor([target]))[0])


def test_the_grid_covers_the_scaled_simplex():
    points = landscape.simplex_grid(10)
    assert points.shape == (66, 3)  # (r + 1)(r + 2) / 2
    assert torch.allclose(points.sum(dim=1), torch.full((66,), 2.0, dtype=torch.float64))
    assert bool((points >= 0).all())
    corners = {tuple(row) for row in points.tolist() if max(row) == 2.0}
    assert corners == {(2.0, 0.0, 0.0), (0.0, 2.0, 0.0), (0.0, 0.0, 2.0)}


@pytest.mark.parametrize(
    "panel",
    [
        Panel("ce", "ce"),
        Panel("hinge", "hinge_topk", {"k": 2}),
        Panel("cvx", "cvx_hinge_topk", {"k": 1}),
        Panel("svm", "smooth_topk_svm", {"k": 2, "tau": 0.1}),
        Panel("focal", "focal", {"gamma": 2.0}),
    ],
    ids=lambda p: p.loss,
)
def test_grid_values_are_the_loss_evaluated_directly(panel):
    target = 2
    (result,) = landscape.compute([panel], target=target + 1, resolution=12, replications=1)
    for index in (0, 5, 40, 77, len(result.points) - 1):
        point = result.points[index].tolist()
        assert float(result.values[index]) == pytest.approx(_direct(panel, point, target), rel=1e-12, abs=1e-12)
    low, high = float(result.values.min()), float(result.values.max())
    assert float(result.scaled.min()) == 0.0 and float(result.scaled.max()) == pytest.approx(1.0)
    assert torch.allclose(result.scaled * (high - low) + low, result.values)


def test_imbalanced_hinge_is_harmonized_to_margin_one():
    """max_margin 1, scale 1, equal counts: at s = (0, 0, 2) with y = 1 the hinge is 1 + s_[K+1] - 0."""
    panel = Panel("imbal", "noised_topk_imbalanced", {"k": 1, "epsilon": 0.0})
    values = landscape.evaluate(
        panel, torch.tensor([[0.0, 0.0, 2.0], [1.0, 0.5, 0.5]], dtype=torch.float64), target=0, replications=3
    )
    assert values.tolist() == pytest.approx([1.0 + 0.0 - 0.0, 1.0 + 0.5 - 1.0])


def test_noised_values_average_replications_from_the_seed_and_leave_the_global_rng_alone():
    panel = Panel("noised", "noised_topk", {"k": 1, "epsilon": 0.5, "n_samples": 3})
    points = landscape.simplex_grid(6)
    state = torch.get_rng_state()
    first = landscape.evaluate(panel, points, target=2, replications=200, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, landscape.evaluate(panel, points, target=2, replications=200, seed=3))
    assert not torch.equal(first, landscape.evaluate(panel, points, target=2, replications=200, seed=4))
    # against the loss's own fresh draws (global RNG), averaged over many calls: the same mean
    loss = build_loss("noised_topk", k=1, epsilon=0.5, n_samples=3, reduction="none")
    for index in (0, 13, 27):
        rows = points[index].expand(10000, 3)
        direct = loss(rows, torch.full((10000,), 2)).double()  # one loss value per call of M draws
        standard_error = math.sqrt(float(direct.var()) * (1 / 10000 + 1 / 200))
        assert abs(float(first[index]) - float(direct.mean())) < 5 * standard_error + 1e-12


def test_noised_with_zero_epsilon_is_the_calibrated_hinge():
    points = landscape.simplex_grid(8)
    noised = landscape.evaluate(Panel("n", "noised_topk", {"k": 2, "epsilon": 0.0}), points, 2, replications=2)
    hinge = landscape.evaluate(Panel("c", "calibrated_hinge_topk", {"k": 2}), points, 2)
    assert torch.allclose(noised, hinge)


@pytest.mark.parametrize(
    "k, target, point, expected",
    [
        (2, 2, (0.0, 0.0, 2.0), 0.0),
        (2, 2, (1.0, 1.0, 0.0), 1.0),
        (2, 2, (1.2, 0.8, 0.0), 1.0),
        (2, 2, (2.0, 0.0, 0.0), 0.0),  # s_[2] = 0 = s_y: a tie is not an error
        (2, 2, (0.9, 0.3, 0.8), 0.0),
        (1, 1, (0.0, 2.0, 0.0), 0.0),
        (1, 1, (1.0, 1.0, 0.0), 0.0),  # tie at the top
        (1, 1, (1.2, 0.8, 0.0), 1.0),
        (1, 1, (0.5, 0.7, 0.8), 1.0),
    ],
)
def test_topk_error_at_known_points(k, target, point, expected):
    panel = Panel("0/1", landscape.TOPK_ERROR, {"k": k})
    value = landscape.evaluate(panel, torch.tensor([point], dtype=torch.float64), target)
    assert float(value[0]) == expected


def test_topk_error_panel_is_piecewise_constant_as_the_rank_of_the_target():
    (result,) = landscape.compute([Panel("0/1", landscape.TOPK_ERROR, {"k": 2})], target=3, resolution=20)
    for point, value in zip(result.points.tolist(), result.values.tolist()):
        beaten_by = sum(other > point[2] for other in point[:2])  # classes strictly above y
        assert value == (1.0 if beaten_by >= 2 else 0.0)
    assert set(result.values.tolist()) == {0.0, 1.0}


def test_custom_panels_are_the_product_of_the_listed_values():
    panels = landscape.custom_panels("noised_topk", ["k=1,2", "epsilon=0.1,1"])
    assert [p.params for p in panels] == [
        {"k": 1, "epsilon": 0.1},
        {"k": 1, "epsilon": 1.0},
        {"k": 2, "epsilon": 0.1},
        {"k": 2, "epsilon": 1.0},
    ]
    assert landscape.custom_panels("ce", []) == (Panel("ce", "ce", {}),)


def test_the_command_draws_a_png_of_the_designed_size(tmp_path, capsys):
    out = tmp_path / "ce.png"
    assert main(["landscape", "--loss", "ce", "--out", str(out), "--resolution", "8"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.size == (240, 270)  # one panel: 2.4 x (2.3 + 0.4) inches at 100 dpi
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 10  # something is drawn
    figure = tmp_path / "fig1.png"
    assert (
        main(["landscape", "--figure", "fig1", "--out", str(figure), "--resolution", "6", "--replications", "2"]) == 0
    )
    with Image.open(figure) as image:
        assert image.size == (1200, 500)  # 10 panels in 5 columns, 2 rows
    svg = tmp_path / "grid.svg"
    assert (
        main(
            [
                "landscape",
                "--loss",
                "smooth_topk_svm",
                "--param",
                "tau=0.1,1",
                "--param",
                "k=1",
                "--out",
                str(svg),
                "--resolution",
                "6",
            ]
        )
        == 0
    )
    assert "<svg" in svg.read_text()[:1000]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--loss", "nope"], ["unknown loss 'nope'", "noised_topk"]),
        (["--loss", "noised_topk", "--param", "epsilon=-1"], ["epsilon", ">= 0.0", "-1.0"]),
        (["--loss", "noised_topk", "--param", "eps=1"], ["no parameter 'eps'", "epsilon"]),
        (["--loss", "noised_topk", "--param", "n_samples=two"], ["n_samples", "an integer", "'two'"]),
        (["--loss", "noised_topk", "--param", "k=3"], ["k must be in [1, 2]"]),
        (["--loss", "topk_error", "--param", "k=3"], ["k must be <= 2"]),
        (["--loss", "avgk_two_head"], ["two heads"]),
        (["--param", "k=1"], ["--param needs --loss"]),
        (["--loss", "ce", "--out", "x.txt"], [".png, .svg, .pdf"]),
        (["--loss", "ce", "--target", "4"], ["--target", "[1, 3]", "4"]),
        (["--loss", "ce", "--resolution", "1"], ["--resolution"]),
    ],
)
def test_bad_options_are_refused_by_name(tmp_path, capsys, argv, words):
    assert main(["landscape", *argv]) == 2
    error = capsys.readouterr().err
    for word in words:
        assert word in error


def test_figure_and_loss_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["landscape", "--figure", "fig1", "--loss", "ce"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
