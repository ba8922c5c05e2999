"""Readable run names: different for different configs, with the papers' symbols."""

from __future__ import annotations

from pathlib import Path

from studies.cells.run_names import run_names
from studies.cells.space import expand
from studies.studyfile.spec import load_study

CATALOG = Path(__file__).resolve().parents[1] / "studies" / "catalog"


def test_the_quickstart_configs_read_apart():
    cells = expand(load_study(CATALOG / "quickstart.yaml"))
    names = run_names(cells)
    by_config = {}
    for cell in cells:
        by_config.setdefault(names[cell.cell_id].rsplit(" s", 1)[0], set()).add(cell.config_id)
    assert all(len(ids) == 1 for ids in by_config.values()), by_config
    assert len(by_config) == len({c.config_id for c in cells})
    noised = [names[c.cell_id] for c in cells if c.variant.startswith("noised") and c.seed == cells[0].seed]
    assert any("ε=" in name for name in noised), noised
    assert all(name.endswith(f" s{c.seed}") for c, name in ((c, names[c.cell_id]) for c in cells))


def test_every_catalogue_study_gets_distinct_names_per_config():
    for path in sorted(CATALOG.glob("*.yaml")):
        cells = expand(load_study(path))
        names = run_names(cells)
        assert len(set(names.values())) == len(cells), path.name


def test_names_of_cells_added_a_config_at_a_time_equal_the_names_of_the_whole_set():
    """An optuna block names each config's cells when it is asked: against every config
    recorded so far, exactly as `run_names` over that set would (incremental, not O(n) each)."""
    from studies.cells.run_names import RunNamer

    cells = expand(load_study(CATALOG / "quickstart.yaml"))
    by_config: dict[str, list] = {}
    for cell in cells:
        by_config.setdefault(cell.config_id, []).append(cell)
    namer, seen = RunNamer(), []
    for group in by_config.values():
        seen.extend(group)
        names = namer.names(group)
        expected = run_names(seen)
        assert names == {c.cell_id: expected[c.cell_id] for c in group}
    # two configs that differ only in a path no design sweeps read apart by their hash
    first = cells[0]
    twin = type(first)(first.config_id[::-1], first.seed, first.variant, first.config, dict(first.swept))
    names = RunNamer().names([first, twin])
    assert names[first.cell_id] != names[twin.cell_id]
    assert names[first.cell_id].rsplit(" s", 1)[0].endswith(f"[{first.config_id[:6]}]")
