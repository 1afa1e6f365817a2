"""The one-node Ray cluster pixelrl starts for itself: reachable from this machine only, and
never outliving the process that started it.

Loopback: Ray servers (GCS, raylet, object manager, core workers, agents) listen on all
interfaces unless the node's address is 127.0.0.1, and Ray replaces a requested 127.0.0.1 by the
host's address whenever multi-node clusters are enabled. A cluster pixelrl starts itself serves
only this process, so it starts with multi-node clusters disabled for the duration of
`ray.init`; joining a cluster (`trainer.ray_address`, `RAY_ADDRESS`) is left as configured.

Token authentication, Ray's default for a new local cluster, stays on (another user of the
machine cannot submit work to it); Ray's note that it is on, the first line every demo printed,
is left out (every other authentication message shows), as are Ray's INFO lines at start-up.

No orphans: Ray ties the GCS and the raylet to the driver's life, but the agents the raylet
starts (dashboard agent, runtime-env agent) survive a SIGKILL of the driver. A watchdog process
(`python -m pixelrl.workers.local_ray <pid>`, in its own session so a Ctrl-C in the terminal
does not reach it first) keeps a list of the driver's descendants and, when the pipe it holds to
the driver closes (the driver ended, however it ended), freezes every one still running (so none
can start another), looks once more for their children, and kills them all.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

_MULTI_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's own switch; "0" = this node only
# the logger of Ray's note that a new local cluster turned token authentication on by default
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_watchdog: subprocess.Popen | None = None


def start_local_ray(num_cpus: int) -> None:
    """Start a one-node Ray cluster listening on loopback only, watched by the watchdog."""
    import ray
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_MULTI_NODE_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_MULTI_NODE_SWITCH] = "0"  # read by the processes ray.init spawns
    ray_constants.ENABLE_RAY_CLUSTER = False  # read by this process when it picks the node address
    quiet = _QuietDefaultAuthNote()
    logging.getLogger(_AUTH_LOGGER).addFilter(quiet)
    try:
        # logging_level: Ray's INFO lines (`Started a local Ray instance.`) say nothing to the user
        # of a cluster pixelrl started for itself; its warnings and errors still show
        ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False,
                 logging_level=logging.WARNING)
    finally:
        logging.getLogger(_AUTH_LOGGER).removeFilter(quiet)
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_MULTI_NODE_SWITCH, None)
        else:
            os.environ[_MULTI_NODE_SWITCH] = saved_env
    _start_watchdog()


class _QuietDefaultAuthNote(logging.Filter):
    """Drops Ray's note that token authentication is on by default (it stays on); any other
    authentication message, a missing token or a disabled mode, still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def _start_watchdog() -> None:
    global _watchdog
    if _watchdog is not None and _watchdog.poll() is None:
        return  # one per driver process: it watches every cluster this process starts
    _watchdog = subprocess.Popen([sys.executable, "-m", "pixelrl.workers.local_ray", str(os.getpid())],
                                 stdin=subprocess.PIPE, start_new_session=True, close_fds=True)


def _watch(driver_pid: int, period_s: float = 0.5, grace_s: float = 3.0) -> None:
    """Track the driver's descendants until stdin closes, then stop those still running."""
    import select

    import psutil

    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    while True:
        try:
            for child in driver.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        readable, _, _ = select.select([sys.stdin], [], [], period_s)
        if readable and not os.read(sys.stdin.fileno(), 1):
            break  # EOF: the driver is gone
    # is_running() compares creation times, so a reused pid is never touched
    alive = {p.pid: p for p in known.values() if p.is_running()}
    # freeze the tree before the last look at it: a raylet starting a worker between the last
    # poll and the kill would otherwise leave that worker behind, unseen
    frozen: set[int] = set()
    while len(frozen) < len(alive):
        for pid, proc in list(alive.items()):
            if pid in frozen:
                continue
            frozen.add(pid)
            try:
                proc.suspend()
                alive.update({c.pid: c for c in proc.children(recursive=True) if c.pid != me})
            except psutil.NoSuchProcess:
                pass
    for proc in alive.values():  # a stopped process dies of SIGKILL at once
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(alive.values()), timeout=grace_s)


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
