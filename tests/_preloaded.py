"""Runs of a script's ``cli(argv)``, each in its own process forked from one Python that has
imported the script (and whatever else it names) once.

A run_clm.py process spends ~11 of its ~15 CPU-seconds importing torch, transformers and
datasets (measured on 2 busy cores: `import run_clm` alone takes 10.8 s of CPU), so a test
that starts 13 of them pays ~140 s of CPU for imports. Forked from a server that has done
them, each run starts with the modules in memory. A run is still a separate process: its own
pid, SIGKILL kills it alone, its exit status is what ``sys.exit(cli(argv))`` gives (a signal:
minus its number, as `subprocess.Popen`), its stdout and stderr go to the file named.

What differs from ``python script.py``: a run's environment is the server's unless `start`
is given one, and then only the variables read at run time may differ (those read while
importing, `IMPORT_TIME`, must be the server's: `start` refuses a run that changes one);
torch's thread count follows the run's OMP_NUM_THREADS. Anything printed while importing is
on the server's stderr. Tests of what the command itself prints at start-up keep real
processes. The server only imports (no thread is running when it forks: a fork copies only
the calling thread, so a pool started before it would be left half there in the child).

`torchrun` starts ``nproc`` runs as ``torchrun --standalone --nproc_per_node N`` starts its
workers: the environment its agent gives each (torch/distributed/elastic/agent/server/
local_elastic_agent.py), rank 0 hosting the store, the others killed when one fails. The
suite keeps real torchrun where the launcher is what a test is about
(tests/acceptance/test_run_clm.py's ``from_config``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# Read while the server imports, so a run cannot change them: sys.path, torch's thread pool
# (OMP_NUM_THREADS: a run may set it, not drop it), huggingface_hub's and datasets' paths and
# offline switches (module constants), tokenizers' parallelism.
IMPORT_TIME = ("PYTHONPATH", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_CACHE",
               "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM")

# The server: read one JSON request per line on stdin, fork, answer on the protocol fd; reap
# children and report their exit status. One thread, polling 20 times a second.
_SERVER = r"""
import importlib.util, json, os, select, signal, sys, traceback
script, preload = sys.argv[1], sys.argv[2]
proto = os.dup(1)
os.dup2(2, 1)  # anything the imports print goes to stderr, never into the protocol
name = os.path.splitext(os.path.basename(script))[0]
spec = importlib.util.spec_from_file_location(name, script)
module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(module)
exec(preload)
def say(**msg):
    os.write(proto, (json.dumps(msg) + "\n").encode())
def child(req):
    os.close(proto)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(req["cwd"])
    if req["env"] is not None:
        os.environ.clear()
        os.environ.update(req["env"])
        if "OMP_NUM_THREADS" in req["env"] and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
    sys.argv = [script, *req["argv"]]
    code = 1
    try:
        code = module.cli(req["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
say(ready=True)
buf, live = b"", set()
while True:
    if select.select([0], [], [], 0.05)[0]:
        data = os.read(0, 65536)
        if not data:
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                child(req)
            live.add(pid)
            say(id=req["id"], pid=pid)
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        live.discard(pid)
        say(pid=pid, rc=os.waitstatus_to_exitcode(status))
for pid in live:  # the client went away: no run outlives it
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""


class Run:
    """One forked run: its ``pid``; `wait` gives its exit status; `kill` sends SIGKILL."""

    def __init__(self):
        self.pid: int | None = None
        self.returncode: int | None = None
        self._started, self._ended = threading.Event(), threading.Event()

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked run {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        if not self._ended.is_set():
            os.kill(self.pid, signal.SIGKILL)


class Preloaded:
    """A server that imported ``script`` (and ran ``preload``, import statements) with
    ``env``; `start` forks one run of the script's ``cli(argv)`` from it."""

    def __init__(self, script: Path, env: dict[str, str], preload: str = "",
                 timeout: float = 300):
        self._env = dict(env)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(script), preload], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
        self._lock = threading.Lock()
        self._runs: dict[int, Run] = {}  # by request id until started, then by pid too
        self._by_pid: dict[int, Run] = {}
        self._next = 0
        ready = self._proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the preloading server for {script} exited with "
                               f"{self._proc.wait()} before it was ready (its stderr above)")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._timeout = timeout

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if "id" in msg:
                    run = self._runs.pop(msg["id"])
                    run.pid = msg["pid"]
                    self._by_pid[run.pid] = run
                    run._started.set()
                else:
                    run = self._by_pid.pop(msg["pid"])
                    run.returncode = msg["rc"]
                    run._ended.set()

    def start(self, argv: list[str], *, out: Path, cwd: Path | str = ".",
              env: dict[str, str] | None = None) -> Run:
        """Fork a run of ``cli(argv)`` in ``cwd``, its stdout and stderr written to ``out``
        (a file, or a FIFO to read as it runs: the run blocks until the FIFO has a reader),
        with the environment ``env`` (default: the server's)."""
        if env is not None:
            changed = [k for k in IMPORT_TIME if env.get(k) != self._env.get(k)]
            if "OMP_NUM_THREADS" in self._env and "OMP_NUM_THREADS" not in env:
                changed.append("OMP_NUM_THREADS")
            if changed:
                raise ValueError(f"a forked run cannot change {', '.join(changed)}: read "
                                 f"while the server imported; start a server with them")
        run = Run()
        with self._lock:
            rid, self._next = self._next, self._next + 1
            self._runs[rid] = run
        req = {"id": rid, "argv": [str(a) for a in argv], "out": str(out),
               "cwd": str(Path(cwd).resolve()), "env": None if env is None else dict(env)}
        self._proc.stdin.write((json.dumps(req) + "\n").encode())
        self._proc.stdin.flush()
        if not run._started.wait(self._timeout):
            raise RuntimeError(f"the preloading server did not fork {argv}")
        return run

    def torchrun(self, nproc: int, argv: list[str], *, out_dir: Path, cwd: Path | str = ".",
                 env: dict[str, str] | None = None, timeout: float = 400) -> tuple[int, str]:
        """``nproc`` runs of ``cli(argv)`` as the workers of ``torchrun --standalone
        --nproc_per_node nproc`` (their outputs in ``out_dir``/rank<i>.log); waits for all:
        (0, or the first failed rank's exit status; the ranks' outputs, rank 0 first). When
        a rank fails the others are killed, as torchrun's agent does."""
        base = dict(self._env if env is None else env)
        if nproc > 1:
            base.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several workers
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        runs, logs = [], []
        for rank in range(nproc):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                            ROLE_RANK=str(rank), ROLE_NAME="default", WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
                            ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                            TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                            TORCHELASTIC_USE_AGENT_STORE="False",
                            TORCH_NCCL_ASYNC_ERROR_HANDLING=base.get(
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
            logs.append(Path(out_dir) / f"rank{rank}.log")
            runs.append(self.start(argv, out=logs[-1], cwd=cwd, env=rank_env))
        deadline, failed = time.monotonic() + timeout, 0
        pending = list(runs)
        while pending:
            for run in list(pending):
                if run._ended.wait(0.05):
                    pending.remove(run)
                    if run.returncode != 0 and not failed:
                        failed = run.returncode
                        for other in pending:
                            other.kill()
            if pending and time.monotonic() > deadline:
                for run in pending:
                    run.kill()
                raise subprocess.TimeoutExpired(f"torchrun of {argv}", timeout)
        return failed, "".join(log.read_text() for log in logs)

    def close(self) -> None:
        """Stop the server; it kills any run still going."""
        self._proc.stdin.close()
        self._proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
