"""Run part of a test in a forked child and hear what it answered."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def answer_in_a_child(action: Callable[[], str], fork: Callable[[], int] = os.fork) -> str:
    """What ``action`` returned in a child made by ``fork`` (its exception's type and
    text if it raised); nothing if it hung for 10 s. The child ends with ``os._exit``,
    so that nothing of the parent's (pytest, fixtures, ``with`` blocks) runs on in it."""
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
    os.waitpid(child, 0)
    return text
