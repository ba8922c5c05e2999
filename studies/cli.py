"""The `studies` command line: run, resume, report and export hyperparameter studies.

Every subcommand is one `Command` (name, help, how to add its arguments, what it does) in
`COMMANDS`; adding one (submit, jobs, logs, stop) is adding an entry.

Exit codes: 0 success; 1 some cells did not finish (each listed with its error); 2 bad input
(a study file that fails validation, an unknown study name, resources that do not fit):
one paragraph on stderr, no traceback, nothing started; 130 interrupted (Ctrl-C); 143 / 129
stopped by SIGTERM / SIGHUP (handled as Ctrl-C: the resume command is printed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from studies.api import OUTPUT_ENV, default_output

EPILOG = """\
examples:
  studies run studies/catalog/quickstart.yaml --dry-run   # the cells, nothing started
  studies run studies/catalog/quickstart.yaml --smoke     # seconds: synthetic data, 1 epoch
  studies plan studies/catalog/quickstart.yaml --smoke --smoke-epochs 2   # its time
  studies run studies/catalog/quickstart.yaml optim.lr=0.05 seeds=[0,1]   # overrides
  studies show studies/catalog/quickstart.yaml ce         # the resolved config of a variant
  studies run study.yaml --address ray://head:10001 --tracking-uri http://mlflow:5000
  studies resume quickstart                               # complete what is missing
  studies report quickstart                               # HTML + Markdown report
  studies export quickstart --to cells.parquet            # one row per finished cell
  studies compare imbalance_a imbalance_b --reference ce  # studies side by side
  studies plan studies/catalog/quickstart.yaml --pilot quickstart --difference 0.5
  studies landscape --figure fig1 --out fig1.png          # a loss-landscape figure of the papers
  studies plugins                                         # losses, data sets, models installed
  studies landscape --loss noised_topk --param k=2 --param epsilon=0.1,1.0
"""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ----------------------------------------------------------------------------- shared options


def _add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output",
        default=str(default_output()),
        metavar="DIR",
        help="folder holding one sub-folder per study: study.yaml, run.json, mlflow.db, "
        f"ray/, optuna.db, report/ (default: ${OUTPUT_ENV}, else ./studies_out; "
        "now %(default)s)",
    )


def _add_tracking(parser: argparse.ArgumentParser, saved: bool) -> None:
    default = ("the one the study was run with (run.json), else " if saved else "") + "sqlite:///DIR/NAME/mlflow.db"
    parser.add_argument(
        "--tracking-uri",
        default=None,
        metavar="URI",
        help=f"MLflow tracking URI, e.g. http://mlflow:5000 (default: {default})",
    )


def _add_execution(parser: argparse.ArgumentParser) -> None:
    from studies.running.warm_ray import DEFAULT_MINUTES  # stdlib only at import

    parser.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="Ray cluster to run on (e.g. auto, or ray://head:10001); default: a local Ray "
        "instance sized to this machine",
    )
    parser.add_argument(
        "--storage",
        default=None,
        metavar="PATH_OR_URI",
        help="where Ray Tune keeps trial checkpoints (default: DIR/NAME/ray); on a "
        "multi-node cluster a folder shared by all nodes or a cloud URI (s3://...)",
    )
    parser.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        metavar="N",
        help="CPUs of the local Ray instance (default: all of this machine's)",
    )
    parser.add_argument(
        "--no-report",
        dest="report",
        action="store_false",
        help="do not build the report at the end (build it later with `studies report`)",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="S",
        help="print the progress line at least every S seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-warm",
        type=_minutes,
        nargs="?",
        const=DEFAULT_MINUTES,
        default=None,
        metavar="MINUTES",
        help="local Ray only: keep it running MINUTES after the study (default "
        f"{DEFAULT_MINUTES:g}; also $STUDIES_KEEP_WARM), so that the next `studies run` in this "
        "environment starts in seconds; `studies stop --local` ends it",
    )
    parser.add_argument(
        "--ray-dashboard",
        dest="dashboard",
        action="store_true",
        help="local Ray only: start Ray's dashboard on 127.0.0.1 and print its address",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the INFO logs of MLflow, alembic and Ray, and MLflow's traceback of each "
        "request to a locked tracking store (hidden by default)",
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="when another driver is running this study, wait for it to finish instead of refusing",
    )
    parser.add_argument(
        "--max-cells",
        type=int,
        default=None,
        metavar="N",
        help="allow up to N cells (default: the file's max_cells, else 100,000)",
    )


def _minutes(text: str) -> float:
    """A `--keep-warm` value: minutes, a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected minutes, a number > 0, got {text!r}")
    return value


