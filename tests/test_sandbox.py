"""The local sandbox (`rollout/sandbox.py`): files only inside its directory, no IP network, its own processes only
(a daemonised child dies at the wall time; the run's processes cannot be signalled), and its CPU, memory, file-size,
open-files, wall-time and output limits, each shown by a command that tries to break it; on a machine that cannot
confine, it refuses to start rather than run commands unconfined."""

from __future__ import annotations

import sys

import pytest

from rollout.sandbox import Limits, LocalRuntime, SandboxError, namespaces_work

CONFINED = namespaces_work() is None


def test_a_machine_that_cannot_confine_is_refused(monkeypatch):
    import rollout.sandbox as sandbox

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match="cannot confine a sandbox's commands: the unshare command is not installed"):
        LocalRuntime()


@pytest.mark.skipif(not CONFINED, reason=f"no unprivileged namespaces here: {namespaces_work()}")
def test_files_stay_inside_and_commands_run_without_network_within_their_limits(tmp_path):
    outside = tmp_path / "outside.txt"
    box = LocalRuntime().create({"solution.py": "def add(a, b):\n    return a + b\n"})
    try:
        assert box.files() == ["solution.py"] and "return a + b" in box.read("solution.py")
        for bad in ("/etc/passwd", "../escape.txt", "sub/../../escape.txt"):
            with pytest.raises(SandboxError, match="sandbox"):
                box.write(bad, "x")
        ok = box.run(["ln", "-s", str(tmp_path), "link"])
        assert ok.returncode == 0
        with pytest.raises(SandboxError, match="outside the sandbox"):
            box.read("link/outside.txt")  # a symlink out of the sandbox resolves outside it
        python = sys.executable
        wrote = box.run([python, "-c", f"open({str(outside)!r}, 'w').write('x')"])
        assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr and not outside.exists()
        inside = box.run([python, "-c", "open('made.txt', 'w').write('ok')"])
        assert inside.returncode == 0 and box.read("made.txt") == "ok"
        net = box.run([python, "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)"])
        assert net.returncode != 0 and "unreachable" in net.stderr.lower()
        spin = box.run([python, "-c", "while True: pass"], Limits(cpu_s=1, wall_s=20))
        assert spin.returncode != 0 and not spin.timed_out  # the CPU limit, not the wall clock, stopped it
        hog = box.run([python, "-c", "x = bytearray(2 * 1024**3)"], Limits(memory_mb=256))
        assert hog.returncode != 0 and "MemoryError" in hog.stderr
        slow = box.run(["sleep", "30"], Limits(wall_s=1))
        assert slow.timed_out
        # a daemonised child dies with the command at its wall time, and the run's processes are out of reach
        import subprocess
        import time

        host = subprocess.Popen(["sleep", "60"])
        try:
            escape = f"(setsid sleep 77 &); kill -9 {host.pid}; echo killed=$?; sleep 60"
            start = time.monotonic()
            fled = box.run(["sh", "-c", escape], Limits(wall_s=2))
            assert fled.timed_out and time.monotonic() - start < 15 and "killed=1" in fled.stdout
            assert host.poll() is None  # the run's process is alive: the sandbox could not see it
            survivors = subprocess.run(["pgrep", "-f", "sleep 77"], capture_output=True, text=True).stdout
            assert survivors == "", survivors
        finally:
            host.kill()
        big = box.run([python, "-c", "open('big.bin', 'wb').write(b'x' * 4 * 1024**2)"], Limits(file_mb=1))
        assert big.returncode != 0 and (box.root / "big.bin").stat().st_size <= 1024**2  # killed at 1 MiB
        files = box.run([python, "-c", "fs = [open(f'f{i}', 'w') for i in range(100)]"], Limits(open_files=32))
        assert files.returncode != 0 and "Too many open files" in files.stderr
        loud = box.run([python, "-c", "print('x' * 100_000)"], Limits(output_bytes=1000))
        assert loud.truncated and len(loud.stdout) == 1000
        fresh = box.copy()
        try:
            assert fresh.files() == box.files() and fresh.root != box.root
        finally:
            fresh.close()
    finally:
        box.close()
    assert not box.root.exists()
