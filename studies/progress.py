"""Progress of a running study on the driver: cells done / running / failed / left, and ETA.

`StudyProgress` is the bookkeeping; `ProgressReporter` feeds it from the hooks of Tune's
driver-side callback (`on_trial_start`, ...; `studies.tune_experiment.ProgressCallback` is the
Tune callback made of it) and prints a line whenever a cell starts, ends or fails, and at
least every `interval_s` seconds while cells run. A failed cell is printed with its error;
it does not stop the others. Both are plain Python: no Ray here.

ETA: the fraction of the work done in this session is
(cells finished + sum over running cells of epochs done / epochs) / cells to run; the time
left is elapsed * (1 - fraction) / fraction. It counts partial epochs of running cells, so
it is available before the first cell ends, and it follows the real concurrency.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Mapping


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
    # a racing study's race (studies.race_driver.RaceDriver): how many cells run is decided
    # as they finish, so `to_run` follows the race's upper bound
    race: Any = None

    def _sync_race(self) -> None:
        """`to_run` = cells started or finished in this session + the most the race may start."""
        if self.race is not None:
            self.to_run = (len(self.finished) + len(self.failed) + len(self.running)
                           + self.race.upper_bound_left())

    def start(self, cell_id: str) -> None:
        self.running.setdefault(cell_id, 0)
        self.failed.pop(cell_id, None)

    def epoch(self, cell_id: str, epochs_done: int) -> None:
        if cell_id not in self.finished and cell_id not in self.failed:
            self.running[cell_id] = max(self.running.get(cell_id, 0), int(epochs_done))

    def finish(self, cell_id: str) -> None:
        self.running.pop(cell_id, None)
        self.failed.pop(cell_id, None)
        self.finished.add(cell_id)

    def fail(self, cell_id: str, error: str) -> None:
        self.running.pop(cell_id, None)
        self.failed[cell_id] = error

    @property
    def left(self) -> int:
        self._sync_race()
        return max(0, self.to_run - len(self.finished) - len(self.failed) - len(self.running))

    def fraction_done(self) -> float:
        self._sync_race()
        if self.to_run == 0:
            return 1.0
        partial = sum(min(1.0, done / max(1, self.epochs.get(cell, 1)))
                      for cell, done in self.running.items())
        return (len(self.finished) + len(self.failed) + partial) / self.to_run

    def eta_s(self, now: float | None = None) -> float | None:
        fraction = self.fraction_done()
        if fraction <= 0.0:
            return None
        elapsed = (now if now is not None else time.monotonic()) - self.started_at
        return elapsed * (1.0 - fraction) / fraction

    def line(self, now: float | None = None) -> str:
        done = self.done_before + len(self.finished)
        if self.race is not None:  # the total is not known in advance: an upper bound
            left = self.left
            return (f"[studies] done {done}"
                    + (f" ({self.done_before} before this run)" if self.done_before else "")
                    + f" | running {len(self.running)} | failed {len(self.failed)}"
                    + f" | left at most {left} | race: {self.race.summary()}"
                    + f" | ETA at most {format_duration(self.eta_s(now))}")
        return (f"[studies] done {done}/{self.total}"
                + (f" ({self.done_before} before this run)" if self.done_before else "")
                + f" | running {len(self.running)} | failed {len(self.failed)}"
                + f" | left {self.left} | ETA {format_duration(self.eta_s(now))}")


#: shortest time between two rewrites of the live progress line
LIVE_REFRESH_S = 0.2


class ProgressReporter:
    """Keeps a `StudyProgress` from Tune's callback hooks (same names and arguments) and shows
    it. `on_error(cell_id)` is called for a cell whose trial errored in Tune.

    On a terminal, one line updated in place (carriage return) after every event, with the
    best config so far and the elapsed time; a failure gets a line of its own above it. Without
    a terminal (a log file, CI), no escape sequences and few lines: the progress at most every
    `interval_s` seconds, every failure, and the final counts.

    `metric` (a per-epoch metric such as val/top5, with `mode`) and `labels` (cell_id -> the
    readable name of its config) make the "best so far": the config whose seed-mean of the
    metric's latest value is best.
    """

    def __init__(self, progress: StudyProgress, interval_s: float = 30.0,
                 stream: IO[str] | None = None, on_error=None, *, metric: str | None = None,
                 mode: str = "max", labels: Mapping[str, str] | None = None,
                 refresh_s: float = LIVE_REFRESH_S):
        self.progress = progress
        self.refresh_s = refresh_s  # on a terminal: the shortest time between two rewrites
        self.interval_s = interval_s
        self.stream = stream or sys.stdout
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_print = 0.0
        self._shown = ""
        self._on_error = on_error  # called with the cell_id of a cell that errored in Tune
        self.metric, self.mode = metric, mode
        self.labels = dict(labels or {})
        self._latest: dict[str, float] = {}  # cell_id -> latest value of `metric`
        self._sums: dict[str, list] = {}  # config label -> [sum of its seeds' latest values, seeds]

    def _record(self, cell: str, value: float) -> None:
        """Keep each config's sum over its seeds up to date in O(1) per report, so that the
        best config costs one pass over the configs when a line is shown, not over the cells."""
        label = self.labels.get(cell, cell.rsplit("-s", 1)[0])
        entry = self._sums.setdefault(label, [0.0, 0])
        if cell in self._latest:
            entry[0] -= self._latest[cell]
        else:
            entry[1] += 1
        entry[0] += value
        self._latest[cell] = value

    # ----- what is shown --------------------------------------------------------------------

    def best(self) -> tuple[str, float] | None:
        """(label, seed-mean) of the best config so far by the latest values of `metric`."""
        if not self._sums:
            return None
        means = {label: total / n for label, (total, n) in self._sums.items()}
        pick = max if self.mode == "max" else min
        label = pick(means, key=means.get)
        return label, means[label]

    def status(self) -> str:
        text = self.progress.line()
        best = self.best()
        if best is not None:
            text += f" | best {best[0]} {self.metric}={best[1]:.4g}"
        if self.live:
            text += f" | {format_duration(time.monotonic() - self.progress.started_at)}"
        return text

    def _print(self, text: str) -> None:
        """A line of its own (a failure, a restart): above the live line on a terminal."""
        if self.live and self._shown:
            self.stream.write("\r\x1b[K")
        print(text, file=self.stream, flush=True)
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
        text = self.status()
        if force or now - self._last_print >= self.interval_s:
            print(text, file=self.stream, flush=True)
            self._last_print = now

    # ----- Tune's hooks ------------------------------------------------------------------------

    @staticmethod
    def _cell(trial) -> str:
        return str(trial.config.get("cell_id"))

    def on_trial_start(self, iteration, trials, trial, **info):
        self.progress.start(self._cell(trial))
        self._show(force=not self._last_print)  # the first line at once, then every interval

    def on_trial_result(self, iteration, trials, trial, result, **info):
        cell = self._cell(trial)
        status = result.get("cell_status")
        if self.metric and isinstance(result.get(self.metric), (int, float)):
            self._record(cell, float(result[self.metric]))
        if status == "failed":
            self.progress.fail(cell, str(result.get("error", "")))
            self._print(f"[studies] cell {cell} FAILED: {result.get('error', '')}")
        elif status == "finished":
            self.progress.finish(cell)
        elif "epochs_done" in result:
            self.progress.epoch(cell, int(result["epochs_done"]))
        self._show()

    def on_trial_complete(self, iteration, trials, trial, **info):
        cell = self._cell(trial)
        if cell not in self.progress.failed and cell not in self.progress.finished:
            last = trial.last_result or {}
            if last.get("cell_status") == "failed":
                self.progress.fail(cell, str(last.get("error", "")))
            else:
                self.progress.finish(cell)
        self._show()

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._print(f"[studies] cell {self._cell(trial)}: worker failed, restarting from its "
                    f"last checkpoint ({trial_error(trial)})")

    def on_trial_error(self, iteration, trials, trial, **info):
        cell = self._cell(trial)
        error = trial_error(trial)
        self.progress.fail(cell, error)
        self._print(f"[studies] cell {cell} FAILED: {error}")
        self._show()
        if self._on_error is not None:
            self._on_error(cell)

    def on_step_end(self, iteration, trials, **info):
        if self.progress.running:
            self._show()

    def on_experiment_end(self, trials, **info):
        """The final counts, on a line of their own."""
        if self.live:
            self.stream.write("\r\x1b[K")
            self._shown = ""
        print(self.status(), file=self.stream, flush=True)


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