def _options(args: argparse.Namespace):
    from studies.running.runner import RunOptions

    smoke_epochs = _smoke_epochs(args)
    return RunOptions(
        output=Path(args.output),
        tracking_uri=args.tracking_uri,
        address=getattr(args, "address", None),
        smoke=smoke_epochs > 0,
        smoke_epochs=max(smoke_epochs, 1),
        dry_run=getattr(args, "dry_run", False),
        report=getattr(args, "report", True),
        num_cpus=getattr(args, "num_cpus", None),
        storage=getattr(args, "storage", None),
        progress_interval_s=getattr(args, "progress_every", 30.0),
        wait=getattr(args, "wait", False),
        max_cells=getattr(args, "max_cells", None),
        verbose=getattr(args, "verbose", False),
        dashboard=getattr(args, "dashboard", False),
        overrides=tuple(_overrides(args)),
        new_version=getattr(args, "new_version", False),
        keep_warm=getattr(args, "keep_warm", None),
        keep_finished=getattr(args, "keep_finished", False),
    )


def _overrides(args: argparse.Namespace) -> list[str]:
    """The `key=value` words after FILE, then those of --set (later ones win)."""
    return list(getattr(args, "overrides", None) or []) + list(getattr(args, "set", None) or [])


def _add_overrides(
    parser: argparse.ArgumentParser, metavar: str = "KEY=VALUE", help: str = "kept in DIR/NAME/study.yaml and run.json"
) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar=metavar,
        help="set a value of the study file before it is validated (Hydra's convention): KEY a "
        "dotted path from the top of the file (seeds, variants.ce.loss.k, "
        "design.0.parameters.loss.epsilon) or inside base (optim.lr), VALUE read as YAML "
        f"(0.01, [0,1]); {help}",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="the same as a KEY=VALUE word (repeatable)"
    )


def _add_smoke(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"same losses, metrics and design on a tiny synthetic set, tiny MLP, one epoch, CPU; {what}",
    )
    parser.add_argument(
        "--smoke-epochs",
        type=int,
        default=None,
        metavar="N",
        help="epochs of each smoke cell (default: 1; implies --smoke)",
    )


def _smoke_epochs(args: argparse.Namespace) -> int:
    """The epochs of the smoke run asked for (0: not a smoke run); ValueError for a count
    below 1, naming the flag."""
    from studies.running.run_options import smoke_epochs_of

    return smoke_epochs_of(getattr(args, "smoke", False), getattr(args, "smoke_epochs", None))


def _add_new_version(parser: argparse.ArgumentParser) -> None:
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument(
        "--new-version",
        action="store_true",
        help="the file changed what defines the configs of a study already "
        "run under its name, or the code or data that trains its finished cells changed: "
        "keep it as a new version of that study (its cells run again), "
        "told apart by its version in the report and MLflow (default: "
        "refuse, exit 2, naming each change)",
    )
    choice.add_argument(
        "--keep-finished",
        action="store_true",
        help="the code, a plugin or the data that trains the study's finished cells changed: "
        "keep those cells as they are, knowingly (recorded on the study's parent run and in "
        "its report; default: refuse, exit 2, naming each change old -> new)",
    )


def _add_difference(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--difference",
        type=float,
        default=None,
        metavar="D",
        help="the smallest difference of interest the seeds are planned for, in percentage points "
        "for accuracies (default: the study file's report.difference, else 1)",
    )


def _fail(message: str) -> int:
    print(f"studies: error: {message}", file=sys.stderr, flush=True)
    return 2


def _study_location(args: argparse.Namespace) -> tuple[Path, str]:
    """(study folder, tracking URI) of a study by name, from --output and run.json."""
    from studies.api import locate

    return locate(args.name, output=args.output, tracking_uri=args.tracking_uri)


# ----------------------------------------------------------------------------- commands


