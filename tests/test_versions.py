"""One study name, one study; no two configs that look the same (issue #33).

- `studies.studyfile.version`: what defines a study's configs, and the fields a changed file
  changes (seeds, more configs, report or resources blocks are no change);
- `studies run` on a changed file under an existing name: exit 2 before Ray or MLflow, each
  changed field named with its old and new value, the ways forward (a folder left by a run of
  the old code, a study.yaml and a run.json, is the first version);
- the collected rows of two versions, or of configs that differ in a parameter no design
  sweeps: told apart in the table, the curve (split lines, each reference line labelled) and
  the comparisons (never across versions, Holm's family stated), on synthetic rows;
- (slow) one small real study: extended by a seed (one row per config, n = 4), refused when
  changed, then kept as a second version: labelled in the report's table, curve and
  comparisons, each version's file shown.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "studies" / "catalog" / "quickstart.yaml"

SMALL = """\
name: {name}
base:
  data: {{name: synthetic, num_classes: 10}}
  model: {{name: mlp, hidden_dim: 8}}
  loss: {{name: ce}}
  optim: {{lr: 0.1, milestones: []}}
  epochs: 15
  eval: {{ks: [1, 5]}}
  device: cpu
variants:
  ce: {{loss: {{name: ce}}}}
  noised: {{loss: {{name: noised_topk, k: 5, epsilon: 0.1, n_samples: 3}}}}
design:
  - {{kind: single, variants: [ce]}}
  - {{kind: grid, variants: [noised], parameters: {{loss.epsilon: [0.1, 1.0]}}}}
