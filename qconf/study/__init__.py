"""Config comparison studies (``qconf compare``) and their built-in tasks.

    from qconf.study import compare
    result = compare(["configs/fp32.yml", "configs/8bit.yml", "configs/default.yml"], task="charlm", seeds=2)
    print(result.table())

    # a sweep, two optimizers, resumable in results/x, two runs at a time
    compare(["default", "fp32"], vary=["states.exp_avg.bits=3,4,5"], optimizer="adamw,lion",
            lr={"adamw": 1.5e-3, "lion": 3e-4}, seeds=5, out="results/x", jobs=2)

    # the same as an array job: plan_study(..., out=DIR); run_one(DIR, i) for each run; collect(DIR)

See docs/studies.md. Built-in tasks: ``charlm`` (byte-level GPT on CPython's stdlib sources) and
``digits`` (MLP on scikit-learn's digits); your own: a function returning a :class:`Task`.
Modules, lowest first: ``task``/``tasks`` (the task protocol, finding tasks), ``runner`` (one
training run), ``sweep`` (--vary), ``keys`` (run keys), ``plan`` (rows and runs), ``store`` (the
output directory), ``progress``, ``execute``/``parallel`` (running runs), ``stats`` (paired
statistics), ``results``, ``plots``/``sweep_plot``/``report`` (outputs), ``arguments`` and
``compare`` (the study), ``cli``.
"""
from .compare import collect, compare, plan_study, run_one
from .results import StudyResult
from .runner import RunResult
from .task import StudyError, Task
from .tasks import BUILTIN_TASKS, DEFAULT_TASK, resolve_task

__all__ = ["compare", "plan_study", "run_one", "collect", "StudyResult", "RunResult", "Task", "StudyError",
           "resolve_task", "BUILTIN_TASKS", "DEFAULT_TASK"]