def _run(args: argparse.Namespace) -> int:
    from studies.running.runner import RunnerError, run_study
    from studies.studyfile.spec import StudyError

    try:
        options = _options(args)
    except ValueError as error:  # --smoke-epochs 0
        return _fail(str(error))
    try:
        outcome = run_study(args.file, options)
    except (StudyError, RunnerError) as error:
        return _fail(str(error))
    return outcome.exit_code


def _add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the study file (YAML)")
    _add_overrides(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the table of cells (run name, swept values, config_id) and their count; start nothing",
    )
    _add_smoke(parser, "runs as study NAME-smoke")
    _add_new_version(parser)
    _add_execution(parser)
    _add_tracking(parser, saved=False)
    _add_output(parser)


def _resume(args: argparse.Namespace) -> int:
    from studies.running.runner import RunnerError, resume_study
    from studies.studyfile.spec import StudyError

    try:
        outcome = resume_study(args.name, _options(args))
    except (StudyError, RunnerError) as error:
        return _fail(str(error))
    return outcome.exit_code


def _add_resume(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the study's name (its folder DIR/NAME holds study.yaml)")
    _add_execution(parser)
    _add_tracking(parser, saved=True)
    _add_output(parser)


def _read_back_errors() -> tuple[type[Exception], ...]:
    """What a read-only command refuses with exit code 2: a study or store that is not there
    or not what the tool wrote (studies.readback), a store without the study (CollectError)."""
    from analysis.collect import CollectError
    from analysis.study_file import ReportError
    from studies.errors import RunnerError

    return (FileNotFoundError, ImportError, RunnerError, CollectError, ReportError)


def _report(args: argparse.Namespace) -> int:
    try:
        study_dir, uri = _study_location(args)
        from studies.api import report
        from studies.running.progress import activity

        with activity(sys.stderr, f"report of {args.name}: reading MLflow, drawing tables and figures"):
            path = report(args.name, output=args.output, tracking_uri=uri, difference=args.difference)
    except _read_back_errors() as error:
        return _fail(str(error))
    print(path)
    return 0


def _add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the study's name")
    _add_difference(parser)
    _add_tracking(parser, saved=True)
    _add_output(parser)


def _export(args: argparse.Namespace) -> int:
    try:
        study_dir, uri = _study_location(args)
        from analysis.collect import export_parquet
        from studies.api import collect
        from studies.running.progress import activity

        with activity(sys.stderr, f"export of {args.name}: reading its runs from MLflow"):
            collected = collect(args.name, output=args.output, tracking_uri=uri)  # before any folder is made
        target = Path(args.to) if args.to else study_dir / "cells.parquet"
        target.parent.mkdir(parents=True, exist_ok=True)
        path = export_parquet(collected, target)
    except _read_back_errors() as error:
        return _fail(str(error))
    print(path)
    return 0


def _add_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the study's name")
    parser.add_argument(
        "--to",
        default=None,
        metavar="PATH",
        help="the Parquet file to write (default: DIR/NAME/cells.parquet; "
        "failed cells go to <stem>.failed.parquet beside it)",
    )
    _add_tracking(parser, saved=True)
    _add_output(parser)


def _reproduce(args: argparse.Namespace) -> int:
    from studies.running.reproduce import EXIT_CODES, reproduce_cell

    try:
        verdict, _ = reproduce_cell(
            args.name, args.cell, output=args.output, tracking_uri=args.tracking_uri, tolerance=args.tolerance
        )
    except _read_back_errors() as error:
        return _fail(str(error))
    return EXIT_CODES[verdict]


def _add_reproduce(parser: argparse.ArgumentParser) -> None:
    from studies.running.reproduce import DEFAULT_TOLERANCE

    parser.add_argument("name", metavar="NAME", help="the study's name")
    parser.add_argument(
        "--cell", required=True, metavar="CELL", help="the finished cell: its cell id (CONFIG_ID-sSEED) or run name"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        metavar="T",
        help="a value is within the tolerance when |new - old| <= T x max(1, |old|) (default: %(default)s)",
    )
    _add_tracking(parser, saved=True)
    _add_output(parser)


def _show(args: argparse.Namespace) -> int:
    from studies.studyfile.overrides import dump_yaml, looks_like_override
    from studies.studyfile.spec import StudyError, load_study

    words = _overrides(args)
    variants = [word for word in words if not looks_like_override(word)]
    try:
        study = load_study(args.file, overrides=[word for word in words if looks_like_override(word)])
    except StudyError as error:
        return _fail(str(error))
    unknown = [name for name in variants if not study.has_variant(name)]
    if unknown:
        from studies.studyfile.problems import did_you_mean

        return _fail(
            f"{args.file}: unknown variant {unknown[0]!r}{did_you_mean(unknown[0], study.variant_names)}; "
            f"expected one of: {', '.join(study.variant_names)}"
        )
    from setvalued.config import effective_config
    from setvalued.registry import plugin_sections

    for name in variants or study.variant_names:
        config = study.variant_config(name)
        print(f"# variant {name}: its trial config, the fields that apply, defaults filled in (the design sets more)")
        print(dump_yaml(effective_config(config, plugin_sections(config))), end="")
    return 0


def _add_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the study file (YAML)")
    _add_overrides(parser, "VARIANT|KEY=VALUE", "a word without '=' names a variant to print (default: every one)")


def _plan(args: argparse.Namespace) -> int:
    from studies.planning.plan import PlanError, make_plan
    from studies.studyfile.spec import StudyError

    try:
        smoke_epochs = _smoke_epochs(args)
    except ValueError as error:  # --smoke-epochs 0
        return _fail(str(error))
    pilot_uri = None
    if args.pilot is not None:
        from studies.api import locate

        try:
            pilot_uri = locate(args.pilot, output=args.output, tracking_uri=args.tracking_uri)[1]
        except FileNotFoundError as error:
            return _fail(f"--pilot {args.pilot}: {error}")
    try:
        print(
            make_plan(
                args.file,
                pilot=args.pilot,
                pilot_uri=pilot_uri,
                difference=args.difference,
                half_width=args.half_width,
                power=args.power,
                gpus=args.gpus,
                probe_steps=args.probe_steps,
                probe=args.probe,
                overrides=_overrides(args),
                smoke_epochs=smoke_epochs,
            )
        )
    except (StudyError, PlanError) as error:
        return _fail(str(error))
    return 0


def _add_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the study file (YAML)")
    _add_overrides(parser, help="as on `studies run`")
    _add_smoke(parser, "plan the study's smoke run (`studies run --smoke`)")
    parser.add_argument(
        "--pilot",
        default=None,
        metavar="NAME",
        help="a finished or partial study under --output whose runs give the "
        "seconds per epoch and the sd of the paired differences "
        "(default: probe a few steps; the file's reference intervals)",
    )
    _add_difference(parser)
    parser.add_argument(
        "--half-width",
        type=float,
        default=None,
        metavar="W",
        help="the target half-width of the intervals (default: D / 2)",
    )
    parser.add_argument(
        "--power", type=float, default=0.8, metavar="P", help="the power of the paired t-test (default: %(default)s)"
    )
    parser.add_argument(
        "--gpus", type=int, default=None, metavar="N", help="GPUs of the cluster the study will run on (default: 1)"
    )
    parser.add_argument(
        "--probe-steps",
        type=int,
        default=10,
        metavar="N",
        help="training steps the probe times per variant (default: %(default)s)",
    )
    parser.add_argument("--no-probe", dest="probe", action="store_false", help="do not probe: times only from --pilot")
    _add_tracking(parser, saved=True)
    _add_output(parser)


def _landscape(args: argparse.Namespace) -> int:
    from studies.landscape import LandscapeError, render

    try:
        path = render(
            figure=args.figure,
            loss=args.loss,
            params=args.param,
            out=args.out,
            target=args.target,
            resolution=args.resolution,
            replications=args.replications,
            seed=args.seed,
            columns=args.columns,
        )
    except LandscapeError as error:
        return _fail(str(error))
    print(path)
    return 0


def _add_landscape(parser: argparse.ArgumentParser) -> None:
    from studies.landscape import FIGURES  # no torch: the figures are declarations

    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--figure",
        default=None,
        choices=list(FIGURES),
        help="a figure of the papers: "
        + "; ".join(f"{name}: {preset.caption}" for name, preset in FIGURES.items())
        + " (default: fig1)",
    )
    which.add_argument(
        "--loss",
        default=None,
        metavar="NAME",
        help="draw one registered loss instead (or topk_error, the 0/1 top-K loss)",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=V1[,V2...]",
        help="a parameter of --loss; one panel per combination of the listed "
        "values (repeatable), e.g. --param k=2 --param epsilon=0.1,1.0",
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help="the drawing: .png, .svg or .pdf (default: ./landscape_<figure or loss>.png)",
    )
    parser.add_argument(
        "--target",
        type=int,
        default=None,
        metavar="Y",
        help="the true class, 1 to 3, drawn at the top vertex (default: the figure's, else 3)",
    )
    parser.add_argument(
        "--resolution",
        type=int,
        default=100,
        metavar="N",
        help="grid points per edge of the simplex (default: %(default)s)",
    )
    parser.add_argument(
        "--replications",
        type=int,
        default=None,
        metavar="R",
        help="noise draws averaged per point for the noised losses (default: the figure's, else 100)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise (default: %(default)s)")
    parser.add_argument(
        "--columns", type=int, default=None, metavar="C", help="panels per row (default: the figure's, else 4)"
    )


