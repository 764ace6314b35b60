"""This process's threads as the OS sees them (Linux's /proc/self/task): their ids and names.

Python names its threads only for itself, so a thread it starts shows to the OS as the process
(`attnserve`) unless it names itself (`name_os_thread`). Every function here does nothing, or finds
nothing, where there is no /proc.
"""

from __future__ import annotations

import os
import threading

TASKS = "/proc/self/task"
NAME_BYTES = 15  # Linux keeps this much of a thread's name


def name_os_thread(name: str) -> None:
    """Names the calling thread for the OS, as `top -H`, `ps -L` and /proc/PID/task/*/comm show it;
    threads it starts inherit the name, OpenMP's pool among them."""
    try:
        with open(f"{TASKS}/{threading.get_native_id()}/comm", "wb") as comm:
            comm.write(name.encode()[:NAME_BYTES])
    except OSError:  # not Linux, or no /proc: the name is only a convenience
        pass


def thread_ids() -> list[int]:
    """The native ids of this process's threads now."""
    try:
        return [int(tid) for tid in os.listdir(TASKS)]
    except OSError:
        return []


def thread_name(tid: int) -> str:
    """The OS's name for thread `tid` of this process; "" if it has ended."""
    try:
        with open(f"{TASKS}/{tid}/comm", "rb") as comm:
            return comm.read().decode(errors="replace").rstrip("\n")
    except OSError:
        return ""


def named_threads(name: str) -> set[int]:
    """This process's threads that the OS knows by `name` (as `name_os_thread` would store it)."""
    stored = name.encode()[:NAME_BYTES].decode(errors="replace")
    return {tid for tid in thread_ids() if thread_name(tid) == stored}
