"""A child process that hosts one object and runs its ``op_*`` methods on
the parent's command: the harness's consumer shards and producers, the
vLLM benchmark's instances and the connector tests' model-runner workers.

Each worker is a child started with the *spawn* method: the parent may already
have loaded the library (a Go runtime does not survive fork), and in vLLM every
TP rank and the encoder are separate processes too. The parent drives a worker
with commands over a pipe; every wait on an answer has a deadline and notices
a worker that died, so a crashed child turns into a :class:`WorkerError`
instead of a hang. A library error in the child comes back as the same
:class:`~ecmooncake.errors.EcmError` subclass.

A host is a class (or ``"module:Class"``, imported only in the child) whose
constructor takes the worker's keyword arguments, with ``ready()`` (its
answer to the start), ``op_<name>(**args)`` for each command and ``close()``.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import time
import traceback
from typing import Any

from ..errors import EcmError, error_for

_POLL_S = 0.05


class WorkerError(RuntimeError):
    """A worker died, did not answer in time, or failed outside the library."""


def _host_class(host: type | str) -> Any:
    if isinstance(host, str):
        module, _, name = host.partition(":")
        return getattr(importlib.import_module(module), name)
    return host


def _reply_error(conn: Any, exc: BaseException) -> None:
    if isinstance(exc, EcmError):
        conn.send(("ecm", exc.code, str(exc)))
    else:
        conn.send(("error", type(exc).__name__, "".join(traceback.format_exception(exc))))


def _serve(conn: Any, host_spec: type | str, kwargs: dict) -> None:
    # The parent owns Ctrl-C: a terminal's SIGINT must not kill workers
    # before the parent has collected their answers and stopped them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        host = _host_class(host_spec)(**kwargs)
        conn.send(("ok", host.ready()))
    except BaseException as exc:
        _reply_error(conn, exc)
        return
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            op = "stop"
        if op == "stop":
            break
        try:
            conn.send(("ok", getattr(host, "op_" + op)(**args)))
        except Exception as exc:
            _reply_error(conn, exc)
    try:
        host.close()
        conn.send(("ok", None))
    except Exception as exc:
        try:
            _reply_error(conn, exc)
        except OSError:
            pass


class _Driven:
    """What drives a host, in a process of its own or in this one: a
    command and its answer (send, result, stop are each kind's own)."""

    timeout: float
    info: Any

    def send(self, op: str, **args: Any) -> None:
        raise NotImplementedError

    def result(self, timeout: float) -> Any:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def wait_ready(self, timeout: float) -> Any:
        self.info = self.result(timeout)
        return self.info

    def call(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        self.send(op, **args)
        return self.result(self.timeout if timeout is None else timeout)

    def __enter__(self) -> "_Driven":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class Worker(_Driven):
    """A spawned process hosting one object (see the module docstring).

    Use :meth:`call` for one command, or :meth:`send` then :meth:`result` to
    keep several workers busy at once; :meth:`wait_ready` (or a first
    :meth:`result`) collects the host's ``ready()``. ``timeout`` is the
    default wait of :meth:`call`.
    """

    def __init__(self, host: type | str, name: str, *, timeout: float = 60.0, **kwargs: Any):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.timeout = timeout
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, host, kwargs), name=name, daemon=True)
        self._proc.start()
        child.close()
        self._op = "start"
        self._broken: str | None = None
        self.info: Any = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def send(self, op: str, **args: Any) -> None:
        if self._broken:
            raise WorkerError(f"{self.name}: unusable after {self._broken}")
        self._op = op
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            self._broken = f"{op}: {exc}"
            raise WorkerError(self._death_note(op)) from exc

    def result(self, timeout: float) -> Any:
        op = self._op
        deadline = time.monotonic() + timeout
        while True:
            if self._conn.poll(_POLL_S):
                try:
                    message = self._conn.recv()
                except (EOFError, ConnectionResetError, OSError) as exc:
                    self._broken = f"{op}: pipe closed"
                    raise WorkerError(self._death_note(op)) from exc
                break
            if not self._proc.is_alive() and not self._conn.poll(0):
                self._broken = f"{op}: process exited"
                raise WorkerError(self._death_note(op))
            if time.monotonic() >= deadline:
                self._broken = f"{op}: no answer within {timeout:.1f}s"
                raise WorkerError(f"{self.name}: no answer to {op!r} within {timeout:.1f}s")
        status = message[0]
        if status == "ok":
            return message[1]
        if status == "ecm":
            raise error_for(message[1], f"{self.name}: {message[2]}")
        raise WorkerError(f"{self.name}: {op!r} raised {message[1]}:\n{message[2]}")

    def _death_note(self, op: str) -> str:
        self._proc.join(1.0)
        code = self._proc.exitcode
        how = f"exit status {code}" if code is None or code >= 0 else f"signal {-code}"
        return f"{self.name} (pid {self.pid}) died during {op!r} ({how})"

    def kill(self) -> None:
        if self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join(5.0)
        self._broken = self._broken or "kill"

    def stop(self, timeout: float = 10.0) -> None:
        """Closes the hosted object and ends the process; kills it if it hangs."""
        if self._proc.is_alive() and not self._broken:
            try:
                self.call("stop", timeout)
            except (WorkerError, EcmError):
                pass
        self._proc.join(timeout if self._proc.is_alive() else 0)
        if self._proc.is_alive():
            self.kill()
        self._conn.close()


class InProcess(_Driven):
    """A host run in this process behind :class:`Worker`'s calls: vLLM's
    engine core at TP 1 runs its model runner in the scheduler's own
    process (the ``uni`` executor), with no pipe between a step's
    metadata and the worker. A command runs when sent; its answer, or
    its exception, is what :meth:`result` gives back."""

    def __init__(self, host: type | str, name: str, *, timeout: float = 60.0, **kwargs: Any):
        self.name = name
        self.timeout = timeout
        self.info: Any = None
        self._answer: tuple[bool, Any] = (True, None)
        self._host: Any = None
        self._op = "start"
        self._run(lambda: self._start(host, kwargs))

    def _start(self, host: type | str, kwargs: dict) -> Any:
        self._host = _host_class(host)(**kwargs)
        return self._host.ready()

    def _run(self, fn: Any) -> None:
        try:
            self._answer = (True, fn())
        except Exception as exc:
            self._answer = (False, exc)

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def alive(self) -> bool:
        return self._host is not None

    def send(self, op: str, **args: Any) -> None:
        if self._host is None:
            raise WorkerError(f"{self.name}: not running (its start failed, or it stopped)")
        self._op = op
        self._run(lambda: getattr(self._host, "op_" + op)(**args))

    def result(self, timeout: float) -> Any:
        ok, value = self._answer
        self._answer = (True, None)
        if ok:
            return value
        if isinstance(value, EcmError):
            raise value
        raise WorkerError(f"{self.name}: {self._op!r} raised {type(value).__name__}: {value}") from value

    def kill(self) -> None:
        self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        host, self._host = self._host, None
        if host is not None:
            host.close()


def stop_all(workers: list[Worker], timeout: float = 10.0) -> None:
    """Stops every worker, even when some of them fail to stop."""
    for worker in workers:
        try:
            worker.stop(timeout)
        except Exception:
            worker.kill()