def _compare(args: argparse.Namespace) -> int:
    from analysis.comparison import CompareError
    from studies.api import compare
    from studies.running.progress import activity

    rename = {}
    for word in args.map:
        old, sep, new = word.partition("=")
        if not sep or not old or not new:
            return _fail(f"--map {word!r}: expected OLD=NEW or STUDY:OLD=NEW (a variant's name in the comparison)")
        rename[old] = new
    try:
        with activity(sys.stderr, f"comparison of {', '.join(args.names)}: reading MLflow, ranks, bootstrap, figures"):
            path = compare(
                args.names,
                metric=args.metric,
                reference=args.reference,
                rename=rename,
                level=args.level,
                resamples=args.resamples,
                to=args.to,
                output=args.output,
                tracking_uri=args.tracking_uri,
            )
    except _read_back_errors() + (CompareError,) as error:
        return _fail(str(error))
    print(path)
    return 0


def _add_compare(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "names", nargs="+", metavar="STUDY", help="finished studies under --output (or at --tracking-uri)"
    )
    parser.add_argument(
        "--metric",
        default=None,
        metavar="M",
        help="the metric compared (default: test/top5, else test/avg5, else test/top1: the first every study logged)",
    )
    parser.add_argument(
        "--reference",
        default=None,
        metavar="VARIANT",
        help="the variant the others are compared with (default: the first study's first variant)",
    )
    parser.add_argument(
        "--map",
        action="append",
        default=[],
        metavar="[STUDY:]OLD=NEW",
        help="match variants named differently: OLD (in STUDY, or in every study) is compared as NEW (repeatable)",
    )
    parser.add_argument(
        "--level",
        type=float,
        default=0.95,
        metavar="L",
        help="confidence level of every interval and test (default: %(default)s)",
    )
    parser.add_argument(
        "--resamples", type=int, default=None, metavar="N", help="stratified-bootstrap resamples (default: 10000)"
    )
    parser.add_argument(
        "--to", default=None, metavar="DIR", help="the report's folder (default: DIR/comparisons/STUDY+STUDY...)"
    )
    _add_tracking(parser, saved=True)
    _add_output(parser)


