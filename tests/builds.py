"""The compiler runs behind test_correctness.py's CPU tests, each done once a session and side by side.

Most of the CPU suite's time is nvcc building the whole CUDA source: for 7 archs under 2 C++ standards, after torch's
headers, as host programs. A test asks Jobs for what it needs by a key that names the build (what is compiled, how);
a build two tests need runs once, and test_correctness.py starts every build that the session's selected tests will
ask for at the first test, on one worker thread per core, so that the builds overlap each other and the tests that
need none. Each test still asserts on its own build's result, as it would on a run of its own.

SourceTargets builds the source for many (arch, standard) targets in one nvcc run per standard (the host code once,
front end and NVVM once per arch), then runs ptxas once per arch on PTX that is byte for byte the same under both
standards (ptxas sees nothing else). Where that run is not clean (an error, a warning, any output at all), every
target of it is built again on its own, by the nvcc command a single target takes, so that each test reports its own
arch's failure.
"""
import atexit
import hashlib
import itertools
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future

URGENT = 0  # a build a test waits for now: ahead of every build started in advance


class Jobs:
    """Functions run on worker threads, lowest priority number first, each key once; Future per key."""

    def __init__(self, workers=None):
        self.workers = workers or max(2, min(os.cpu_count() or 2, 8))
        self._queue = queue.PriorityQueue()
        self._futures = {}
        self._lock = threading.RLock()  # RLock: a done callback may run inside submit()
        self._order = itertools.count()
        self._threads = []
        self._processes = set()
        self._urgent = set()  # futures a test waits for before their job is queued (after=)
        self._keys = {}  # future -> key
        self._queued = {}  # future -> when it was first queued
        self._times = []  # (key, queued, started, ended): KB25_BUILDS_LOG=path writes them there at close()
        self._t0 = time.monotonic()
        self._workdir = None
        self._closed = False
        atexit.register(self._end_processes)  # where the session ends without close() (an interrupt)

    @property
    def workdir(self):
        """A directory for this session's builds, removed by close()."""
        with self._lock:
            if self._workdir is None:
                self._workdir = tempfile.mkdtemp(prefix="kb25_builds_")
            return self._workdir

    def directory(self, name):
        path = os.path.join(self.workdir, name)
        os.makedirs(path, exist_ok=True)
        return path

    def submit(self, key, fn, priority=URGENT, after=None):
        """The Future of job `key`, queued on first submission (later ones get the same Future, whatever their fn).
        With `after` (another job's key), fn is queued once that job is done and gets its result; its exception is
        this job's too."""
        with self._lock:
            if self._closed:
                raise RuntimeError("builds: submitted after close()")
            future = self._futures.get(key)
            if future is not None:
                return future
            if fn is None:
                raise KeyError(f"builds: no job {key!r}")
            future = self._futures[key] = Future()
            self._keys[future] = key
            if after is None:
                self._enqueue(priority, fn, future)
            else:
                dependency = self._futures[after]

                def ready(done):
                    failed = RuntimeError(f"builds: {after} cancelled") if done.cancelled() else done.exception()
                    if failed is not None:
                        with self._lock:
                            if future.set_running_or_notify_cancel():
                                future.set_exception(failed)
                        return
                    with self._lock:
                        if not self._closed:
                            self._enqueue(URGENT if future in self._urgent else priority, lambda: fn(done.result()),
                                          future)

                dependency.add_done_callback(ready)
            return future

    def result(self, key, fn, priority=URGENT, after=None):
        """submit(), then wait for the result (re-raising the job's exception). A job already queued in advance is
        moved ahead: the test waiting for it needs it now."""
        future = self.submit(key, fn, priority, after)
        if not future.done():
            with self._lock:
                self._promote(future)
        return future.result()

    def _enqueue(self, priority, fn, future):  # under the lock
        self._queued.setdefault(future, time.monotonic() - self._t0)
        self._queue.put((priority, next(self._order), fn, future))
        while len(self._threads) < self.workers:
            thread = threading.Thread(target=self._work, name=f"builds-{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _promote(self, future):  # under the lock: re-queue a waiting job as urgent (the old entry then does nothing)
        self._urgent.add(future)
        with self._queue.mutex:
            entries = [e for e in self._queue.queue if e[3] is future and e[0] != URGENT]
        for priority, _, fn, _ in entries[:1]:
            self._queue.put((URGENT, next(self._order), fn, future))

    def _work(self):
        while True:
            _, _, fn, future = self._queue.get()
            if fn is None:
                return
            with self._lock:  # a promoted job has two entries: the first taken runs it
                if future.running() or future.done() or not future.set_running_or_notify_cancel():
                    continue
            started = time.monotonic() - self._t0
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: B036 - handed to the test that waits for it
                future.set_exception(e)
            self._times.append((self._keys[future], self._queued[future], started, time.monotonic() - self._t0))

    def run(self, cmd, timeout, input=None, cwd=None):
        """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) in a process group of its own, which
        close() ends if the session stops before it does."""
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                start_new_session=True)
        with self._lock:
            self._processes.add(proc)
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            proc.communicate()
            raise
        finally:
            with self._lock:
                self._processes.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

    def _end_processes(self):
        with self._lock:
            for proc in list(self._processes):
                _end_group(proc)

    def close(self):
        """Cancel what has not started, end the process groups of what has, stop the workers, remove the work
        directory."""
        with self._lock:
            self._closed = True
            for future in self._futures.values():
                future.cancel()  # no effect on a running or finished job
            self._end_processes()
            for _ in self._threads:
                self._queue.put((float("inf"), next(self._order), None, None))
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(timeout=60)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if os.environ.get("KB25_BUILDS_LOG"):
            with open(os.environ["KB25_BUILDS_LOG"], "w") as f:
                for key, queued, started, ended in sorted(self._times, key=lambda t: t[2]):
                    f.write(f"{started:7.1f} {ended:7.1f} {ended - started:6.1f}s queued {queued:6.1f}  {key}\n")


