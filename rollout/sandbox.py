"""Sandboxes for coding tasks: a directory of files an agent reads, writes and runs commands in, confined.

    runtime = LocalRuntime()                         # or a container runtime with the same two methods
    box = runtime.create({"solution.py": "def add(a, b):\\n    return a - b\\n"})
    box.write("solution.py", fixed)                  # paths are relative to the sandbox; nothing outside it
    result = box.run(["python", "-m", "pytest", "-q"], Limits(wall_s=20))
    verifier = box.copy()                            # a fresh copy: the verifier runs where the agent did not
    box.close()

`Runtime.create(files)` makes a sandbox holding `files`; a `Sandbox` reads, writes and lists its files, runs a
command in its directory under `Limits` and copies itself. That is all a container runtime (docker, e2b, Modal)
has to provide to replace the local one: files in, a command run with limits, its exit code and output out, and a
copy.

`LocalRuntime` confines each command with unprivileged Linux namespaces (`unshare -r -m -n -p --fork
--mount-proc`: user, mount, network and PID namespaces) and resource limits:
- **files**: every mount is read-only inside the command's mount namespace except the sandbox's directory (a mount
  that cannot be made read-only stops the command: fail closed); the file methods refuse a path that is absolute,
  leaves the directory (`..`) or resolves outside it (a symlink);
- **network**: no IP networking (the network namespace has no interface up). Unix sockets on the filesystem
  (docker's, a session bus, Ray's under /tmp) can still be connected to, and the whole filesystem can be read: for
  untrusted code, run the trainer as an unprivileged user with nothing to reach, or use a container runtime;
- **processes**: the command sees only its own (PID namespace), cannot signal the run's, and every process it
  started, daemonised or not, dies with it at `wall_s`;
- **CPU, memory, file size, open files**: `setrlimit` (`Limits`); no limit on the number of processes or on the
  disk the sandbox's directory may take (a cgroup's or a container's job);
- **output**: stdout and stderr are cut at `output_bytes` each.
A machine without unprivileged user namespaces cannot confine: `LocalRuntime()` refuses there, naming what is
missing, rather than run commands unconfined.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class SandboxError(Exception):
    """A sandbox cannot do what was asked: a path outside it, a machine that cannot confine."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 20.0
    cpu_s: int = 10
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # the largest file a command may write
    open_files: int = 256
    output_bytes: int = 64_000  # of stdout, and of stderr


@dataclass(frozen=True)
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False


class Sandbox(Protocol):
    root: Path

    def write(self, path: str, text: str) -> None: ...
    def read(self, path: str) -> str: ...
    def files(self) -> list[str]: ...
    def run(self, argv: Sequence[str], limits: Limits = ...) -> RunResult: ...
    def copy(self) -> Sandbox: ...
    def close(self) -> None: ...


class Runtime(Protocol):
    def create(self, files: Mapping[str, str]) -> Sandbox: ...


# Inside the namespaces: every mount read-only but the sandbox's directory (a mount that cannot be made read-only
# stops the command: fail closed), then the command in it. Mount points with spaces are octal-escaped in the table.
CONFINE = r"""
set -e
root="$1"; shift
mount --rbind / /
mount --bind "$root" "$root"
awk '{print $2}' /proc/self/mounts | sort -u | while IFS= read -r m; do
  m=$(printf '%b' "$m")
  case "$m" in "$root"|"$root"/*) continue ;; esac
  mount -o remount,bind,ro "$m" 2>/dev/null || { echo "sandbox: cannot make $m read-only" >&2; exit 125; }
done
cd "$root"
exec "$@"
"""
UNSHARE = ["unshare", "-r", "-m", "-n", "-p", "--fork", "--mount-proc"]


def relative_path(path: str) -> str:
    """`path` normalised, if it names a file inside a sandbox (relative, not leaving it); else SandboxError."""
    norm = os.path.normpath(path)
    if os.path.isabs(path) or norm in (".", "..") or norm.startswith("../"):
        raise SandboxError(f"{path!r} is outside the sandbox (paths are relative to it)")
    return norm


def namespaces_work() -> str | None:
    """None where `unshare` can confine a command here (user, mount, network and PID namespaces); else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "the unshare command is not installed (util-linux)"
    try:
        out = subprocess.run([unshare, *UNSHARE[1:], "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{' '.join(UNSHARE)} failed: {err}"
    if out.returncode != 0:
        return f"{' '.join(UNSHARE)} failed: {out.stderr.strip() or out.returncode} (unprivileged user namespaces off?)"
    return None


class LocalRuntime:
    """Sandboxes in temporary directories on this machine (module docstring)."""

    def __init__(self, parent: str | None = None):
        why = namespaces_work()
        if why is not None:
            raise SandboxError(f"this machine cannot confine a sandbox's commands: {why}; use a container runtime")
        self.parent = parent

    def create(self, files: Mapping[str, str]) -> LocalSandbox:
        box = LocalSandbox(Path(tempfile.mkdtemp(prefix="temper-sandbox-", dir=self.parent)).resolve())
        for path, text in files.items():
            box.write(path, text)
        return box


class LocalSandbox:
    def __init__(self, root: Path):
        self.root = root

    def _path(self, path: str) -> Path:
        full = (
            self.root / relative_path(path)
        ).resolve()  # symlinks followed: a link out of the sandbox resolves outside it
        if full != self.root and self.root not in full.parents:
            raise SandboxError(f"{path!r} is outside the sandbox")
        return full

    def write(self, path: str, text: str) -> None:
        full = self._path(path)
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(text)

    def read(self, path: str) -> str:
        full = self._path(path)
        if not full.is_file():
            raise SandboxError(f"{path!r}: no such file in the sandbox")
        return full.read_text(errors="replace")

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def run(self, argv: Sequence[str], limits: Limits = Limits()) -> RunResult:
        def confine() -> None:  # in the child, before exec: the resource limits
            mb = 1024 * 1024
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
            resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))

        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.root), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [*UNSHARE, "sh", "-c", CONFINE, "confine", str(self.root), *argv]
        proc = subprocess.Popen(
            cmd, cwd=self.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=confine, start_new_session=True,
        )  # fmt: skip
        timed_out = False
        try:
            out, err = proc.communicate(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        cut = len(out) > limits.output_bytes or len(err) > limits.output_bytes
        return RunResult(
            proc.returncode,
            out[: limits.output_bytes].decode(errors="replace"),
            err[: limits.output_bytes].decode(errors="replace"),
            timed_out,
            cut,
        )

    def copy(self) -> LocalSandbox:
        root = Path(tempfile.mkdtemp(prefix="temper-sandbox-", dir=self.root.parent)).resolve()
        shutil.copytree(self.root, root, dirs_exist_ok=True, symlinks=True)
        return LocalSandbox(root)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
