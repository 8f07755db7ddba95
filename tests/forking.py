"""Run part of a test in a forked child, or in an interpreter of its own, and hear what
it answered."""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

T = TypeVar("T")


def answer_in_a_child(action: Callable[[], str], fork: Callable[[], int] = os.fork) -> str:
    """What ``action`` returned in a child made by ``fork`` (its exception's type and
    text if it raised); what became of the child if it answered nothing (it is ended
    after 10 s). The child ends with ``os._exit``, so that nothing of the parent's
    (pytest, fixtures, ``with`` blocks) runs on in it."""
    read, write = os.pipe()
    child = fork()
    if child == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's, if any
        signal.alarm(10)
        answer = "nothing"
        try:
            answer = action()
        except BaseException as exc:
            answer = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(write, answer.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answered:
        text = answered.read().decode()
    _, status = os.waitpid(child, 0)
    if text or not os.WIFSIGNALED(status):
        return text
    ended_by = signal.Signals(os.WTERMSIG(status))
    return "hung for 10 s" if ended_by == signal.SIGALRM else f"ended by {ended_by.name}"


def in_a_fresh_interpreter(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` run in a new interpreter (multiprocessing's spawn), where the
    only threads are the ones it starts; an exception there fails here, with its
    traceback. ``function`` must be importable by name.

    For a test that forks from C, without Python's at-fork hooks: the child gets every
    lock of the interpreter as the parent's threads left it (the GIL's own mutex, the
    import lock, threading's), and a pytest-xdist worker has a thread of its own
    (execnet's) that wakes whenever the controller writes: one that held such a lock as
    the process forked hung the child. A uWSGI master, which such tests stand for, runs
    no threads of its own."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_answer, args=(send, function, *args))
    process.start()
    send.close()
    try:
        if not receive.poll(60):
            raise AssertionError(f"{function.__name__} gave no answer within 60 s")
        try:
            finished, answer = receive.recv()
        except EOFError:
            process.join(5)
            raise AssertionError(
                f"{function.__name__}'s interpreter ended ({process.exitcode}) without an answer"
            ) from None
    finally:
        receive.close()
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
    if not finished:
        raise AssertionError(f"in {function.__name__}'s interpreter:\n{answer}")
    return answer  # type: ignore[no-any-return]


def _answer(send: Connection, function: Callable[..., Any], *args: Any) -> None:
    warnings.simplefilter("error")  # as the suite's configuration has it
    warnings.filterwarnings("ignore", ".*fork\\(\\) may lead to deadlocks", DeprecationWarning)
    try:
        answer = (True, function(*args))
    except BaseException:
        answer = (False, traceback.format_exc())
    send.send(answer)
    send.close()
