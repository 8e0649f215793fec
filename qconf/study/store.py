"""A study's output directory as its store of runs (``--out DIR``)::

    DIR/study.json         the plan: rows, seeds, settings, the distinct runs and their keys
    DIR/runs/<key>.json    one finished run (written once, atomically, by whichever process ran it)
    DIR/configs/<row>.yml  each row's full resolved config
    DIR/results.json, results.csv, report.md, *.png   the report (rewritten from the runs)

Runs are looked up by key, so a study started again with the same ``--out`` runs only what is not
there: new points, new seeds, and runs that did not finish (interrupted or crashed ones are run
again; ``ok`` and ``diverged`` ones are kept). Any number of processes may write runs at once (an
array job on a shared directory): each run is its own file, renamed into place when complete.

A directory that holds another study (a different task or shared settings, or outputs without a
study.json) is refused before anything is written.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .keys import plain
from .plan import PlannedRun, StudyPlan
from .runner import RunResult
from .task import StudyError

#: statuses a stored run keeps (a rerun skips it); "crashed" and "interrupted" runs are run again
FINAL = ("ok", "diverged")
#: files and directories that mark a directory as holding a study's outputs
OUTPUTS = ("study.json", "results.json", "results.csv", "report.md", "runs")
#: text files are UTF-8 whatever the locale; a file name's undecodable bytes (surrogate escapes in
#: ``sys.argv`` under an ASCII or mismatched locale) are written as ``\\udcXX`` instead of failing
TEXT = {"encoding": "utf-8", "errors": "backslashreplace"}
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+@-]")


class RunStore:
    """Reads and writes the runs and the plan of one ``--out`` directory."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.runs_dir = self.out / "runs"

    @property
    def plan_path(self) -> Path:
        return self.out / "study.json"

    # -- the plan ------------------------------------------------------------------------------
    def check_same_study(self, plan: StudyPlan) -> None:
        """StudyError if the directory holds another study's outputs (nothing is written)."""
        if not self.out.is_dir():
            return
        if not self.plan_path.exists():
            found = [name for name in OUTPUTS if (self.out / name).exists()]
            if found:
                raise StudyError(f"--out {str(self.out)!r} holds study outputs ({', '.join(found)}) without a "
                                 "study.json (another study, or one from an older qconf): give another --out")
            return
        theirs = self.read_plan_data().get("identity", {})
        ours = plain(plan.identity())
        if theirs != ours:
            diff = [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
            what = ", ".join(f"{k} {_short(theirs.get(k))} there, {_short(ours.get(k))} here" for k in diff)
            raise StudyError(f"--out {str(self.out)!r} holds another study ({what}): give another --out, or "
                             "the same task and settings to extend that study")

    def read_plan_data(self) -> dict[str, Any]:
        """study.json as plain data; StudyError when it is missing or unreadable."""
        try:
            data = json.loads(self.plan_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StudyError(f"--out {str(self.out)!r} holds no study.json (make one with --plan)") from None
        except (OSError, ValueError) as e:
            raise StudyError(f"cannot read {str(self.plan_path)!r} ({e})") from None
        if not isinstance(data, dict):
            raise StudyError(f"{str(self.plan_path)!r} is not a study plan")
        return data

    def write_plan(self, plan: StudyPlan) -> None:
        """study.json and configs/<row>.yml (each row's full resolved config)."""
        configs = self.out / "configs"
        configs.mkdir(parents=True, exist_ok=True)
        for row, name in zip(plan.rows, file_names([r.label for r in plan.rows])):
            header = f"# {row.label}: {row.source}" + "".join(f"\n#   {f} = {v}" for f, v in row.changes)
            _write_atomic(configs / f"{name}.yml", header + "\n" + row.config.to_yaml())
        _write_atomic(self.plan_path, json.dumps(plan.to_dict(), indent=1) + "\n")

    # -- runs ----------------------------------------------------------------------------------
    def _run_path(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{24}", key):
            raise StudyError(f"not a run key: {key!r}")
        return self.runs_dir / f"{key}.json"

    def load(self, key: str) -> RunResult | None:
        """The stored run with ``key`` (any status), or None."""
        try:
            data = json.loads(self._run_path(key).read_text(encoding="utf-8"))
            return RunResult.from_dict(data["result"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StudyError(f"run file {str(self._run_path(key))!r} is damaged ({e}): delete it to run again") from None

    def save(self, run: PlannedRun, plan: StudyPlan, result: RunResult) -> None:
        """Store ``result`` as the run ``run`` of ``plan`` (with what determined it, for reading)."""
        row = plan.row(run.rows[0])
        record = {"key": run.key, "seed": run.seed, "row": row.label, "optimizer": row.optimizer, "lr": row.lr,
                  "kwargs": plain(row.kwargs), "config": row.config.to_dict(), "shared": plan.shared,
                  "result": result.to_dict()}
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self._run_path(run.key), json.dumps(record, indent=None) + "\n")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", **TEXT) as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600: readable as any new file is (a shared --out)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_names(labels: list[str]) -> list[str]:
    """File-system-safe, distinct names for row labels (other characters become ``_``)."""
    out: list[str] = []
    for label in labels:
        name = _UNSAFE.sub("_", label)[:120] or "row"
        base, n = name, 1
        while name in out:
            n += 1
            name = f"{base}_{n}"
        out.append(name)
    return out