def _add_plugins(parser: argparse.ArgumentParser) -> None:
    from studies.plugins import add_arguments

    add_arguments(parser)


def _plugins(args: argparse.Namespace) -> int:
    from studies.plugins import run

    return run(args)


COMMANDS: list[Command] = [
    Command(
        "run",
        "run a study file (or complete it: finished cells are skipped)",
        "Validate the study file, expand it into (config, seed) cells and run every "
        "cell not finished yet as a Ray Tune trial, tracked in MLflow. A bad file is "
        "reported in one paragraph (exit 2) before anything starts.",
        _add_run,
        _run,
    ),
    Command(
        "show",
        "print the resolved trial config of each variant (or of those named)",
        "Validate the study file (with any KEY=VALUE overrides) and print each variant's "
        "trial config as the trainer gets it, every default filled in, as YAML: the fields that "
        "apply to it (no DenseNet depth for an MLP), as its MLflow params.",
        _add_show,
        _show,
    ),
    Command(
        "resume",
        "complete an interrupted study by name",
        "Re-run DIR/NAME/study.yaml with the settings it was run with (run.json): "
        "finished cells are skipped, unfinished ones start again.",
        _add_resume,
        _resume,
    ),
    Command(
        "report",
        "build the study's HTML/Markdown report and print its path",
        "Read the study's runs from MLflow and write DIR/NAME/report/ (tables with 95% "
        "confidence intervals over seeds, curves).",
        _add_report,
        _report,
    ),
    Command(
        "export",
        "export the finished cells to Parquet and print the path",
        "One row per finished cell: ids, the flattened config, final metrics.",
        _add_export,
        _export,
    ),
    Command(
        "reproduce",
        "train one finished cell again and compare every metric with its run",
        "Train the finished cell CELL of study NAME again in this process, in a scratch "
        "folder (nothing of the study is written), as its run recorded it (config, seed, "
        "fused array, early stop), and compare every per-epoch and final metric with the "
        "run's: the largest difference and the verdict. Exit 0 identical, 3 within the "
        "tolerance, 1 differs (the first epoch and metric named), 2 bad input. What it can "
        "and cannot prove: docs/commands.md.",
        _add_reproduce,
        _reproduce,
    ),
    Command(
        "plan",
        "how many seeds each comparison needs and what the study will cost",
        "Seeds for a paired t-test of the given power (non-central t) and for a target "
        "interval half-width, per comparison of the report, from a pilot study or the "
        "file's published intervals; cells x epochs x seconds per epoch (pilot or a "
        "probe of a few steps, no Ray) over the trial slots: GPU-hours and wall time. "
        "docs/planning.md.",
        _add_plan,
        _plan,
    ),
    Command(
        "compare",
        "compare finished studies side by side and print the report's path",
        "Each study, or each value of a parameter all its variants sweep, is a task: the table "
        "by task (mean, interval, per-seed values), average ranks with Friedman's test, a "
        "critical-difference diagram, pairwise Wilcoxon tests with Holm's correction, and the "
        "interquartile mean and probability of improvement with stratified-bootstrap intervals; "
        "HTML, Markdown and LaTeX. docs/comparison.md.",
        _add_compare,
        _compare,
    ),
    Command(
        "plugins",
        "list the losses, data sets and models, with each plugin's parameters",
        "The registries by kind: the built-in names, every installed plugin (a "
        "distribution with entry points in setvalued.losses, setvalued.datasets or "
        "setvalued.models) with its parameters, and every refused plugin with the reason. "
        "Exit 1 when a plugin is refused. docs/plugins.md.",
        _add_plugins,
        _plugins,
    ),
    Command(
        "landscape",
        "draw a loss's level sets over three scores and print the path",
        "Level sets of s -> loss(s, y) over the scaled 2-simplex (L = 3, y at the top "
        "vertex), min-max rescaled per panel, computed from the registered losses (no "
        "training): the papers' figures ([Gar23] Fig. 4.1, 4.4, 4.5, 4.6) or one loss "
        "over a grid of its parameters.",
        _add_landscape,
        _landscape,
    ),
]


