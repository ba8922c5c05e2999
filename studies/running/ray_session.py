"""Ray for one run of the runner: connect or start it, count the trial slots, shut it down.

A `RaySession` connects to the cluster at `address`, or starts a local Ray instance, and
shuts down only a Ray that it started itself (a test or a notebook that initialised Ray
keeps it). Before Ray starts it sets the environment that Tune reads: trials keep the
driver's working directory, Ctrl-C reaches the runner as `KeyboardInterrupt`, no Tune
loggers or tables (MLflow is the log).

Starting a local Ray takes seconds of waiting for its processes, so the runner may `begin` it
in a background thread while it sets up its tracking store (`start` then waits for it); `stop`
shuts it down before the summary and the report, the driver waiting (see `stop`). A local Ray
starts only what a study uses: no worker processes started ahead (Tune's trials never run in
them: each trial gets a worker of its own). With `--keep-warm` the local Ray is a warm one that
later runs join (`studies.running.warm_ray`).

`ray` is imported only when the session starts.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import IO, Any

from studies.errors import RunnerError
from studies.running.warm_ray import LOCAL_SYSTEM_CONFIG, DriverLease


def _set_tune_environment() -> None:
    """What Tune reads from the environment, set before Ray starts."""
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"  # relative data paths stay valid
    # Ctrl-C raises KeyboardInterrupt here (Tune's own handler would end the run
    # quietly and advise Tuner.restore; the study is resumed with `studies resume`)
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # MLflow is the log
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Tune tables
    # Tune snapshots its experiment state whenever a trial's checkpoint replaces the
    # previous one (num_to_keep=1); that is expected here, not worth a warning each time
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # the Tune result loggers are off (MLflow is the log), so ResultGrid finds no
    # result.json; its warning about that is noise
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)


class RaySession:
    """Ray for one invocation of the runner (see the module docstring)."""

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        object_store_mb: int | None = None,
        dashboard: bool = False,
        keep_warm_minutes: float | None = None,
    ):
        self.address = address  # None: a local Ray instance
        self.dashboard = dashboard  # local Ray only: start Ray's dashboard (ray[default])
        self.dashboard_url: str | None = None
        self.num_cpus = num_cpus  # local Ray only; default: the machine's CPUs
        self.num_gpus = num_gpus  # local Ray only; default: detected
        self.object_store_mb = object_store_mb  # local Ray only
        # local Ray only: keep it warm this many minutes after the study (studies.running.warm_ray)
        self.keep_warm_minutes = keep_warm_minutes
        self.warm_lease: DriverLease | None = None  # the lease of the warm local Ray joined, if one was
        self.started = False
        self.cluster_gpus = 0.0  # the cluster's GPUs, counted by trial_slots
        self.cluster_cpus = 0.0  # the cluster's CPUs, counted by trial_slots
        self.node_cpus = 0.0  # the largest node's CPUs (a fused array takes at most those)
        self._holder: tuple[threading.Thread, threading.Event, threading.Event] | None = None  # `begin`'s
        self._start_error: BaseException | None = None

    @classmethod
    def of(cls, options) -> RaySession:
        """The Ray session of a run's `RunOptions` (`--keep-warm`, else ``STUDIES_KEEP_WARM``,
        for a local Ray); `RunnerError` for a keep-warm time that is not a positive number."""
        from studies.running.warm_ray import keep_warm_minutes

        try:
            minutes = None if options.address else keep_warm_minutes(options.keep_warm)
        except ValueError as error:
            raise RunnerError(str(error)) from None
        return cls(
            options.address,
            options.num_cpus,
            options.num_gpus,
            options.object_store_mb,
            dashboard=options.dashboard,
            keep_warm_minutes=minutes,
        )

    def __getstate__(self) -> dict:
        """Without its threads: Tune pickles its callbacks, and through them the session."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_holder", "_start_error")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _holder=None, _start_error=None)

    def begin(self) -> None:
        """Start (or connect to) Ray in a background thread; `start` waits for it. The thread
        holds Ray until `stop`: the processes a local Ray starts die with the thread that
        started them (Linux's parent-death signal is per thread), so it shuts Ray down itself."""
        if self._holder is not None or self.started:
            return
        ready, release = threading.Event(), threading.Event()

        def hold() -> None:
            try:
                self._init()
            except BaseException as error:  # noqa: BLE001 (raised again by `start`, in the caller's thread)
                self._start_error = error
                return
            finally:
                ready.set()
            release.wait()
            self._shutdown()

        _quiet_thread_warning()
        self._holder = (threading.Thread(target=hold, name="studies-ray", daemon=True), ready, release)
        self._holder[0].start()

    def start(self) -> None:
        """Connect to Ray, or start it (nothing when this process already initialised it);
        after `begin`, wait for its thread and raise what it raised."""
        if self._holder is None:
            self._init()
            return
        self._holder[1].wait()
        error, self._start_error = self._start_error, None
        if error is not None:
            self._holder = None
            raise error

    def _init(self) -> None:
        import ray

        _set_tune_environment()
        if ray.is_initialized():
            return
        level = int(os.environ.get("STUDIES_RAY_LOG_LEVEL", logging.ERROR))  # --verbose: INFO
        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": level}
        if self.address:
            ray.init(address=self.address, include_dashboard=False, **kwargs)
        elif self._join_warm(kwargs):
            pass
        else:
            context = ray.init(
                include_dashboard=self.dashboard,
                dashboard_host="127.0.0.1",
                address="local",
                num_cpus=self.num_cpus or os.cpu_count() or 1,
                num_gpus=self.num_gpus,
                object_store_memory=(self.object_store_mb * 1024**2 if self.object_store_mb else None),
                _system_config=LOCAL_SYSTEM_CONFIG,  # studies.running.warm_ray's
                **kwargs,
            )
            url = getattr(context, "dashboard_url", None) if self.dashboard else None
            self.dashboard_url = f"http://{url}" if url and "://" not in url else url
        self.started = True

    def _join_warm(self, kwargs: dict[str, Any]) -> bool:
        """Connect to the warm local Ray of this environment, launching it first when this run
        keeps one warm (`studies.running.warm_ray`); False: start a Ray of its own (a dashboard
        asked, nothing warm and nothing to keep, or the warm one could not be joined)."""
        if self.dashboard:
            return False
        from studies.running import warm_ray

        key = warm_ray.environment_key(self.num_cpus, self.num_gpus, self.object_store_mb)
        idle_s = 60.0 * self.keep_warm_minutes if self.keep_warm_minutes else None
        warm = warm_ray.find(key)
        if warm is None and idle_s:
            warm = warm_ray.launch(key, idle_s, self.num_cpus, self.num_gpus, self.object_store_mb)
        lease = warm.join(idle_s) if warm is not None else None
        if warm is None or lease is None:
            return False
        import ray

        try:
            ray.init(address=warm.address, **kwargs)
        except Exception:  # noqa: BLE001 (its supervisor ended meanwhile: a Ray of its own)
            lease.release()
            return False
        self.warm_lease = lease
        return True

    def warm_note(self) -> str | None:
        """When the warm local Ray this run used stops, as a line for the end of the run."""
        if self.warm_lease is None:
            return None
        import time

        until = time.strftime("%H:%M", time.localtime(self.warm_lease.until()))
        return (
            f"{self.warm_lease.warm.describe()} stays warm until {until} unless another study uses it; "
            f"`studies stop --local` ends it now"
        )

    def trial_slots(self, study, stream: IO[str]) -> int:
        """How many trials of `study` run at once on this cluster (its resources per trial, a
        fused array's `trial_resources`, and `max_concurrent`). A local Ray too small for one
        trial raises `RunnerError`; a cluster may still scale up, so there it is a warning and
        one slot."""
        import ray

        from studies.cells.arrays import trial_resources

        resources = ray.cluster_resources()
        self.cluster_cpus = float(resources.get("CPU", 0.0))
        self.node_cpus = max(
            (float(n.get("Resources", {}).get("CPU", 0.0)) for n in ray.nodes() if n.get("Alive")), default=0.0
        )
        cpus, gpus = trial_resources(study.resources, int(study.resources.seeds_per_trial), self.node_cpus or None)
        slots = math.floor(resources.get("CPU", 0.0) / cpus + 1e-9)
        if gpus > 0:
            slots = min(slots, math.floor(resources.get("GPU", 0.0) / gpus + 1e-9))
        if study.max_concurrent:
            slots = min(slots, int(study.max_concurrent))
        self.cluster_gpus = float(resources.get("GPU", 0.0))
        if slots < 1:
            message = (
                f"{study.path}: resources per trial (cpus: {cpus:g}, gpus: {gpus:g}) "
                f"do not fit on the Ray cluster (CPU: {resources.get('CPU', 0):g}, "
                f"GPU: {resources.get('GPU', 0):g}); lower 'resources' or add nodes"
            )
            if not self.address:
                raise RunnerError(message)
            from studies.running.progress import say

            say(stream, f"warning: {message}")
            slots = 1
        return slots

    def gpu_sharing(self, gpus_per_trial: float, slots: int) -> int:
        """How many trials share each GPU (0 without GPUs); see `trials_per_gpu`."""
        return trials_per_gpu(gpus_per_trial, slots, self.cluster_gpus)

    def stop(self) -> None:
        """Shut Ray down if this session started it (after a `begin` still under way, once it
        is up) and wait for it: nothing of the driver may run meanwhile (Ray 2.60 ends the
        process when another thread drops an object reference while Ray shuts down: measured,
        a report drawn during the shutdown killed the driver)."""
        if self._holder is not None:
            thread, ready, release = self._holder
            self._holder = None
            ready.wait()
            release.set()  # the holding thread shuts down what it started
            thread.join()
        else:
            self._shutdown()

    def _shutdown(self) -> None:
        """Ray shut down (a warm local Ray: this driver disconnected, its lease released)."""
        if self.started:
            import ray

            ray.shutdown()
            self.started = False
        if self.warm_lease is not None:
            self.warm_lease.release()


def _quiet_thread_warning() -> None:
    """Ray's warning that `ray.init` outside the main thread sets no SIGTERM handler: the
    runner installs its own once Ray is up (`studies.running.termination.trap`)."""
    logger = logging.getLogger("ray._private.worker")
    if not any(isinstance(f, _NoSigtermWarning) for f in logger.filters):
        logger.addFilter(_NoSigtermWarning())


class _NoSigtermWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def trials_per_gpu(gpus_per_trial: float, slots: int, cluster_gpus: float) -> int:
    """How many of `slots` concurrent trials share each GPU when every trial asks for
    `gpus_per_trial` of one (Ray packs fractions onto one GPU: 1 / 0.25 = 4 trials) on a
    cluster of `cluster_gpus` GPUs, spread evenly; 0 when the trials ask for no GPU."""
    if gpus_per_trial <= 0 or slots < 1:
        return 0
    fit = max(1, math.floor(1.0 / gpus_per_trial + 1e-9))
    return min(fit, math.ceil(slots / max(1.0, math.floor(cluster_gpus + 1e-9))))
