"""Finding a task by name: the built-in tasks, or ``module:function`` for your own.

    resolve_task("charlm")                  # built-in (see BUILTIN_TASKS)
    resolve_task("mypkg.tasks:make_task")   # import mypkg.tasks, call make_task() -> Task
    resolve_task("path/to/tasks.py:make")   # a file outside any package works too

Every failure (unknown name, module not importable, no such function, the function raises or does
not return a :class:`Task`) is a :class:`StudyError` whose message is one line.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from typing import Callable

from .task import StudyError, Task


def _charlm() -> Task:
    from .charlm import charlm_task

    return charlm_task()


def _digits() -> Task:
    from .digits import digits_task

    return digits_task()


#: name -> factory of the built-in tasks (``qconf compare --task NAME``)
BUILTIN_TASKS: dict[str, Callable[[], Task]] = {"charlm": _charlm, "digits": _digits}
DEFAULT_TASK = "charlm"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _import(module: str):
    if module.endswith(".py") or os.sep in module or "/" in module:
        if not os.path.isfile(module):
            raise StudyError(f"task file {module!r} not found")
        name = "_qconf_user_task_" + os.path.splitext(os.path.basename(module))[0]
        spec = importlib.util.spec_from_file_location(name, module)
        if spec is None or spec.loader is None:
            raise StudyError(f"cannot import task file {module!r}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    # like `python -m`: modules in the current directory are importable
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(module)


def resolve_task(spec: str | Task | Callable[[], Task]) -> Task:
    """A :class:`Task` from a built-in name, ``"module:function"``, a Task, or a factory."""
    if isinstance(spec, Task):
        return spec
    if callable(spec):
        task = spec()
        where = getattr(spec, "__qualname__", repr(spec))
    elif not isinstance(spec, str) or not spec:
        raise StudyError(f"task must be a name, 'module:function' or a Task, got {spec!r}")
    elif ":" in spec:
        module, _, func = spec.rpartition(":")
        if not module or not func:
            raise StudyError(f"task {spec!r} is not 'module:function' (e.g. mypkg.tasks:make_task)")
        try:
            mod = _import(module)
        except StudyError:
            raise
        except Exception as e:  # noqa: BLE001 - a user module may fail in any way; say how, in one line
            raise StudyError(f"cannot import task module {module!r} ({_one_line(e)})") from e
        factory = getattr(mod, func, None)
        if factory is None or not callable(factory):
            names = [n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n))]
            close = difflib.get_close_matches(func, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise StudyError(f"task module {module!r} has no function {func!r}{hint}")
        try:
            task = factory()
        except Exception as e:  # noqa: BLE001
            raise StudyError(f"task function {spec!r} failed ({_one_line(e)})") from e
        where = spec
    else:
        factory = BUILTIN_TASKS.get(spec)
        if factory is None:
            close = difflib.get_close_matches(spec, list(BUILTIN_TASKS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise StudyError(f"unknown task {spec!r} (built-in: {', '.join(BUILTIN_TASKS)}; or module:function "
                             f"returning a qconf.study.Task){hint}")
        try:
            task = factory()
        except ImportError as e:
            raise StudyError(f"task {spec!r} needs a missing package ({_one_line(e)}); "
                             "pip install 'qconf[study]'") from e
        where = spec
    if not isinstance(task, Task):
        raise StudyError(f"task {where!r} returned {type(task).__name__}, not a qconf.study.Task")
    return task