def _version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("setvalued-studies")
    except PackageNotFoundError:
        from setvalued import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="studies",
        description="Hyperparameter studies of set-valued classification losses: one YAML "
        "file -> every (config, seed) cell trained on Ray Tune, tracked in "
        "MLflow, resumable, and reported with confidence intervals.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.description)
        command.add_arguments(child)
        child.set_defaults(handler=command.run)
    from studies.cluster.submit import add_subcommands  # submit, jobs, logs, stop (a Ray cluster)

    add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from studies.studyfile.overrides import looks_like_override

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `studies run FILE --smoke optim.lr=0.1`: argparse leaves KEY=VALUE words after a flag
    if extra and hasattr(args, "overrides") and all(looks_like_override(word) for word in extra):
        args.overrides = list(args.overrides or []) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from studies.errors import caller

    with caller("cli"):  # its messages name the flags, also those raised through studies.api
        return int(args.handler(args))


def console() -> int:
    """The `studies` console script: `main`, then the heap frozen for the exit. A command's
    process ends with thousands of modules loaded (MLflow, Ray, pyarrow); the interpreter's
    last garbage collections over them took 1.0-1.4 s of every command's wall time on a
    2-core machine (benchmarks/startup.py), for objects the exit frees anyway. Frozen, they
    are left to the exit; atexit handlers and flushes run as before. Not in `main`: a
    process that calls `main` and goes on (a test, a notebook) keeps its collector."""
    import gc

    try:
        return main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(console())
