"""One driver per study: a lease held in the tracking store, renewed by a heartbeat.

Two ``studies run`` (or ``resume``) of the same study at once would run every cell twice and
take each other's checkpoints. The lease lives where every driver of a study looks, the
study's MLflow experiment (so it works with a remote tracking server and a shared storage
alike): an experiment tag ``studies.lease.<token>`` whose JSON value names its holder (host,
pid, since) and carries a heartbeat time, refreshed every ``heartbeat_s`` seconds by a
background thread. It is a tag, not a run, so the study's runs stay the cells and the parent.

MLflow has no compare-and-swap, so taking the lease is *write, then look*: a driver writes
its lease tag, then lists the live leases of the study. It holds the lease only if its own is
the only live one; otherwise it withdraws (deletes its tag) and either refuses, naming the
holder, or waits. Two drivers that write at the same moment both see two leases, both
withdraw, and retry after a random pause, so at most one ever holds it. A lease whose
heartbeat is older than ``stale_s`` (a killed driver), or whose holder is a dead process on
this host, is stale: the next driver deletes it and takes over. Clocks of the hosts are
assumed to agree to well within ``stale_s`` (NTP). A released lease is deleted.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from analysis.layout import TAG_LEASE_PREFIX
from studies.errors import option
from studies.tracking import with_retry

__all__ = ["StudyLease", "LeaseHeld", "Holder", "HEARTBEAT_S", "STALE_S"]

#: seconds between two heartbeats of the holder
HEARTBEAT_S = 10.0
#: a lease whose heartbeat is older than this is taken over (a killed driver)
STALE_S = 60.0
#: attempts at taking a free lease when other drivers try at the same moment
_CONTENDED_ATTEMPTS = 8


@dataclass(frozen=True)
class Holder:
    """Who holds a study's lease."""

    token: str  # the lease's tag is TAG_LEASE_PREFIX + token
    host: str
    pid: int
    since: float
    heartbeat: float

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        age = max(0.0, time.time() - self.heartbeat)
        return f"host {self.host}, pid {self.pid}, since {since} (last heartbeat {age:.0f} s ago)"


class LeaseHeld(RuntimeError):
    """Another driver holds the study's lease; ``holder`` says who."""

    def __init__(self, study: str, holder: Holder):
        self.holder = holder
        super().__init__(
            f"study {study!r} is being run by another driver ({holder.describe()}); wait for "
            f"it to finish, stop it, or pass {option('wait')} to start when it is done"
        )


class StudyLease:
    """The lease of one study in one MLflow experiment; a context manager.

    ``acquire(wait=False)`` raises :class:`LeaseHeld` when another live driver holds it;
    with ``wait=True`` it polls until the lease is free (or ``timeout_s`` passes).
    """

    def __init__(
        self,
        client,
        experiment_id: str,
        study_name: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_s: float = STALE_S,
        clock: Callable[[], float] = time.time,
        warn: Callable[[str], None] = lambda text: None,
    ):
        if stale_s <= heartbeat_s:
            raise ValueError(f"stale_s ({stale_s}) must exceed heartbeat_s ({heartbeat_s})")
        self.client, self.experiment_id, self.study_name = client, experiment_id, study_name
        self.heartbeat_s, self.stale_s, self.clock, self.warn = heartbeat_s, stale_s, clock, warn
        self.token: str | None = None
        self._since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- taking and giving back ---------------------------------------------------------

    def acquire(self, wait: bool = False, timeout_s: float | None = None, poll_s: float = 5.0) -> None:
        """Hold the lease, or raise LeaseHeld (at once, or after ``timeout_s`` when waiting)."""
        deadline = None if timeout_s is None else self.clock() + timeout_s
        contended = 0
        while True:
            others = self._live_leases()
            if not others:
                self.token = self._write_lease()
                rivals = [h for h in self._live_leases() if h.token != self.token]
                if not rivals:
                    self._start_heartbeat()
                    return
                self._delete(self.token)  # someone wrote at the same moment: both withdraw
                self.token = None
                contended += 1
                if contended < _CONTENDED_ATTEMPTS:
                    time.sleep(random.uniform(0.05, 0.5) * contended)
                    continue
                others = rivals
            if not wait or (deadline is not None and self.clock() >= deadline):
                raise LeaseHeld(self.study_name, others[0])
            time.sleep(poll_s)

    def release(self) -> None:
        """Stop the heartbeat and delete the lease (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
            self._thread = None
        if self.token is not None:
            try:
                self._delete(self.token)
            except Exception as error:  # noqa: BLE001 (the store is gone: the lease goes stale by itself)
                self.warn(f"could not release the study's lease ({error}); it expires in {self.stale_s:.0f} s")
            self.token = None

    def __enter__(self) -> StudyLease:
        if self.token is None:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ----- the store ----------------------------------------------------------------------

    def _value(self, since: float) -> str:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since, "heartbeat": self.clock()})

    def _write_lease(self) -> str:
        token = uuid.uuid4().hex[:12]
        self._since = self.clock()
        with_retry(
            lambda: self.client.set_experiment_tag(
                self.experiment_id, TAG_LEASE_PREFIX + token, self._value(self._since)
            )
        )
        return token

    def _delete(self, token: str) -> None:
        with_retry(lambda: self.client.delete_experiment_tag(self.experiment_id, TAG_LEASE_PREFIX + token))

    def _live_leases(self) -> list[Holder]:
        """The live leases of the study, oldest first; stale ones are deleted on the way."""
        tags = with_retry(lambda: self.client.get_experiment(self.experiment_id)).tags
        live = []
        for key, value in tags.items():
            if not key.startswith(TAG_LEASE_PREFIX):
                continue
            holder = _holder(key[len(TAG_LEASE_PREFIX) :], value)
            if holder.token == self.token:
                live.append(holder)
            elif self._is_stale(holder):
                try:
                    self._delete(holder.token)
                except Exception:  # noqa: BLE001 (another driver deleted it first)
                    pass
            else:
                live.append(holder)
        return sorted(live, key=lambda h: (h.since, h.token))

    def _is_stale(self, holder: Holder) -> bool:
        if self.clock() - holder.heartbeat > self.stale_s:
            return True
        return holder.host == socket.gethostname() and not _process_alive(holder.pid)

    # ----- heartbeat ----------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="studies-lease-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(self.heartbeat_s):
            token = self.token
            if token is None:
                return
            try:
                with_retry(
                    lambda: self.client.set_experiment_tag(
                        self.experiment_id, TAG_LEASE_PREFIX + token, self._value(self._since)
                    )
                )
                if failing:
                    self.warn("the tracking server answers again: the study's lease is renewed")
                failing = False
            except Exception as error:  # noqa: BLE001 (any store failure: warned, retried next heartbeat)
                if not failing:
                    self.warn(f"cannot renew the study's lease ({error}); retrying every {self.heartbeat_s:.0f} s")
                failing = True


def _holder(token: str, value: str) -> Holder:
    try:
        data = json.loads(value)
    except ValueError:
        data = {}

    def number(key: str, default: float = 0.0) -> float:
        try:
            return float(data.get(key, default))
        except (TypeError, ValueError):
            return default

    return Holder(token, str(data.get("host", "?")), int(number("pid", -1)), number("since"), number("heartbeat"))


def _process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
