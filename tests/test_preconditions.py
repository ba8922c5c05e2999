"""Preconditions of a run, checked before the first trial: each names the path or value."""

from __future__ import annotations

import socket

from studies.running import preconditions


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unwritable_output_folder_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    problems = preconditions.writable_folder(blocker / "study", "the output folder")
    assert len(problems) == 1 and str(blocker / "study") in problems[0] and "not writable" in problems[0]
    assert preconditions.writable_folder(tmp_path / "fine", "the output folder") == []


def test_a_tracking_server_that_does_not_answer_is_named(tmp_path):
    uri = f"http://127.0.0.1:{_free_port()}"
    problems = preconditions.tracking_reachable(uri, timeout_s=2)
    assert len(problems) == 1 and uri in problems[0] and "does not answer" in problems[0]
    assert preconditions.tracking_reachable(f"sqlite:///{tmp_path}/mlflow.db") == []


def test_missing_data_roots_are_named_once_per_data_set(tmp_path):
    configs = [{"name": "cifar100", "root": str(tmp_path / "nowhere")}] * 3 + [
        {"name": "plantnet300k", "root": str(tmp_path)},
        {"name": "synthetic"},
    ]
    problems = preconditions.data_layouts(configs)
    assert len(problems) == 2
    assert str(tmp_path / "nowhere") in problems[0] and "CIFAR-100 folder does not exist" in problems[0]
    assert "plantnet300k" in problems[1] and "missing split folder" in problems[1]
    assert preconditions.data_layouts([{"name": "cifar100", "root": None, "download": True}]) == []


def test_check_all_reports_every_problem_in_order(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    problems = preconditions.check_all(
        blocker / "out",
        f"http://127.0.0.1:{_free_port()}",
        str(blocker / "st"),
        [{"name": "imagenet_lt", "root": str(tmp_path / "in")}],
    )
    assert [p.split(" ")[1] for p in problems] == ["output", "trial", "tracking", "of"]
