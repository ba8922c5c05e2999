"""What a person sees in a terminal of 80 columns: `studies run` in a real pseudo-terminal
(its size set with TIOCSWINSZ), the bytes it writes played on a small screen model (carriage
return, erase to the end of the line, wrapping at the last column)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WIDTH = 80


class Screen:
    """The rows a terminal of `width` columns shows for what a program wrote, and whether any
    row was longer than the width (the terminal wrapped it)."""

    def __init__(self, width: int):
        self.width, self.rows, self.col, self.wrapped = width, [""], 0, []

    def feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            char = text[i]
            if text.startswith("\x1b[K", i):
                self.rows[-1] = self.rows[-1][: self.col]
                i += 3
                continue
            if char == "\x1b":  # another escape sequence: skip to its final letter
                j = i + 1
                while j < len(text) and not text[j].isalpha():
                    j += 1
                i = j + 1
                continue
            if char == "\r":
                self.col = 0
            elif char == "\n":
                self.rows.append("")
                self.col = 0
            elif char >= " ":
                if self.col >= self.width:  # the terminal wraps: the row was too long
                    self.wrapped.append(self.rows[-1])
                    self.rows.append("")
                    self.col = 0
                row = self.rows[-1]
                self.rows[-1] = row[: self.col] + char + row[self.col + 1 :]
                self.col += 1
            i += 1


def run_in_terminal(args: list[str], width: int = WIDTH, timeout: float = 600) -> tuple[int, str]:
    """Run `python -m studies.cli ARGS` with stdout and stderr on a pseudo-terminal of `width`
    columns; (exit code, everything it wrote)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, width, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(REPO), TERM="xterm")
    env.pop("COLUMNS", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "studies.cli", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the last writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif process.poll() is not None:
                break
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", errors="replace")


def test_the_screen_model_wraps_long_rows_and_plays_carriage_returns():
    screen = Screen(10)
    screen.feed("abc\r\x1b[Kxy\r\nhello world!\r\n")
    assert screen.rows == ["xy", "hello worl", "d!", ""] and screen.wrapped == ["hello worl"]


@pytest.mark.slow
def test_a_run_on_an_80_column_terminal_fits_and_leaves_one_progress_line(tmp_path):
    """The quickstart (smoke, two seeds, set on the command line) in a pseudo-terminal of 80
    columns: no row wider than the terminal, one progress line on the final screen that agrees
    with the summary, the overrides kept with the run."""
    out = tmp_path / "out"
    code, text = run_in_terminal(
        ["run", "studies/catalog/quickstart.yaml", "--smoke", "seeds=[0,1]", "--output", str(out), "--num-cpus", "2"]
    )
    screen = Screen(WIDTH)
    screen.feed(text)
    shown = "\n".join(screen.rows)
    assert code == 0, shown
    assert "\r" in text and "\x1b[K" in text  # the progress was rewritten in place
    assert screen.wrapped == [], screen.wrapped
    progress = [row for row in screen.rows if row.startswith("[studies] done ")]
    assert len(progress) == 1, shown
    assert progress[0].startswith("[studies] done 10/10 |"), progress  # two seeds x 5 configs
    assert re.search(r" val/top5=\d{1,3}\.\d%$", progress[0]), progress  # in percent, as the report
    assert "[studies] summary: 10/10 cells finished" in shown
    assert any(row.startswith("[studies] report: ") for row in screen.rows), shown
    assert "Traceback" not in text
    # the overrides are part of the run's provenance: the resolved file and run.json
    study_dir = out / "quickstart-smoke"
    kept = yaml.safe_load((study_dir / "study.yaml").read_text())
    assert kept["seeds"] == [0, 1] and "#   seeds=[0,1]" in (study_dir / "study.yaml").read_text()
    assert json.loads((study_dir / "run.json").read_text())["overrides"] == ["seeds=[0,1]"]