seeds: [0, 1, 2]
"""


def parse(text: str, *overrides: str):
    from studies.studyfile.spec import parse_study

    return parse_study(text, "small.yaml", overrides=list(overrides))


def changed(old: str, new: str, *overrides: str) -> list[str]:
    from studies.studyfile.version import changes, definition

    return [str(c) for c in changes(definition(parse(old)), definition(parse(new, *overrides)))]


# ----------------------------------------------------------------------------- what counts


def test_a_changed_field_is_named_with_its_old_and_new_value():
    text = SMALL.format(name="small")
    assert changed(text, text, "epochs=3") == ["epochs: 15 -> 3"]
    assert changed(text, text, "variants.noised.loss.n_samples=5") == ["variants.noised.loss.n_samples: 3 -> 5"]
    assert changed(text, text, "derived={optim.lr: '0.1 * 2'}") == ['derived.optim.lr: (absent) -> "0.1 * 2"']
    assert changed(text, text, "scheduler={kind: asha}")[0].startswith("scheduler.kind: ")


def test_seeds_more_configs_and_how_it_runs_are_no_change():
    text = SMALL.format(name="small")
    for overrides in (
        ["seeds=[0,1,2,3]"],
        ["seeds=[5]"],
        ["design.1.parameters.loss.epsilon=[0.1,1.0,2.0]"],
        ["variants.ce2={loss: {name: ce}, optim: {lr: 0.05}}"],
        ["resources={cpus: 2}"],
        ["resources={cpus: 1, seeds_per_trial: 2}"],
        ["max_failures=3"],
        ["report={level: 0.9}"],
        ["description=other"],
        ["optim.lr=1e-1"],
    ):  # 0.1 written another way
        assert changed(text, text, *overrides) == [], overrides
    more_blocks = text.replace("seeds:", "  - {kind: grid, variants: [ce], parameters: {optim.lr: [0.2]}}\nseeds:")
    assert changed(text, more_blocks) == []


def test_sampled_bounds_define_configs_but_their_count_does_not():
    text = SMALL.format(name="small").replace(
        "  - {kind: grid, variants: [noised], parameters: {loss.epsilon: [0.1, 1.0]}}",
        "  - {kind: random, variants: [noised], n_configs: 2, sampler_seed: 0,\n"
        "     parameters: {loss.epsilon: {loguniform: [0.01, 1.0]}}}",
    )
    assert changed(text, text, "design.1.n_configs=4") == []
    assert changed(text, text, "design.1.parameters.loss.epsilon={loguniform: [0.01, 2.0]}") == [
        "design[1].parameters.loss.epsilon.loguniform: [0.01, 1] -> [0.01, 2]"
    ]


# ----------------------------------------------------------------------------- the CLI


def legacy_folder(output: Path, text: str, name: str) -> Path:
    """What `studies run` of the old code leaves: study.yaml and run.json."""
    folder = output / name
    folder.mkdir(parents=True)
    (folder / "study.yaml").write_text(text)
    (folder / "run.json").write_text(
        json.dumps(
            {
                "name": name,
                "source": str(QUICKSTART),
                "smoke": False,
                "tracking_uri": f"sqlite:///{folder / 'mlflow.db'}",
            }
        )
    )
    return folder


def test_a_changed_rerun_is_refused_before_ray_or_mlflow(tmp_path, capsys, monkeypatch):
    """The quickstart run with its 15 epochs, then again with epochs=3: exit 2 naming the
    field, nothing touched (the run stops before its preconditions, Ray or MLflow)."""
    import studies.running.runner as runner
    from studies.cli import main

    def started(*args, **kwargs):
        raise AssertionError("the changed study was started")

    monkeypatch.setattr(runner, "_check_preconditions", started)
    folder = legacy_folder(tmp_path, QUICKSTART.read_text(), "quickstart")
    code = main(["run", str(QUICKSTART), "epochs=3", "seeds=[0,1]", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "epochs: 15 -> 3" in err
    assert "--new-version" in err and "name=quickstart_2" in err
    assert all(len(line) <= 80 for line in err.splitlines()), err
    assert sorted(p.name for p in folder.iterdir()) == ["run.json", "study.yaml"]
    assert (folder / "study.yaml").read_text() == QUICKSTART.read_text()


def test_an_extension_keeps_the_version_and_a_new_version_qualifies_its_cells(tmp_path):
    from studies.cells.run_names import run_names
    from studies.cells.space import expand
    from studies.errors import RunnerError
    from studies.running.versions import check_version, read_versions, save_versions, versioned_cells

    text = SMALL.format(name="small")
    first = check_version(parse(text), "small", tmp_path, new_version=False)
    assert first.new and not first.qualified
    save_versions(tmp_path, first)
    extended = check_version(
        parse(text, "seeds=[0,1,2,3]", "variants.ce2={loss: {name: ce}}"), "small", tmp_path, new_version=False
    )
    assert (extended.version, extended.qualified, extended.new) == (first.version, False, False)
    with pytest.raises(RunnerError, match="epochs: 15 -> 3"):
        check_version(parse(text, "epochs=3"), "small", tmp_path, new_version=False)
    second = check_version(parse(text, "epochs=3"), "small", tmp_path, new_version=True)
    assert second.qualified and second.several and second.version != first.version
    save_versions(tmp_path, second)
    assert [v["version"] for v in read_versions(tmp_path)] == [first.version, second.version]
    cells = versioned_cells(expand(parse(text, "epochs=3")), second)
    short = second.version[:7]
    assert all(c.config_id.endswith(f"-v{short}") and c.version == second.version for c in cells)
    assert all(name.endswith(f" version={short} s{c.seed}") for c, name in zip(cells, run_names(cells).values()))
    optuna = text.replace(
        "  - {kind: single, variants: [ce]}",
        "  - {kind: optuna, variants: [ce], n_configs: 2, parameters: {optim.lr: {loguniform: [0.01, 1.0]}}}",
    )
    first_optuna = check_version(parse(optuna), "small-optuna", tmp_path / "o", new_version=False)
    (tmp_path / "o").mkdir()
    save_versions(tmp_path / "o", first_optuna)
    with pytest.raises(RunnerError, match="does not apply to a study with an optuna block"):
        check_version(parse(optuna, "epochs=3"), "small-optuna", tmp_path / "o", new_version=True)
    # the first version's file again: its version, its plain ids
    again = check_version(parse(text), "small", tmp_path, new_version=False)
    assert (again.version, again.qualified) == (first.version, False)


# ----------------------------------------------------------------------------- the analysis

VERSION_A, VERSION_B = "fffffff11111", "bbbbbbb22222"


def two_versions_table(tag_versions: bool = True) -> pa.Table:
    """Finished cells of two versions (15 epochs on seeds 0-2, then 3 epochs on seeds 0-1)
    as `analysis.collect` reads them: ce and noised at epsilon 0.1 and 1.0."""
    rows = []
    for version, epochs, seeds, level in ((VERSION_A, 15, [0, 1, 2], 0.6), (VERSION_B, 3, [0, 1], 0.3)):
        suffix = "" if version == VERSION_A else f"-v{version[:7]}"
        for variant, eps, bonus in (("ce", None, 0.0), ("noised", 0.1, 0.02), ("noised", 1.0, 0.05)):
            config = f"{variant}{eps}{epochs}"[:10] + suffix
            for seed in seeds:
                row = {
                    "run_id": f"{config}{seed}",
                    "cell_id": f"{config}-s{seed}",
                    "config_id": config,
                    "seed": seed,
                    "variant": variant,
                    "swept": json.dumps({"loss.epsilon": eps} if eps else {}),
                    "start_time": 1000 * (version == VERSION_B) + seed,
                    "param:epochs": epochs,
                    "param:loss.name": "ce" if variant == "ce" else "noised_topk",
                    "param:loss.epsilon": eps,
                    "test/top1": level + bonus + 0.01 * seed + bonus * 0.1 * seed * seed,
                }
                if tag_versions:
                    row["version"] = version
                rows.append(row)
    return pa.Table.from_pylist(rows)


def test_a_curve_splits_lines_by_every_differing_param_and_labels_each_reference():
    """Untagged rows of 15 and 3 epochs (as the old code mixed them): two lines, not one
    zig-zag, and a CE reference line for each, labelled."""
    from analysis.stats import curve_series, summarize

    summary = summarize(two_versions_table(tag_versions=False), ["test/top1"])
    series = curve_series(summary, "loss.epsilon", "test/top1")
    lines = sorted((s.label, len(s.points)) for s in series if not s.flat)
    assert lines == [("noised, epochs=15", 2), ("noised, epochs=3", 2)]
    flats = sorted(s.label for s in series if s.flat)
    assert flats == ["ce, epochs=15", "ce, epochs=3"]
    for s in series:  # each line holds configs of one epochs value
        assert len({p["param:epochs"] for p in s.points}) == 1


def test_collected_rows_of_two_versions_are_labelled_and_never_pooled():
    from analysis.distinct import tell_apart
    from analysis.stats import curve_series, paired_comparisons, summarize

    table = tell_apart(two_versions_table())
    summary = summarize(table, ["test/top1"]).to_pylist()
    assert len(summary) == 6  # one row per config and version
    labels = {(r["variant"], r["swept"]) for r in summary}
    assert len(labels) == 6
    assert {json.loads(r["swept"])["version"] for r in summary} == {"fffffff", "bbbbbbb"}
    assert sorted(r["n"] for r in summary) == [2, 2, 2, 3, 3, 3]
    series = curve_series(summary, "loss.epsilon", "test/top1")
    assert sorted(s.label for s in series) == [
        "ce, version=bbbbbbb",
        "ce, version=fffffff",
        "noised, version=bbbbbbb",
        "noised, version=fffffff",
    ]
    compared = paired_comparisons(table, ["test/top1"], "ce").to_pylist()
    assert len(compared) == 4  # each noised config against the ce of its own version
    for r in compared:
        assert json.loads(r["swept"])["version"] == json.loads(r["reference_swept"])["version"]


def test_configs_alike_but_for_an_unswept_param_get_it_in_their_label():
    from analysis.distinct import tell_apart

    table = tell_apart(two_versions_table(tag_versions=False))
    swept = {(r["config_id"], r["swept"]) for r in table.to_pylist()}
    assert len({s for _, s in swept}) == 6
    assert all("epochs" in json.loads(s) for _, s in swept)


def test_the_report_of_two_versions_labels_table_curve_and_comparisons(tmp_path, monkeypatch):
    """`build_report` on the collected rows of two versions (MLflow replaced by the rows)."""
    import analysis.report as report
    from analysis.collect import Collected

    collected = Collected(
        table=two_versions_table(),
        failed=pa.table({}),
        study_name="small",
        tracking_uri="sqlite:///nowhere.db",
        experiment_id="1",
    )
    collected.failed = pa.Table.from_pylist(
        [],
        schema=pa.schema(
            [
                ("run_id", pa.string()),
                ("cell_id", pa.string()),
                ("config_id", pa.string()),
                ("seed", pa.int64()),
                ("variant", pa.string()),
                ("swept", pa.string()),
                ("status", pa.string()),
                ("mlflow_status", pa.string()),
                ("error", pa.string()),
                ("start_time", pa.int64()),
            ]
        ),
    )
    monkeypatch.setattr(report, "collect", lambda uri, name: collected)
    study = tmp_path / "small.yaml"
    study.write_text(
        SMALL.format(name="small") + "report:\n  tables: [{metrics: [test/top1]}]\n"
        "  curves: [{x: loss.epsilon, metric: test/top1}]\n"
    )
    html = report.build_report("sqlite:///nowhere.db", "small", tmp_path / "report", study_file=study)
    text = (Path(html).parent / "report.md").read_text()
    assert text.count("version=fffffff") >= 3 and text.count("version=bbbbbbb") >= 3, text
    assert "no family spans versions" in text
    ce_rows = [line for line in text.splitlines() if line.startswith("| ce |")]
    assert "fffffff" in ce_rows[0] and "bbbbbbb" in ce_rows[1], ce_rows  # the oldest version first
    table = text[text.index("## Results") : text.index("## Figures")]
    for version in ("fffffff", "bbbbbbb"):  # the best of each version in bold, not of both
        assert any("**" in line and version in line for line in table.splitlines()), table
    assert "## Study files" in text
    assert text.index("Version fffffff") < text.index("Version bbbbbbb")  # oldest first


# ----------------------------------------------------------------------------- a real run


def fit_by_config(config, seed, on_epoch=None, checkpoint=None):
    """`setvalued.train.fit`'s contract, instantly: an accuracy that depends on the epochs,
    the loss's epsilon and the seed."""
    epochs = int(config["epochs"])
    value = 0.3 + 0.02 * epochs + 0.05 * float(config["loss"].get("epsilon") or 0) + 0.01 * seed
    for epoch in range(epochs):
        if on_epoch is not None:
            on_epoch(epoch, {"epoch": epoch, "val/top1": value, "epoch_time_s": 0.0}, {"epoch": epoch})
    return {
        "best_epoch": epochs - 1,
        "best_val": value,
        "test": {"top1": value},
        "per_class": {"class": [0, 1], "top1": [value, value]},
        "history": [],
    }


