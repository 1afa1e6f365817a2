"""The one-node Ray cluster pixelrl starts for itself: reachable from this machine only, and
never outliving the process that started it.

Loopback: Ray servers (GCS, raylet, object manager, core workers, agents) listen on all
interfaces unless the node's address is 127.0.0.1, and Ray replaces a requested 127.0.0.1 by the
host's address whenever multi-node clusters are enabled. A cluster pixelrl starts itself serves
only this process, so it starts with multi-node clusters disabled for the duration of
`ray.init`; joining a cluster (`trainer.ray_address`, `RAY_ADDRESS`) is left as configured.

No orphans: Ray ties the GCS and the raylet to the driver's life, but the agents the raylet
starts (dashboard agent, runtime-env agent) survive a SIGKILL of the driver. A watchdog process
(`python -m pixelrl.workers.local_ray <pid>`, in its own session so a Ctrl-C in the terminal
does not reach it first) keeps a list of the driver's descendants and, when the pipe it holds to
the driver closes (the driver ended, however it ended), stops every one still running.
"""

from __future__ import annotations

import os
import subprocess
import sys

_MULTI_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's own switch; "0" = this node only
_watchdog: subprocess.Popen | None = None


def start_local_ray(num_cpus: int) -> None:
    """Start a one-node Ray cluster listening on loopback only, watched by the watchdog."""
    import ray
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_MULTI_NODE_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_MULTI_NODE_SWITCH] = "0"  # read by the processes ray.init spawns
    ray_constants.ENABLE_RAY_CLUSTER = False  # read by this process when it picks the node address
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_MULTI_NODE_SWITCH, None)
        else:
            os.environ[_MULTI_NODE_SWITCH] = saved_env
    _start_watchdog()


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
    alive = [p for p in known.values() if p.is_running()]
    for proc in alive:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=grace_s)
    for proc in still:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
