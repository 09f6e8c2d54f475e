"""The user job processes run as: never the node agent's own.

A node agent holds NATS credentials, and beside it on the machine lie the cluster's
secrets (``nats.conf``, ``up.json``) and the environments of the services. A job runs
whatever code its tenant gave it, so it runs as an unprivileged user of its own, in a
working directory of its own (mode 0700, owned by that user): it cannot read the
agent's files or ``/proc/<pid>/environ`` of any service.

Switching users needs root. The setting (``GPUSCHED_JOB_USER``, ``--job-user``) is a
user name, a numeric uid (no passwd entry needed; its group is the same number),
``auto`` (the system user ``gpusched-job``, created where missing) or ``self`` (the
agent's own user, said loudly: jobs can then read what the agent can).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: the system user ``auto`` takes, and creates where it is missing
DEFAULT_JOB_USER = "gpusched-job"
JOB_USER_SETTINGS = ("auto", "self")
_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


class JobUserError(ValueError):
    """A job user that cannot be had; the message names the setting."""


@dataclass(frozen=True, slots=True)
class JobUser:
    """Who job processes run as."""

    name: str
    uid: int
    gid: int


def job_user_problem(setting: str) -> str:
    """Why ``setting`` cannot name a job user ('' when it can)."""
    if setting in JOB_USER_SETTINGS or setting.isdigit() or _NAME.match(setting):
        return ""
    return (f"job_user: {setting!r} is not a user name, a uid, 'auto' or 'self'")


def can_switch_users() -> bool:
    return os.geteuid() == 0


def resolve_job_user(setting: str | None) -> tuple[JobUser | None, str]:
    """The user jobs run as (None: the agent's own) and, when that is the agent's own
    user, the warning to print at start ('' otherwise)."""
    choice = (setting or "self").strip()
    problem = job_user_problem(choice)
    if problem:
        raise JobUserError(problem)
    me = os.geteuid()
    if choice == "self":
        return None, self_warning(me, "as configured (job_user self)")
    if not can_switch_users():
        return None, self_warning(me, f"this agent is not root, so it cannot switch to "
                                      f"job user {choice!r}")
    if choice == "auto":
        blocked = private_interpreter()
        if blocked:
            return None, self_warning(me, blocked)
        return ensure_system_user(DEFAULT_JOB_USER), ""
    if choice.isdigit():
        uid = int(choice)
        if uid == 0:
            raise JobUserError("job_user: uid 0 is root; jobs must not run as root")
        try:
            entry = pwd.getpwuid(uid)
            return JobUser(entry.pw_name, uid, entry.pw_gid), ""
        except KeyError:
            return JobUser(f"uid {uid}", uid, uid), ""
    try:
        entry = pwd.getpwnam(choice)
    except KeyError:
        raise JobUserError(f"job_user: no user {choice!r} on this machine") from None
    if entry.pw_uid == 0:
        raise JobUserError(f"job_user: {choice!r} is root; jobs must not run as root")
    return JobUser(choice, entry.pw_uid, entry.pw_gid), ""


def start_warning(setting: str | None) -> str:
    """What an agent says at start when its jobs will run as its own user ('' when they
    will not), without creating any user."""
    choice = (setting or "self").strip()
    if choice == "self":
        return self_warning(os.geteuid(), "as configured (job_user self)")
    if not can_switch_users():
        return self_warning(os.geteuid(), f"this agent is not root, so it cannot switch "
                                          f"to job user {choice!r}")
    if choice == "auto":
        blocked = private_interpreter()
        return self_warning(os.geteuid(), blocked) if blocked else ""
    return ""


def private_interpreter() -> str:
    """Why another user could not run this Python (the built-in worker's), '' if it can."""
    return private_interpreter_at(Path(sys.executable))


def private_interpreter_at(python: Path) -> str:
    real = python.resolve()
    if reachable_by_others(real) and real.stat().st_mode & 0o001:
        return ""
    return (f"'auto' found that the Python at {real} cannot be run by another user (a "
            "folder above it is private); install gpusched where other users can run it, "
            "or name a job user whose jobs bring their own interpreter")


def self_warning(uid: int, why: str) -> str:
    return (f"job processes run as this agent's own user (uid {uid}), {why}: a job can "
            "read every file and process environment this user can, the cluster's "
            "secrets included (docs/security.md, Job processes)")


def ensure_system_user(name: str) -> JobUser:
    """The system user ``name``, created (no home, no login shell) where missing."""
    try:
        entry = pwd.getpwnam(name)
        return JobUser(name, entry.pw_uid, entry.pw_gid)
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        raise JobUserError(
            f"job_user: no user {name!r} and no useradd to create it; create one, or set "
            "job_user to a uid"
        )
    done = subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
         "--user-group", name],
        capture_output=True, text=True, check=False,
    )
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise JobUserError(
            f"job_user: could not create user {name!r}: {done.stderr.strip()}"
        ) from None
    return JobUser(name, entry.pw_uid, entry.pw_gid)


def reachable_by_others(path: Path) -> bool:
    """Whether any user may reach ``path``: every directory above it lets others pass."""
    current = path.resolve()
    for parent in [*reversed(current.parents)]:
        try:
            if not os.stat(parent).st_mode & 0o001:
                return False
        except FileNotFoundError:
            return True  # made by us, with a traversable mode
    return True


def give_directory(path: Path, user: JobUser) -> None:
    """``path`` made (and its parent made passable) and handed to ``user``, mode 0700:
    the job's own working directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(path.parent.stat().st_mode | 0o111)
    path.mkdir(parents=True, exist_ok=True)
    # the mode first: once the directory is the job user's, changing it takes FOWNER
    path.chmod(0o700)
    os.chown(path, user.uid, user.gid)