def _end_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class SourceTargets:
    """The CUDA source compiled for (arch, standard) targets as `nvcc_flags(std) -c -gencode=arch=compute_A,code=sm_A
    -Xptxas -v source.cu` compiles it: (returncode, what nvcc printed) per target, from one nvcc run per standard
    (PTX of every arch, kept) and one ptxas run per arch and distinct PTX. source() and nvcc_flags(std) are called
    by start(), in the thread that starts the targets."""

    def __init__(self, jobs, source, nvcc_flags, timeout=600):
        self.jobs, self.source, self.nvcc_flags, self.timeout = jobs, source, nvcc_flags, timeout
        self._groups = {}  # (arch, std) -> the key of the nvcc run that builds it
        self._ptx_files = {}  # (arch, std) -> the PTX that run kept

    def start(self, targets, priority):
        """Queue the nvcc runs of `targets` (arch, std) that no earlier start() queued: one per standard."""
        by_std = {}
        for arch, std in targets:
            if (arch, std) not in self._groups and arch not in by_std.get(std, []):
                by_std.setdefault(std, []).append(arch)
        for std, archs in by_std.items():
            archs = tuple(archs)
            key = ("source-ptx", std, archs)
            flags, source = self.nvcc_flags(std), self.source()
            self.jobs.submit(key, lambda std=std, archs=archs, flags=flags, source=source:
                             self._ptx(std, archs, flags, source), priority)
            for arch in archs:
                self._groups[(arch, std)] = key

    def report(self, arch, std):
        """(returncode, nvcc's output) of the CUDA source built for sm_<arch> under `std`, with ptxas's report."""
        if (arch, std) not in self._groups:
            self.start([(arch, std)], URGENT)
        targets = self.jobs.result(self._groups[(arch, std)], None)
        return self.jobs.result(targets[arch], None)

    def ptx(self, arch, std):
        """The PTX of the CUDA source for compute_<arch> under `std`, as the nvcc run of report() kept it."""
        self.report(arch, std)
        path = self._ptx_files.get((arch, std))
        assert path and os.path.isfile(path), (f"no PTX kept for compute_{arch} under {std}: the nvcc run that builds it "
                                               "beside other archs failed (their compile tests say why)")
        with open(path) as f:
            return f.read()

    def _ptx(self, std, archs, flags, source):
        """Runs in a worker: nvcc for every arch of `archs` under `std` (PTX kept), then queues ptxas per arch (or the
        single-target builds where the run is not clean). Returns arch -> the key of the job with its result."""
        directory = self.jobs.directory(f"source-{std}-{'-'.join(archs)}")
        src = _write(directory, "kernels.cu", source)
        cmd = [*flags, "-c", *(f"-gencode=arch=compute_{a},code=compute_{a}" for a in archs), "--keep",
               f"--keep-dir={directory}", src, "-o", os.path.join(directory, "kernels.o")]
        proc = self.jobs.run(cmd, timeout=self.timeout * len(archs))
        # nvcc names the kept PTX by its arch only where it builds several
        ptx = {a: os.path.join(directory, f"kernels.compute_{a}.ptx" if len(archs) > 1 else "kernels.ptx")
               for a in archs}
        self._ptx_files.update({(a, std): path for a, path in ptx.items()})
        clean = proc.returncode == 0 and not (proc.stdout + proc.stderr).strip() and all(map(os.path.isfile,
                                                                                            ptx.values()))
        keys = {}
        for arch in archs:
            if clean:
                with open(ptx[arch], "rb") as f:
                    keys[arch] = ("ptxas", arch, hashlib.sha256(f.read()).hexdigest())
                self.jobs.submit(keys[arch], lambda arch=arch: self._ptxas(arch, ptx[arch], flags[0]))
            else:
                keys[arch] = ("source-alone", arch, std)
                self.jobs.submit(keys[arch], lambda arch=arch: self._alone(arch, std, flags, source))
        return keys

    def _ptxas(self, arch, ptx, nvcc):
        """ptxas as nvcc runs it for -gencode=arch=compute_A,code=sm_A -Xptxas -v (`ptxas -arch=sm_A -m64 -v`)."""
        cubin = ptx[:-len(".ptx")] + f".sm_{arch}.cubin"
        proc = self.jobs.run([nvcc, "-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", ptx,
                              "-o", cubin], timeout=self.timeout)
        return proc.returncode, proc.stdout + proc.stderr

    def _alone(self, arch, std, flags, source):
        """The target alone, by the command a test of one target runs."""
        directory = self.jobs.directory(f"source-{std}-{arch}-alone")
        src = _write(directory, "kernels.cu", source)
        proc = self.jobs.run([*flags, "-c", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", src,
                              "-o", os.path.join(directory, f"kernels_{arch}.o")], timeout=self.timeout)
        return proc.returncode, proc.stderr


