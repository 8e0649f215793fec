"""Config comparison studies (``qconf compare``) and their built-in tasks.

    from qconf.study import compare
    result = compare(["configs/fp32.yml", "configs/8bit.yml", "configs/default.yml"], task="charlm", seeds=2)
    print(result.table())

See docs/studies.md. Built-in tasks: ``charlm`` (byte-level GPT on CPython's stdlib sources) and
``digits`` (MLP on scikit-learn's digits); your own: a function returning a :class:`Task`.
"""
from .compare import compare
from .results import StudyResult
from .runner import RunResult
from .task import StudyError, Task
from .tasks import BUILTIN_TASKS, DEFAULT_TASK, resolve_task

__all__ = ["compare", "StudyResult", "RunResult", "Task", "StudyError", "resolve_task", "BUILTIN_TASKS",
           "DEFAULT_TASK"]
