"""Worker processes that run a function for this process while it goes on: Inductor's compiles of
regions in the background (NOTE: [Compiles in the background] in regions.py).

Each worker is a Python process of its own, started with `python -c` and fed through its standard
input and output: a job is the name of a function (module and attribute) and its arguments,
pickled; the answer is the seconds it took, or the error it raised, as text. Not `multiprocessing`:
its spawned children import the parent's `__main__` again, and a training script without a
`if __name__ == "__main__":` guard (as BMTrain's examples are written) would start training in each
of them. A thread per worker hands it the next job and waits for its answer, so nothing here holds
the interpreter while the workers compile. A worker that exits fails the job it had and every later
job sent to its thread; a failed job is the caller's to redo.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from fbmt import flags, logs


class Job:
    """One call sent to a worker: done once it ran there (`seconds`) or failed (`error`)."""

    def __init__(self, function: tuple[str, str], args: tuple) -> None:
        self.function, self.args = function, args
        self.data = pickle.dumps((function, args))  # here: what does not pickle fails its caller, not a thread
        self.seconds: float | None = None  # the call's own time in the worker
        self.error: str | None = None
        self.sent, self.finished = time.perf_counter(), 0.0  # when submitted, and when answered
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the job is done, or `timeout` seconds; whether it is done."""
        return self._done.wait(timeout)

    def _finish(self, seconds: float | None, error: str | None) -> None:
        self.seconds, self.error, self.finished = seconds, error, time.perf_counter()
        self._done.set()


class Workers:
    """`count` worker processes, each with `threads` compile threads of Inductor's own."""

    def __init__(self, count: int, threads: int, warm_up: tuple[str, str, tuple] | None = None) -> None:
        """`warm_up`: a job each worker runs before any other (its own, not a caller's), so what a first
        job would pay once (imports, the device's initialization, the compiler's first run) is paid
        while the caller is still busy."""
        self.count, self.threads = count, threads
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._processes: list[subprocess.Popen] = []
        self._closed = False
        self._sent: list[Job] = []
        # the folder fbmt is imported from goes first on the workers' path, so they run this fbmt
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        path = os.pathsep.join(p for p in (here, flags.PYTHONPATH.get()) if p)
        env = dict(os.environ, PYTHONPATH=path, TORCHINDUCTOR_COMPILE_THREADS=str(threads))
        for _ in range(count):
            process = subprocess.Popen(
                [sys.executable, "-c", f"from fbmt.compiler.runtime.background import serve; serve({warm_up!r})"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                # a session of their own: a terminal's Ctrl-C interrupts the training script alone, not
                # also each worker (with a traceback of its own); they end when this process stops them
                # or, where it died, once their standard input closes
                start_new_session=True,
            )
            self._processes.append(process)
            threading.Thread(target=self._feed, args=(process,), daemon=True, name="fbmt-compile-worker").start()

    def idle(self) -> bool:
        """No job sent is unfinished."""
        return all(job.done() for job in self._sent)

    def submit(self, function: tuple[str, str], *args: Any) -> Job:
        """Run `function` (module, attribute) on `args` in the first free worker; raises what pickling
        them raises."""
        job = Job(function, args)
        self._sent = [j for j in self._sent if not j.done()] + [job]
        if self._closed:
            job._finish(None, "the workers were stopped")
        else:
            self._jobs.put(job)
        return job

    def close(self) -> None:
        """Stop the workers now; the jobs they had or would have had fail (their callers redo them)."""
        self._closed = True
        for _ in self._processes:
            self._jobs.put(None)
        for process in self._processes:
            if process.poll() is None:
                process.kill()

    def _feed(self, process: subprocess.Popen) -> None:
        exited: str | None = None
        while (job := self._jobs.get()) is not None:
            if exited is None:
                try:
                    _write(process.stdin, job.data)
                    seconds, error = _receive(process.stdout)
                    job._finish(seconds, error)
                    continue
                except (OSError, EOFError, pickle.UnpicklingError) as e:
                    exited = f"the worker process stopped ({type(e).__name__}, exit code {process.poll()})"
            job._finish(None, exited)


def _send(stream: IO[bytes] | None, value: Any) -> None:
    _write(stream, pickle.dumps(value))


def _write(stream: IO[bytes] | None, data: bytes) -> None:
    assert stream is not None
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes] | None) -> Any:
    assert stream is not None
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the stream ended")
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the stream ended")
    return pickle.loads(data)


def serve(warm_up: tuple[str, str, tuple] | None = None) -> None:
    """A worker's loop: run each job read from standard input, answer on the first standard output.

    What a job's code prints goes to standard error (standard output is the answers' channel). The
    warm-up job (`Workers`) runs first, while the parent is still tracing; a failed one is only slower."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if warm_up is not None:
        module, name, args = warm_up
        try:
            getattr(importlib.import_module(module), name)(*args)
        except Exception as e:
            print(
                f"fbmt: a compile worker's warm-up failed ({type(e).__name__}: {e}); its first job pays it", flush=True
            )

    while True:
        try:
            function, args = _receive(sys.stdin.buffer)
        except EOFError:
            return
        started = time.perf_counter()
        try:
            module, name = function
            getattr(importlib.import_module(module), name)(*args)
            answer = (time.perf_counter() - started, None)
        except Exception as e:  # the parent redoes the job, and says why it had to
            answer = (None, f"{type(e).__name__}: {e}")
        _send(answers, answer)


_pool: Workers | None = None


def enabled() -> bool:
    """Whether anything compiles in the background ($FBMT_COMPILE_WORKERS is not 0)."""
    return flags.COMPILE_WORKERS.get() != 0


def pool(warm_up: tuple[str, str, tuple] | None = None) -> Workers | None:
    """This process's workers, started on the first call after the last `release`; None where
    $FBMT_COMPILE_WORKERS is 0."""
    global _pool
    if _pool is None:
        count, cores = flags.COMPILE_WORKERS.get(), os.cpu_count() or 1
        per_rank = max(1, cores // (flags.LOCAL_WORLD_SIZE.get() or 1))
        if count is None:  # a few: each holds a copy of torch and Inductor in memory
            count = max(1, min(4, per_rank // 4))
        if count == 0:
            return None
        _pool = Workers(count, threads=max(1, per_rank // count), warm_up=warm_up)
        logs.log.info("compile workers: %d processes of %d compile threads each", count, _pool.threads)
    return _pool


# Set where the interpreter begins to exit, before the workers stop: a job they then fail is not made
# again by its caller (in a thread the exiting interpreter would stop inside torch's C++, aborting the
# process), and nothing new starts.
exiting = threading.Event()
_on_exit: list[Callable[[], None]] = []


def on_exit(hook: Callable[[], None]) -> None:
    """Run `hook` where the interpreter exits, after `exiting` is set and before the workers stop."""
    _on_exit.append(hook)


@atexit.register
def _exit() -> None:
    exiting.set()
    for hook in _on_exit:
        try:
            hook()
        except Exception as e:  # the workers stop whatever a hook met
            logs.log.warning("fbmt: at exit, %s failed (%s: %s)", getattr(hook, "__name__", hook), type(e).__name__, e)
    if _pool is not None:
        _pool.close()


def release() -> None:
    """Stop this process's workers if no job is waiting for them: they hold memory (a copy of torch
    each, and on a GPU a context of the device's memory) that training needs more. The next `pool()`
    starts new ones, which a later compile (a new input shape) waits for in the background."""
    global _pool
    if _pool is not None and _pool.idle():
        _pool.close()
        _pool = None