class PerArch:
    """One build for several archs, `cmd(archs, directory)` (called by start(), in the thread that starts them), each
    arch's result the build's (returncode, stdout + stderr); where it fails, each arch is built again alone by the same
    command, so that each test gets its own arch's result."""

    def __init__(self, jobs, name, cmd, timeout):
        self.jobs, self.name, self.cmd, self.timeout = jobs, name, cmd, timeout
        self._groups = {}

    def start(self, archs, priority):
        archs = tuple(dict.fromkeys(a for a in archs if a not in self._groups))
        if not archs:
            return
        commands = {group: self.cmd(group, self.jobs.directory(f"{self.name}-{'-'.join(group)}"))
                    for group in [archs, *([(a,) for a in archs] if len(archs) > 1 else [])]}
        key = (self.name, archs)
        self.jobs.submit(key, lambda: self._build(archs, commands), priority)
        for arch in archs:
            self._groups[arch] = key

    def result(self, arch):
        """(returncode, stdout + stderr) of the build for `arch`."""
        if arch not in self._groups:
            self.start([arch], URGENT)
        found = self.jobs.result(self._groups[arch], None)
        return found[arch] if arch in found else self.jobs.result(found[None][arch], None)

    def _run(self, archs, commands):
        proc = self.jobs.run(commands[archs], timeout=self.timeout * len(archs))
        return proc.returncode, proc.stdout + proc.stderr

    def _build(self, archs, commands):
        returncode, output = self._run(archs, commands)
        if returncode == 0 or len(archs) == 1:
            return {arch: (returncode, output) for arch in archs}
        keys = {}
        for arch in archs:
            keys[arch] = (self.name, (arch,), "alone")
            self.jobs.submit(keys[arch], lambda arch=arch: self._run((arch,), commands))
        return {None: keys}


def _write(directory, name, text):
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(text)
    return path
