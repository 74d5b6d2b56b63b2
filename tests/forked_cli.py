"""``python -m salvage ARGS`` as a real process, without paying its imports each time.

A ``salvage fit`` process spends ~8 s of CPU importing torch, Lightning and transformers
before it reads its config: a test file that runs 30 bad inputs through the command line
spent four minutes on imports alone. Here a server process imports the command line's heavy
modules once, then forks one child per command. The child is a process of its own (its own
exit status, its own file descriptors 0-2, the requested working directory and
environment, ``sys.argv`` and ``__main__`` as ``python -m salvage`` has them, atexit
handlers at its exit), so a test sees what a fresh ``python -m salvage`` prints and returns.

What differs from a fresh process: the modules are already imported (what an import would
print goes to the server's log, not to the command's stderr), and an environment that
differs from the server's in any variable starts a server of its own (variables that are
read at import time then still hold). Commands that a test signals or watches while they
run stay plain ``subprocess`` calls.

``run(args, cwd, env, timeout)`` returns a ``subprocess.CompletedProcess`` like
``subprocess.run([sys.executable, "-m", "salvage", *args], capture_output=True, text=True)``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ the server
def _child(req: dict) -> None:
    """In the forked child: become ``python -m salvage ARGS`` and run it to its exit."""
    os.setpgid(0, 0)  # a timeout kills the command and whatever it started
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    import salvage.__main__ as entry

    sys.modules["__main__"] = entry  # multiprocessing's spawn re-imports it as python -m does
    sys.argv = [entry.__file__, *req["args"]]
    try:
        entry.main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - as the interpreter does: traceback, status 1
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    raise SystemExit(0)


def serve() -> None:
    """Read one JSON request a line on stdin; answer ``{"id", "pid"}`` when the child starts
    and ``{"id", "code"}`` when it ends, on the stdout the server started with."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what an import prints goes to the server's log
    import salvage.commands.cli  # noqa: F401
    import salvage.commands.fit  # noqa: F401  (torch, Lightning, transformers)

    children: dict[int, str] = {}
    buf, open_ = b"", True
    while open_ or children:
        ready, _, _ = select.select([0] if open_ else [], [], [], 0.05)
        if ready:
            chunk = os.read(0, 1 << 16)
            open_ = bool(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    answers.close()
                    _child(req)  # never returns: its SystemExit ends the child
                children[pid] = req["id"]
                answers.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
                answers.flush()
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            answers.write(json.dumps({"id": children.pop(pid), "code": code}) + "\n")
            answers.flush()


# ------------------------------------------------------------------------------ the client
class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="salvage_forked_cli_"))
        self.log = self.dir / "server.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=ROOT,
            )
        self.lock = threading.Lock()
        self.pending: dict[str, tuple[Future, Future]] = {}
        self.count = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            started, ended = self.pending[msg["id"]]
            if "pid" in msg:
                started.set_result(msg["pid"])
            else:
                ended.set_result(msg["code"])
        err = RuntimeError(f"the forked-CLI server ended: {self.log.read_text()[-3000:]}")
        for started, ended in self.pending.values():
            for f in (started, ended):
                if not f.done():
                    f.set_exception(err)

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float):
        with self.lock:
            self.count += 1
            rid = str(self.count)
            started, ended = Future(), Future()
            self.pending[rid] = (started, ended)
            out, err = self.dir / f"{rid}.out", self.dir / f"{rid}.err"
            req = {"id": rid, "args": list(args), "cwd": str(cwd), "env": env,
                   "out": str(out), "err": str(err)}  # fmt: skip
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        cmd = [sys.executable, "-m", "salvage", *args]
        pid = started.result(timeout=timeout)  # the first waits for the imports
        try:
            code = ended.result(timeout=timeout)
        except FutureTimeout:
            os.killpg(pid, signal.SIGKILL)
            ended.result(timeout=60)
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        text = (out.read_text(errors="replace"), err.read_text(errors="replace"))
        out.unlink()
        err.unlink()
        return subprocess.CompletedProcess(cmd, code, *text)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_SERVERS: dict[frozenset, _Server] = {}
_LOCK = threading.Lock()


def run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``python -m salvage ARGS`` in ``cwd`` with exactly ``env``, its output captured."""
    key = frozenset(env.items())
    with _LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = _Server(env)
        server = _SERVERS[key]
    return server.run(args, cwd, env, timeout)


@atexit.register
def _close() -> None:
    for server in _SERVERS.values():
        server.close()


if __name__ == "__main__":
    serve()
