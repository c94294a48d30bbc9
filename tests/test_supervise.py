"""core.supervise: a recipe's endings that Python never sees get one message; the ones it sees pass through."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from core.supervise import ending_message

ROOT = Path(__file__).resolve().parents[1]
WORKER = [sys.executable, str(ROOT / "tests" / "supervised_worker.py")]


def run(what: str, **env_extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    return subprocess.run([*WORKER, what], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_endings_python_sees_pass_through_unchanged():
    ok, error, bug, interrupt = run("ok"), run("error"), run("bug"), run("interrupt")
    assert (ok.returncode, ok.stderr) == (0, "")
    assert error.returncode == 2 and error.stderr == "error: the config's key x is wrong\n"
    assert bug.returncode == 1 and "Traceback" in bug.stderr and "ValueError: a bug" in bug.stderr
    assert interrupt.returncode == 130 and "KeyboardInterrupt" in interrupt.stderr
    assert "the recipe's process" not in bug.stderr + interrupt.stderr  # a traceback is its own message


def test_the_recipes_own_code_wins_over_a_native_exit_in_its_teardown():
    res = run("error-then-native-exit")
    assert res.returncode == 2 and res.stderr == "error: the trainer actor is unavailable\n"  # one line, not two


@pytest.mark.parametrize(
    ("what", "said"),
    [("native-exit", "ended with exit code 1 before its Python code could report"), ("sigkill", "killed by SIGKILL")],
)
def test_an_ending_python_never_sees_gets_one_message_and_exit_code_2(what, said):
    res = run(what)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the recipe's process (pid "), res.stderr
    assert said in lines[0] and "run the same command again to resume" in lines[0]


def test_the_recipe_runs_in_a_child_that_does_not_pass_the_pipe_on_unless_supervision_is_off():
    """Supervised, the recipe runs in a child process (another pid) that does not hand the report pipe on; with
    TEMPER_NO_SUPERVISE=1 it runs in the process the user started (the same pid): no child at all."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for off, same_process in ((None, False), ("1", True)):
        flag = {"TEMPER_NO_SUPERVISE": off} if off else {}
        proc = subprocess.Popen([*WORKER, "env"], env={**env, **flag}, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=60)
        pid, leaked = out.split()
        assert proc.returncode == 0 and (int(pid) == proc.pid) == same_process and leaked == "False", (off, out)


def test_sigterm_reaches_the_recipe_and_kill_9_of_the_parent_ends_it():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [*WORKER, "wait-sigterm"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert child != proc.pid and psutil.Process(child).ppid() == proc.pid  # the recipe runs in a child
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0 and proc.stdout.read() == "stopped\n"

    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(proc.stdout.readline()))
    proc.kill()
    proc.wait()
    child.wait(timeout=10)  # raises if the child outlives the parent
    assert not child.is_running()
    proc.stdout.close()


def test_a_driver_ended_by_ray_is_explained_from_its_own_log(tmp_path, monkeypatch):
    logs = tmp_path / "ray" / "session_2026-11-26_12-53-59_1_15010" / "logs"
    logs.mkdir(parents=True)
    log = logs / "python-core-driver-01000000ffff_4242.log"
    log.write_text(
        "[2026-11-26 12:54:23,334 I 4242 4250] actor_manager.cc:236: received notification on actor\n"
        "[2026-11-26 12:54:33,977 W 4242 4242] connection.cc:216: The connection to the plasma store is failed. "
        "Terminate the process. Status: IOError: Broken pipe\n"
    )
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    message = ending_message(4242, 1)
    said = "Ray's driver log last said: connection.cc:216: The connection to the plasma store is failed."
    assert said in message and str(log) in message and "run the same command again to resume" in message
    assert "log last said" not in ending_message(4243, 1)  # another process's log is not read
    assert "log last said" not in ending_message(4242, 1, since=os.path.getmtime(log) + 1)  # nor a reused pid's
    assert "log last said" not in ending_message(4242, -9)  # a signal is not Ray's doing
    monkeypatch.delenv("RAY_TMPDIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # Ray's next choice on Linux
    assert said in ending_message(4242, 1)