@pytest.mark.slow
def test_extended_then_changed_then_kept_as_a_second_version(local_ray, tmp_path):
    from analysis.collect import collect
    from analysis.report import build_report
    from studies.errors import RunnerError
    from studies.running.runner import RunOptions, run_study

    path = tmp_path / "small.yaml"
    path.write_text(
        SMALL.format(name="versions-small").replace("epochs: 15", "epochs: 2")
        + "log_models: false\nreport:\n  curves: [{x: loss.epsilon, metric: test/top1}]\n"
    )

    def options(*overrides, new_version=False):
        return RunOptions(
            output=tmp_path / "out",
            report=False,
            fit_fn=fit_by_config,
            stream=io.StringIO(),
            progress_interval_s=1e9,
            overrides=tuple(overrides),
            **({"new_version": True} if new_version else {}),
        )

    first = options()
    outcome = run_study(path, first)
    assert outcome.exit_code == 0 and outcome.finished == 9, first.stream.getvalue()
    extended = options("seeds=[0,1,2,3]")
    outcome = run_study(path, extended)
    assert outcome.exit_code == 0 and outcome.finished == 12, extended.stream.getvalue()
    study_dir = tmp_path / "out" / "versions-small"
    uri = json.loads((study_dir / "run.json").read_text())["tracking_uri"]
    rows = collect(uri, "versions-small").table.to_pylist()
    per_config: dict[str, list] = {}
    for row in rows:
        per_config.setdefault(row["config_id"], []).append(row["seed"])
    assert sorted(map(sorted, per_config.values())) == [[0, 1, 2, 3]] * 3
    assert len({r["version"] for r in rows}) == 1

    with pytest.raises(RunnerError, match=r"epochs: 2 -> 3"):
        run_study(path, options("epochs=3", "seeds=[0,1]"))
    second = options("epochs=3", "seeds=[0,1]", new_version=True)
    outcome = run_study(path, second)
    assert outcome.exit_code == 0 and outcome.finished == 6, second.stream.getvalue()

    html = build_report(uri, "versions-small", study_dir / "report", study_file=study_dir / "study.yaml")
    text = (Path(html).parent / "report.md").read_text()
    versions = [v["version"][:7] for v in json.loads((study_dir / "versions.json").read_text())["versions"]]
    assert len(versions) == 2
    for version in versions:
        assert text.count(f"version={version}") >= 3, text  # table, comparisons, ...
        assert f"Version {version}" in text
    assert "its file was not found" not in text  # each version's file, from the parent run
    table = text[text.index("## Results") : text.index("## Figures")]
    rows = [line for line in table.splitlines() if line.startswith("| ce |")]
    assert len(rows) == 2 and {version in rows[i] for i, version in enumerate(versions)} == {True}, rows
    assert "(n=4)" in rows[0] and "(n=4)" not in rows[1], rows  # all 4 seeds of version 1
    from analysis.stats import curve_series, summarize

    table = collect(uri, "versions-small").table
    series = curve_series(summarize(table, ["test/top1"]), "loss.epsilon", "test/top1")
    assert sorted(s.label for s in series) == sorted(
        f"{variant}, version={v}" for variant in ("ce", "noised") for v in versions
    )

    # the MLflow view: one colour per config, the second version's apart from the first's
    from mlflow import MlflowClient

    from analysis.layout import ROLE_CELL, TAG_CONFIG_ID, TAG_ROLE, UI_RUN_COLOR_TAG

    client = MlflowClient(uri)
    colors: dict[str, set] = {}
    for run in client.search_runs(
        [collect(uri, "versions-small").experiment_id], f"tags.`{TAG_ROLE}` = '{ROLE_CELL}'", max_results=1000
    ):
        colors.setdefault(run.data.tags[TAG_CONFIG_ID], set()).add(run.data.tags.get(UI_RUN_COLOR_TAG))
    assert len(colors) == 6 and all(len(c) == 1 and None not in c for c in colors.values()), colors
    assert len({next(iter(c)) for c in colors.values()}) == 6, colors

    # `studies submit` reads the versions from the tracking store (no output folder here)
    from studies.running.versions import check_submission, versions_in_mlflow

    assert [e["version"][:7] for e in versions_in_mlflow(uri, "versions-small")] == versions
    with pytest.raises(RunnerError, match=r"epochs: 3 -> 5"):
        check_submission(parse(path.read_text(), "epochs=5"), uri, [])
    check_submission(parse(path.read_text(), "seeds=[0,1,2,3,4]"), uri, [])  # an extension


def test_runs_made_before_versions_were_recorded_belong_to_the_first_version():
    from analysis.distinct import tell_apart
    from analysis.stats import summarize

    rows = two_versions_table().to_pylist()
    for row in rows:
        if row["version"] == VERSION_A and row["seed"] == 0:
            row["version"] = None  # run by the code before versions
    summary = summarize(tell_apart(pa.Table.from_pylist(rows)), ["test/top1"]).to_pylist()
    assert (
        sorted((json.loads(r["swept"])["version"], r["n"]) for r in summary)
        == [("bbbbbbb", 2)] * 3 + [("fffffff", 3)] * 3
    )
