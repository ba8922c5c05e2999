"""Progress of a running study on the driver: cells done / running / failed / left, and ETA.

`StudyProgress` is the bookkeeping; `ProgressReporter` feeds it from the hooks of Tune's
driver-side callback (`on_trial_start`, ...; `studies.running.tune_experiment.ProgressCallback` is the
Tune callback made of it) and prints a line whenever a cell starts, ends or fails, and at
least every `interval_s` seconds while cells run. A failed cell is printed with its error;
it does not stop the others. Both are plain Python: no Ray here.

ETA: the fraction of the work done in this session is
(cells finished + sum over running cells of epochs done / epochs) / cells to run; the time
left is the pace since the first progress (the first epoch or cell reported) applied to what is
left: (now - then) * (1 - fraction) / (fraction - fraction then). The start-up before the first
epoch (Ray, workers, imports, the data) is not training pace, so it is left out: measured from
the start, the quickstart's first ETA said an hour for a five-minute study. No ETA is shown until
a second progress gives a pace. It counts partial epochs of running cells, so it is available
before the first cell ends, and it follows the real concurrency.

What a person reads: on a terminal every line fits its width (the progress line is cut, other
lines wrapped) and the progress is one line rewritten in place; without one (a log file, CI)
every line starts with the wall-clock time and the progress lines carry the elapsed time
(`say`, `activity`). Cells are named by their run names (`studies.cells.run_names`), not hashes.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

#: how every line of the runner starts
PREFIX = "[studies]"


def is_terminal(stream: IO[str]) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def terminal_width(stream: IO[str]) -> int:
    """Columns of the terminal `stream` writes to (COLUMNS, else the terminal's, else 80)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size((80, 24)).columns


def fit_line(text: str, width: int) -> str:
    """`text` cut to fit in `width - 1` columns (the last column would wrap on some
    terminals), an ellipsis where it was cut."""
    room = max(10, width - 1)
    return text if len(text) <= room else text[: room - 1] + "…"


def plain_line(text: str, stream: IO[str], width: int | None = None) -> str:
    """A line of its own as `stream` shows it: wrapped to the terminal's width (following lines
    indented), or headed by the wall-clock time without a terminal."""
    if is_terminal(stream):
        width = width or terminal_width(stream)
        return (
            "\n".join(
                textwrap.wrap(
                    text, max(20, width - 1), subsequent_indent="    ", break_on_hyphens=False, replace_whitespace=False
                )
            )
            or text
        )
    return f"{time.strftime('%H:%M:%S')} {text}"


def say(stream: IO[str], text: str) -> None:
    """Print a line of the runner (`[studies] ...` added) as `plain_line` shapes it."""
    print(plain_line(f"{PREFIX} {text}", stream), file=stream, flush=True)


@contextmanager
def activity(stream: IO[str], text: str, every_s: float = 0.5) -> Iterator[None]:
    """A step that takes a while (starting Ray, reading a study's runs): on a terminal one line
    with the seconds elapsed, rewritten in place until the step ends and then erased; without
    one, a timed line when it starts and one with its duration when it ends."""
    started = time.monotonic()
    if not is_terminal(stream):
        say(stream, f"{text} ...")
        yield
        say(stream, f"{text}: done in {format_duration(time.monotonic() - started)}")
        return
    stop = threading.Event()
    width = terminal_width(stream)

    def tick() -> None:
        while True:
            counter = f" ... {int(time.monotonic() - started)} s"  # cut the text, not the seconds
            stream.write("\r\x1b[K" + fit_line(f"{PREFIX} {text}", width - len(counter)) + counter)
            stream.flush()
            if stop.wait(every_s):
                return

    ticker = threading.Thread(target=tick, name="studies-activity", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        stream.write("\r\x1b[K")
        stream.flush()


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@dataclass
class StudyProgress:
    """Counts of one study run. `done_before`: cells finished by earlier runs (skipped)."""

    total: int
    to_run: int
    epochs: Mapping[str, int]  # cell_id -> epochs of its config
    done_before: int = 0
    started_at: float = field(default_factory=time.monotonic)
    finished: set = field(default_factory=set)
    failed: dict = field(default_factory=dict)  # cell_id -> error
    running: dict = field(default_factory=dict)  # cell_id -> epochs done
    # a racing study's race (studies.scheduling.race_driver.RaceDriver): how many cells run is decided
    # as they finish, so `to_run` follows the race's upper bound
    race: Any = None
    # an optuna block: how many cells the configs not asked yet may still add (its room times
    # the seeds); cells are added to `to_run` as their config is asked (`admit`)
    may_add: Callable[[], int] | None = None
    _admitted: set = field(default_factory=set)  # the optuna cells counted so far
    _first: tuple[float, float] | None = None  # (time, fraction done) at the first progress

    def admit(self, to_run: Iterable[str], done: Iterable[str] = ()) -> None:
        """An optuna config asked: the cells `to_run` will run, those `done` were finished
        before. A cell counted already (a config asked again) is not counted twice."""
        counted = set(self.finished) | set(self.failed) | set(self.running) | self._admitted
        for cell in to_run:
            if cell not in counted:
                self.to_run += 1
                self._admitted.add(cell)
        for cell in done:
            if cell not in counted:
                self.done_before += 1
                self._admitted.add(cell)

    @property
    def cells_not_asked(self) -> int:
        """The most cells an optuna block's configs not asked yet may add (0 without one)."""
        return int(self.may_add()) if self.may_add is not None else 0

    def total_now(self) -> int:
        """The cells of the study: fixed, or with an optuna block the cells counted so far plus
        those its configs not asked yet may add (it falls as a config asked twice adds none)."""
        if self.may_add is None:
            return self.total
        return self.done_before + self.to_run + self.cells_not_asked

    def _sync_race(self) -> None:
        """`to_run` = cells started or finished in this session + the most the race may start."""
        if self.race is not None:
            self.to_run = len(self.finished) + len(self.failed) + len(self.running) + self.race.upper_bound_left()

    def start(self, cell_id: str) -> None:
        self.running.setdefault(cell_id, 0)
        self.failed.pop(cell_id, None)

    def epoch(self, cell_id: str, epochs_done: int, now: float | None = None) -> None:
        if cell_id not in self.finished and cell_id not in self.failed:
            self.running[cell_id] = max(self.running.get(cell_id, 0), int(epochs_done))
            self._progressed(now)

    def finish(self, cell_id: str, now: float | None = None) -> None:
        self.running.pop(cell_id, None)
        self.failed.pop(cell_id, None)
        self.finished.add(cell_id)
        self._progressed(now)

    def fail(self, cell_id: str, error: str, now: float | None = None) -> None:
        self.running.pop(cell_id, None)
        self.failed[cell_id] = error
        self._progressed(now)

    def _progressed(self, now: float | None) -> None:
        """The first progress's time and fraction: where the ETA's pace is measured from."""
        if self._first is None:
            fraction = self.fraction_done()
            if fraction > 0.0:
                self._first = (time.monotonic() if now is None else now, fraction)

    @property
    def left(self) -> int:
        self._sync_race()
        return max(0, self.to_run - len(self.finished) - len(self.failed) - len(self.running)) + self.cells_not_asked

    def fraction_done(self) -> float:
        self._sync_race()
        to_run = self.to_run + self.cells_not_asked
        if to_run == 0:
            return 1.0
        partial = sum(min(1.0, done / max(1, self.epochs.get(cell, 1))) for cell, done in self.running.items())
        return (len(self.finished) + len(self.failed) + partial) / to_run

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds left at the pace since the first progress (module docstring); None until
        there is a pace, 0 when all is done."""
        fraction = self.fraction_done()
        if fraction >= 1.0:
            return 0.0
        if self._first is None or fraction <= self._first[1]:
            return None
        then, done_then = self._first
        elapsed = (now if now is not None else time.monotonic()) - then
        if elapsed <= 0.0:
            return None
        return elapsed * (1.0 - fraction) / (fraction - done_then)

    def short_line(self, now: float | None = None) -> str:
        """The counts for a terminal's line, zeros left out: `[studies] done 3/15, 2 running,
        10 left | ETA 0:01:20` (a race: `done 3, ..., at most 10 left | ETA at most ...`)."""
        done = self.done_before + len(self.finished)
        race = self.race is not None
        parts = [f"{PREFIX} done {done}" + ("" if race else f"/{self.total_now()}")]
        parts += [f"{n} {what}" for n, what in ((len(self.running), "running"), (len(self.failed), "failed")) if n]
        left = self.left
        if left:
            parts.append(("at most " if race else "") + f"{left} left")
        text = ", ".join(parts)
        eta = self.eta_s(now)
        if (left or self.running) and eta is not None:
            text += f" | ETA {'at most ' if race else ''}{format_duration(eta)}"
        return text

    def line(self, now: float | None = None) -> str:
        done = self.done_before + len(self.finished)
        eta = self.eta_s(now)
        if self.race is not None:  # the total is not known in advance: an upper bound
            left = self.left
            return (
                f"{PREFIX} done {done}"
                + (f" ({self.done_before} before this run)" if self.done_before else "")
                + f" | running {len(self.running)} | failed {len(self.failed)}"
                + f" | left at most {left} | race: {self.race.summary()}"
                + ("" if eta is None else f" | ETA at most {format_duration(eta)}")
            )
        return (
            f"{PREFIX} done {done}/{self.total_now()}"
            + (f" ({self.done_before} before this run)" if self.done_before else "")
            + f" | running {len(self.running)} | failed {len(self.failed)}"
            + f" | left {self.left}"
            + ("" if eta is None else f" | ETA {format_duration(eta)}")
        )


#: shortest time between two rewrites of the live progress line
LIVE_REFRESH_S = 0.2


class ProgressReporter:
    """Keeps a `StudyProgress` from Tune's callback hooks (same names and arguments) and shows
    it. `on_error(cell_id)` is called for a cell whose trial errored in Tune.

    On a terminal, one line updated in place (carriage return) after every event, cut to the
    terminal's width, with the elapsed time and the best config so far; a failure gets a line
    of its own above it. Without a terminal (a log file, CI), no escape sequences and few
    lines, each with the time: the progress at most every `interval_s` seconds, every
    failure, and the final counts.

    `metric` (a per-epoch metric such as val/top5, with `mode`) and `labels` (cell_id -> the
    readable name of its config; `add_labels` for configs proposed later) make the "best so
    far": the config whose seeds' best values of the metric have the best mean, among the
    configs all of whose seeds have reported. It never goes backwards: a seed's best value
    only improves, and a config counts once every seed has one.
    """

    def __init__(
        self,
        progress: StudyProgress,
        interval_s: float = 30.0,
        stream: IO[str] | None = None,
        on_error=None,
        *,
        metric: str | None = None,
        mode: str = "max",
        labels: Mapping[str, str] | None = None,
        refresh_s: float = LIVE_REFRESH_S,
    ):
        self.progress = progress
        self.refresh_s = refresh_s  # on a terminal: the shortest time between two rewrites
        self.interval_s = interval_s
        self.stream = stream or sys.stdout
        self.live = is_terminal(self.stream)
        self._last_print = 0.0
        self._shown = ""
        self.on_error = on_error  # called with the cell_id of a cell that errored in Tune
        self.metric, self.mode = metric, mode
        self.labels: dict[str, str] = {}
        self._seeds: Counter = Counter()  # config key -> its cells (seeds) with a label
        self.add_labels(labels or {})
        self._best_of: dict[str, float] = {}  # cell_id -> best value of `metric` so far
        self._sums: dict[str, list] = {}  # config key -> [sum of its seeds' best values, seeds]

    def add_finished(self, values: Mapping[str, float], labels: Mapping[str, str]) -> None:
        """The cells an earlier invocation finished (cell_id -> its best value of `metric`, read
        from the ledger once at the start, and its config's label): the best so far is over
        every finished cell of the study, not only this invocation's."""
        self.add_labels(labels)
        for cell, value in values.items():
            self._record(cell, float(value))

    def add_labels(self, labels: Mapping[str, str]) -> None:
        """Readable names of (more) cells' configs: cell_id -> label."""
        for cell, label in labels.items():
            if cell not in self.labels:
                self._seeds[_config_key(cell)] += 1
            self.labels[cell] = label

    def name(self, cell: str) -> str:
        """The cell's run name (its config's label and seed), else its id."""
        label = self.labels.get(cell)
        seed = cell.rsplit("-s", 1)[1] if "-s" in cell else ""
        return f"{label} s{seed}" if label and seed else (label or cell)

    def _better(self, value: float, than: float) -> bool:
        return value > than if self.mode == "max" else value < than

    def _record(self, cell: str, value: float) -> None:
        """Each seed's best value, and each config's sum of them, up to date in O(1) per
        report, so that the best config costs one pass over the configs, not the cells."""
        if value != value:  # NaN
            return
        previous = self._best_of.get(cell)
        if previous is not None and not self._better(value, previous):
            return
        entry = self._sums.setdefault(_config_key(cell), [0.0, 0])
        if previous is None:
            entry[1] += 1
        else:
            entry[0] -= previous
        entry[0] += value
        self._best_of[cell] = value

    # ----- what is shown --------------------------------------------------------------------

    def best(self) -> tuple[str, float] | None:
        """(label, seed mean) of the best config so far among those whose seeds all reported."""
        means = {key: total / n for key, (total, n) in self._sums.items() if n >= max(1, self._seeds.get(key, 1))}
        if not means:
            return None
        pick = max if self.mode == "max" else min
        key = pick(means, key=lambda config: means[config])
        label = next((self.labels[c] for c in self._best_of if _config_key(c) == key and c in self.labels), key)
        return label, means[key]

    def status(self) -> str:
        """The progress line: counts, elapsed time, ETA, then the best config (on a terminal,
        cut to its width)."""
        elapsed = format_duration(time.monotonic() - self.progress.started_at)
        if self.live:
            text = self.progress.short_line().replace(" | ETA", f" | {elapsed}, ETA", 1)
            if " | " not in text:
                text += f" | {elapsed}"
        else:
            text = self.progress.line()
            text = (
                text.replace(" | ETA", f" | elapsed {elapsed} | ETA", 1)
                if " | ETA" in text
                else f"{text} | elapsed {elapsed}"
            )
        best = self.best()
        if best is not None and self.metric:  # an accuracy in percent, as the report prints it
            from analysis.units import shown

            text += f" | best {best[0]} {self.metric}={shown(self.metric, best[1])}"
        return fit_line(text, terminal_width(self.stream)) if self.live else text

    def _print(self, text: str) -> None:
        """A line of its own (a failure, a restart): above the live line on a terminal."""
        if self.live and self._shown:
            self.stream.write("\r\x1b[K")
        print(plain_line(text, self.stream), file=self.stream, flush=True)
        if self.live and self._shown:
            self.stream.write(self._shown)
            self.stream.flush()

    def _show(self, force: bool = False) -> None:
        """The progress: in place on a terminal, else at most every `interval_s` seconds."""
        now = time.monotonic()
        if self.live:  # at most refresh_s apart: a study of thousands of cells reports often
            if not force and now - self._last_print < self.refresh_s:
                return
            self._shown = self.status()
            self.stream.write("\r\x1b[K" + self._shown)
            self.stream.flush()
            self._last_print = now
            return
        if force or now - self._last_print >= self.interval_s:
            print(plain_line(self.status(), self.stream), file=self.stream, flush=True)
            self._last_print = now

    # ----- Tune's hooks ------------------------------------------------------------------------

    @staticmethod
    def _cell(trial) -> str:
        return str(trial.config.get("cell_id"))

    @staticmethod
    def _cells(trial) -> list[str]:
        """The cells a trial trains: its cell, or a fused array's members."""
        members = (trial.config.get("cell") or {}).get("members")
        return [str(m["cell_id"]) for m in members] if members else [str(trial.config.get("cell_id"))]

    def on_trial_start(self, iteration, trials, trial, **info):
        for cell in self._cells(trial):
            self.progress.start(cell)
        self._show(force=not self._last_print)  # the first line at once, then every interval

    def on_trial_result(self, iteration, trials, trial, result, **info):
        """Counts and the best value from an epoch's report (a fused array's name the member in
        `cell_id`); a line of its own for a failed cell and for a cell whose checkpoint could not
        be loaded (its first report says so: the session announced it would continue from that
        checkpoint)."""
        cell = str(result["cell_id"]) if result.get("cell_id") else self._cell(trial)
        status = result.get("cell_status")
        if result.get("restarted"):  # trial.RESTARTED_KEY: the first report of a restarted cell
            self._print(
                f"{PREFIX} cell {self.name(cell)}: its checkpoint could not be loaded "
                f"({result['restarted']}); restarted from epoch 0"
            )
        if self.metric and isinstance(result.get(self.metric), (int, float)):
            self._record(cell, float(result[self.metric]))
        if status == "failed":
            self.progress.fail(cell, str(result.get("error", "")))
            self._print(f"{PREFIX} cell {self.name(cell)} FAILED: {result.get('error', '')}")
        elif status == "finished":
            self.progress.finish(cell)
        elif "epochs_done" in result:
            self.progress.epoch(cell, int(result["epochs_done"]))
        self._show()

    def on_trial_complete(self, iteration, trials, trial, **info):
        for cell in self._cells(trial):
            if cell not in self.progress.failed and cell not in self.progress.finished:
                last = trial.last_result or {}
                if last.get("cell_status") == "failed" and str(last.get("cell_id", cell)) == cell:
                    self.progress.fail(cell, str(last.get("error", "")))
                else:
                    self.progress.finish(cell)
        self._show()

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._print(
            f"{PREFIX} cell {self.name(self._cell(trial))}: worker failed, restarting from "
            f"its last checkpoint ({trial_error(trial)})"
        )

    def on_trial_error(self, iteration, trials, trial, **info):
        error = trial_error(trial)
        for cell in self._cells(trial):
            if cell in self.progress.finished or cell in self.progress.failed:
                continue
            self.progress.fail(cell, error)
            self._print(f"{PREFIX} cell {self.name(cell)} FAILED: {error}")
            if self.on_error is not None:
                self.on_error(cell)
        self._show()

    def on_step_end(self, iteration, trials, **info):
        if self.progress.running:
            self._show()

    def on_experiment_end(self, trials, **info):
        """The final counts, on a line of their own."""
        if self.live:
            self.stream.write("\r\x1b[K")
            self._shown = ""
        print(plain_line(self.status(), self.stream), file=self.stream, flush=True)


def _config_key(cell_id: str) -> str:
    """The config part of a cell id (`<config_id>-s<seed>`)."""
    return cell_id.rsplit("-s", 1)[0]


def trial_error(trial: Any, limit: int = 600) -> str:
    """The last line of a Tune trial's error (its exception type and message)."""
    text = ""
    try:
        path = trial.error_file
        if path:
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
    except OSError:
        text = ""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "the trial's worker failed (no error message)"
    message = lines[-1]
    return message if len(message) <= limit else message[: limit - 3] + "..."
