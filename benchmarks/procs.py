"""Consumer processes of a run, and the peak RSS of their process tree."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[1]
WORKER_FLAGS = ("--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "WARNING")


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except OSError:
            continue
    return found


def rss_bytes(pid: int) -> int:
    """Sum of VmRSS over the process tree of ``pid`` (pages shared after fork count once per process)."""
    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


class RssSampler(threading.Thread):
    """Samples the tree's RSS every ``interval`` seconds; keeps (time, bytes) pairs."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            rss = rss_bytes(self.pid)
            if rss:
                self.samples.append((time.time(), rss))
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def peak(self, since: float = 0.0, until: float = float("inf")) -> int:
        """Highest sample in [since, until]."""
        return max((rss for t, rss in self.samples if since <= t <= until), default=0)


class Consumer:
    """A consumer subprocess (a Celery worker or the raw kombu consumer) with its log and env."""

    #: Started and not yet stopped (so an interrupted run can stop them all).
    running: ClassVar[list[Consumer]] = []

    def __init__(self, args: list[str], env: dict[str, str], out: Path, name: str = "consumer",
                 tree: Path | None = None) -> None:
        """``tree``: a source tree (e.g. a ``git worktree`` of another commit) whose ``kombu_events`` the
        process imports instead of this checkout's (``benchmarks`` is still this checkout's)."""
        self.out = out
        self.log_path = out / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- the worker writes it until stop() closes it
        full_env = dict(os.environ)
        full_env.update(env)
        path, cwd = [str(ROOT)], ROOT
        if tree is not None:  # not ROOT as cwd: ``python -m`` puts the cwd first on sys.path
            path, cwd = [str(only_kombu_events(tree, out)), str(ROOT)], out
            full_env["KEB_TREE"] = str(Path(tree).resolve())  # the benchmark app checks what it imported
        full_env["PYTHONPATH"] = os.pathsep.join([*path, full_env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.sampler = RssSampler(self.proc.pid)
        self.sampler.start()
        Consumer.running.append(self)

    @classmethod
    def celery(cls, module: str, pool: str, concurrency: int, env: dict[str, str], out: Path,
               *extra: str, tree: Path | None = None) -> Consumer:
        """``celery -A module worker`` with the benchmark flags."""
        args = ["-m", "celery", "-A", module, "worker", f"--pool={pool}", f"--concurrency={concurrency}",
                *WORKER_FLAGS, f"--hostname=kebench-{os.getpid()}-{time.monotonic_ns()}@%h", *extra]
        return cls(args, env, out, "worker", tree)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_file(self, name: str, timeout: float, what: str = "", progress=None, stall_s: float = 90.0) -> float:
        """Wait until the probe writes ``name``; return its content as a float.

        Raises if the consumer dies, after ``timeout``, or if ``progress()`` (checked
        every few seconds) returns the same value for ``stall_s``.
        """
        path = self.out / name
        start = last_change = last_check = time.monotonic()
        last_value = None
        while not path.exists():
            now = time.monotonic()
            if not self.alive():
                raise RuntimeError(f"consumer exited ({self.proc.returncode}) before {what or name}: "
                                   f"{self.log[-1500:]}")
            if now - start > timeout:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what or name}")
            if progress is not None and now - last_check > 5:
                value, last_check = progress(), now
                if value != last_value:
                    last_value, last_change = value, now
                elif now - last_change > stall_s:
                    raise TimeoutError(f"no progress for {stall_s:.0f} s waiting for {what or name} ({value})")
            time.sleep(0.02)
        for _ in range(50):  # the probe may still be writing it
            text = path.read_text().strip()
            if text:
                return float(text)
            time.sleep(0.01)
        raise RuntimeError(f"{path} stays empty")

    def pause(self) -> None:
        """SIGSTOP the whole process tree (its process group)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the whole process tree."""
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> None:
        """Warm shutdown (SIGTERM, so the probe dumps its counters), then kill what is left."""
        if self.alive():
            self.resume()  # in case a failed run left it paused
        stop_group(self.proc, timeout, alive=self.alive())
        self.sampler.stop()
        self._log.close()
        if self in Consumer.running:
            Consumer.running.remove(self)

    @classmethod
    def stop_all(cls) -> None:
        """Stop every consumer still running."""
        for consumer in list(cls.running):
            consumer.stop(timeout=10)


def only_kombu_events(tree: Path, out: Path) -> Path:
    """A directory in ``out`` holding only a link to ``tree``'s ``kombu_events`` (``tree`` has its own
    ``benchmarks`` too, which must not shadow this checkout's)."""
    path = out / "tree"
    path.mkdir(exist_ok=True)
    link = path / "kombu_events"
    if not link.is_symlink():
        link.symlink_to(Path(tree).resolve() / "kombu_events", target_is_directory=True)
    return path


def stop_group(proc: subprocess.Popen, timeout: float, *, alive: bool = True) -> None:
    """SIGTERM ``proc`` (a process group leader) if ``alive``, SIGKILL it after ``timeout``; then its group."""
    if alive:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # orphaned pool processes, if any
    except (ProcessLookupError, PermissionError):
        pass
