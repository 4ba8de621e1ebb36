"""Where rank 0 sends a run's numbers besides its log (log.report_to): TensorBoard (run_record.TensorBoard), a CSV
file, Weights & Biases, MLflow. Each tracker has the same four methods: config(values), scalars(step, values),
summary(values), close(failed, stopped). Tags are TensorBoard's: `train/loss`, `dev/accuracy`, `summary/best_step`.

Runs are named after output_dir's folder. The W&B project and the MLflow experiment: WANDB_PROJECT and
MLFLOW_EXPERIMENT_NAME, else the task's name. A resumed run continues the tracked run it resumes: the W&B and
MLflow run ids are kept in output_dir/trackers.json, with the folder they belong to (a copy of output_dir starts
runs of its own, said in one line; a folder moved goes on with its runs). wandb and mlflow are optional packages:
asked for and missing, the config check refuses the run in one line naming what to install. What the libraries
would write outside output_dir is kept in it: W&B's service logs go beside its run files unless WANDB_CACHE_DIR is
set, and MLflow's telemetry (an id file in ~/.config/mlflow, usage sent over the network) is off unless
MLFLOW_DISABLE_TELEMETRY is set, and so are its INFO lines on stderr unless MLFLOW_LOGGING_LEVEL is.
A tracker that cannot start (a store
MLflow refuses, no W&B login, ...) is one line naming it and the fix, before training; one that fails later is
named once, closed marked failed and dropped, and training goes on. A full disk or a read-only file stops the run as
anywhere else. A run that ends in an exception closes its trackers marked failed (closed_failed_on_crash); one
stopped by a signal or the time limit (saved, exit 3) ends its MLflow run KILLED and its W&B run preempting with exit
code 3, which its resume continues and ends FINISHED; one whose rank 0 is killed (kill -9, the kernel's OOM killer)
has its MLflow run ended FAILED by main.py's launcher, or by the watcher of a run of one process
(end_runs_left_running).
"""
from __future__ import annotations

import contextlib
import csv
import functools
import importlib.util
import json
import os
import re
import stat
import threading
import time
from typing import Callable, Iterator, Optional

from core import disk_errors, process_end
from core.atomic_write import write_beside
from core.errors import EXIT_STOPPED, UserError, first_line, warn_on_stderr
from core.file_names import shown_name

NAMES = ("tensorboard", "csv", "wandb", "mlflow")
# What to install for an optional tracker: the versions requirements-dev.txt pins and the tests run.
# mlflow-skinny, not mlflow: the full package pins pyarrow below requirements.txt's.
PACKAGES = {"wandb": {"wandb": "wandb==0.31.0"}, "mlflow": {"mlflow": "mlflow-skinny==3.17.2"}}
SQL_PACKAGES = {"sqlalchemy": "sqlalchemy==2.1.9", "alembic": "alembic==1.20.1"}  # MLflow's sqlite store
IDS_FILE = "trackers.json"  # the tracked runs' ids, for resume
IDS_MAX_BYTES = 64 << 10  # ours holds two ids
FOLDER_KEYS = ("output_dir", "output_dir_inode")  # and the folder it was written in (folder_identity)
END_WAIT_S = 60.0  # how long what outlives a killed rank 0 waits for MLflow's store to end its run (MLflow: ~3 s)
DROP_WAIT_S = 30.0  # how long training waits for a tracker dropped mid-run to close (W&B offline: ~2 s)
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # a URI's scheme: sqlite:, http:, databricks:, postgresql+...:
RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # W&B's and MLflow's ids: never a path, or a file name too long
CSV_FILE = "metrics.csv"
FIXES = {"tensorboard": "set log.tensorboard: false to run without it",
         "csv": "remove csv from log.report_to to run without it",
         "wandb": "run `wandb login`, set WANDB_MODE=offline, or remove wandb from log.report_to",
         "mlflow": "set log.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) to a store MLflow accepts, e.g. "
                   "sqlite:///runs/mlflow.db, or remove mlflow from log.report_to"}


def names(cfg) -> list[str]:
    """The trackers a run reports to: log.report_to, with log.tensorboard (when set) adding or removing TensorBoard."""
    wanted = [n for n in dict.fromkeys(cfg.log.report_to) if n != "tensorboard" or cfg.log.tensorboard is not False]
    if cfg.log.tensorboard and "tensorboard" not in wanted:
        wanted.insert(0, "tensorboard")
    return wanted


def check_config(cfg, fail) -> None:
    """log.report_to names known trackers whose packages are installed (config.validate asks, when it is set)."""
    report, uri = cfg.log.report_to, cfg.log.mlflow_tracking_uri
    for name in report:
        if name not in NAMES:
            fail("log.report_to", f"lists {str(name)[:40]!r}, not a tracker ({', '.join(NAMES)})")
    if uri is not None and not uri.strip():
        fail("log.mlflow_tracking_uri", "is empty: give a tracking URI, or null for sqlite:///<output_dir>/mlflow.db")
    # A path is a file store to MLflow, which MLflow 3 refuses (said once torch and the model had loaded, cut short)
    given = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if "mlflow" in names(cfg) and given and not SCHEME.match(given) and ("/" in given or given.startswith(("~", "."))):
        path = os.path.abspath(os.path.expanduser(given))
        database = path if path.endswith(".db") else os.path.join(path, "mlflow.db")
        fail("log.mlflow_tracking_uri", (f"is {uri[:80]!r}" if uri else f"is null and MLFLOW_TRACKING_URI is "
                                         f"{given[:80]!r}") + ", a path: MLflow 3 keeps its runs in a database, not "
                                        f"a folder: give sqlite:///{database} (or a server's http:// address)")
    # In the default store's URI, SQLAlchemy ends the path at a `?` and decodes a %41: a file outside output_dir.
    where = os.path.abspath(cfg.output_dir)
    if ("mlflow" in names(cfg) and not given
            and re.search(r"\?|%[0-9A-Fa-f]{2}", where)):
        fail("output_dir", f"{where[:80]!r} holds a `?` or a %XX escape, which MLflow's default store "
                           "sqlite:///<output_dir>/mlflow.db reads as another file: set log.mlflow_tracking_uri")
    for name in names(cfg):
        need = dict(PACKAGES.get(name, {}))
        if name == "mlflow" and mlflow_uri(cfg).startswith("sqlite:"):
            need.update(SQL_PACKAGES)
        missing = [module for module in need if importlib.util.find_spec(module) is None]
        if missing:
            fail("log.report_to", f"lists {name}, but Python finds no {', '.join(missing)} package: "
                                  f"pip install {' '.join(need.values())}")


def run_name(cfg) -> str:
    return os.path.basename(os.path.abspath(cfg.output_dir))


def mlflow_uri(cfg) -> str:
    """log.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else a sqlite file in output_dir."""
    return (cfg.log.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{os.path.abspath(os.path.join(cfg.output_dir, 'mlflow.db'))}")


def flat(values: dict, prefix: str = "") -> dict:
    """{'train': {'lr': 0.1}} -> {'train.lr': 0.1}."""
    out = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Trackers:
    """The trackers of log.report_to, built on rank 0 as training starts at `step` (> 0: resumed). `tensorboard`:
    what builds TensorBoard's writer from its folder and the first step it writes (run_record.TensorBoard). Each
    call goes to every tracker."""

    def __init__(self, cfg, step: int, tensorboard: Callable[[str, int], object],
                 warn: Callable[[str], None] = warn_on_stderr):
        out, self.output_dir, self.warn = cfg.output_dir, cfg.output_dir, warn
        self.ids_path = os.path.join(out, IDS_FILE)
        ids = read_ids(self.ids_path, warn) if step else {}  # a fresh start opens new tracked runs
        builders = {"tensorboard": lambda: tensorboard(os.path.join(out, "tensorboard"), step + 1),
                    "csv": lambda: CSV(os.path.join(out, CSV_FILE), step),
                    "wandb": lambda: WandB(cfg, ids.get("wandb")),
                    "mlflow": lambda: MLflow(cfg, ids.get("mlflow"))}
        self.names = names(cfg)
        self.members = []
        try:
            for name in self.names:
                self.members.append(self.started(name, builders[name]))
                if getattr(self.members[-1], "not_held", None):  # an id of trackers.json the store does not hold
                    warn(f"{shown_name(self.ids_path)}: {self.members[-1].not_held}")
            # and the ids of trackers left out of this start: a later resume that lists them again continues them
            run_ids = {**ids, **{n: m.run_id for n, m in zip(self.names, self.members) if getattr(m, "run_id", None)}}
            if run_ids:
                write_beside(self.ids_path, lambda f: json.dump({**run_ids, **folder_identity(out)}, f))
        except BaseException:
            self.close(failed=True)  # the runs started (a full disk may stop the start after them) never trained
            raise

    def started(self, name: str, build: Callable[[], object]):
        """build() of tracker `name`, or a UserError naming it and the fix (a full disk: disk_errors' line)."""
        try:
            return build()
        except UserError:
            raise
        except Exception as e:  # MLflow refusing a file:// store, a network error, a broken install, ...
            if disk_errors.disk_problem(e, self.output_dir):
                raise
            raise UserError(f"log.report_to: {name} could not start ({first_line(e, limit=120)}): "
                            f"{FIXES[name]}") from None

    def each(self, method: str, *args) -> None:
        """`method(*args)` of every tracker. One that fails (a server gone, a full quota) is named once, closed
        marked failed and dropped: the training goes on without it. A full disk or a read-only file stops the run
        as anywhere."""
        for name, member in list(zip(self.names, self.members)):
            try:
                getattr(member, method)(*args)
            except Exception as e:
                if disk_errors.disk_problem(e, self.output_dir):
                    raise
                self.names.remove(name)
                self.members.remove(member)
                self.warn(f"tracker {name} failed ({first_line(e, limit=120)}); it is dropped and training goes "
                          "on without it")
                if method != "close":
                    self.close_dropped(name, member)

    def close_dropped(self, name: str, member) -> None:
        """A tracker dropped mid-run, closed marked failed: left open, MLflow's run stayed RUNNING after the run's
        end, and W&B's service ended with the process, its file without what it held. In a thread, waited for
        DROP_WAIT_S at most: a store that does not answer is retried by MLflow's client for minutes."""
        said = []

        def close():
            try:
                member.close(True)
            except Exception as e:
                said.append(first_line(e, limit=120))
        closing = threading.Thread(target=close, name=f"close-{name}", daemon=True)
        closing.start()
        closing.join(DROP_WAIT_S)
        if closing.is_alive():
            said.append(f"it did not close within {DROP_WAIT_S:g} s")
        for why in said:
            self.warn(f"tracker {name} was not closed ({why})")

    def config(self, values: dict) -> None:
        self.each("config", values)

    def scalars(self, step: int, values: dict) -> None:
        self.each("scalars", step, values)

    def summary(self, values: dict) -> None:
        self.each("summary", values)

    def close(self, failed: bool = False, stopped: bool = False) -> None:
        """`failed`: the run ended in an exception, which is what gets reported: each tracker is closed all the
        same, and one that cannot close is said beside it (a full disk, which the report says, is not). `stopped`:
        a stop's close (Trainer.stop: saved, to be resumed), not the run's end."""
        if not failed:
            self.each("close", False, stopped)
        else:
            for name, member in zip(self.names, self.members):
                try:
                    member.close(True)
                except Exception as e:
                    if not disk_errors.disk_problem(e, self.output_dir):
                        self.warn(f"tracker {name} was not closed ({first_line(e, limit=120)})")
        self.members = []


def read_ids(path: str, warn: Callable[[str], None]) -> dict:
    """trackers.json's ids of W&B and MLflow runs. None: new tracked runs. Any other content (cut, edited, a
    symlink, a FIFO) is said in one line, and the trackers whose ids it does not hold start new runs. So is a file
    written in another folder, of which output_dir is a copy: continued, its runs would hold both runs' points."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block open(); a symlink leaves output_dir
            raise ValueError("not a regular file")
        with open(path, "rb") as f:
            ids = json.loads(f.read(IDS_MAX_BYTES))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
        why = "not JSON" if isinstance(e, json.JSONDecodeError) else first_line(e)
        warn(f"{shown_name(path)}: unreadable ({why}), so W&B and MLflow start new runs")
        return {}
    if not isinstance(ids, dict):
        warn(f"{shown_name(path)}: a JSON {type(ids).__name__}, not the runs' ids, so W&B and MLflow start new runs")
        return {}
    written_in = {key: ids.pop(key) for key in FOLDER_KEYS if key in ids}  # (files before it: none)
    here = folder_identity(os.path.dirname(path))
    if written_in and all(written_in.get(key) != here[key] for key in FOLDER_KEYS):
        warn(f"{shown_name(path)}: written in {str(written_in.get('output_dir'))[:200]!r}, of which this output_dir "
             "is a copy, so W&B and MLflow start new runs (the copy's own)")
        return {}
    kept = {name: ids[name] for name in ("wandb", "mlflow")
            if isinstance(ids.get(name), str) and RUN_ID.fullmatch(ids[name])}
    wrong = [name for name in ids if name not in kept]
    if wrong:
        warn(f"{shown_name(path)}: {', '.join(f'`{str(name)[:20]}`' for name in wrong[:4])}: not a W&B or MLflow "
             "run id, ignored (a tracker without one starts a new run)")
    return kept


def folder_identity(output_dir: str) -> dict:
    """What trackers.json records of the folder it is written in: its path, and its inode, which a folder moved
    (or reached through another mount) keeps and a copy does not."""
    return {"output_dir": os.path.realpath(output_dir), "output_dir_inode": os.stat(output_dir).st_ino}


def end_runs_left_running(cfg, say: Callable[[str], None] = functools.partial(print, flush=True)) -> None:
    """After rank 0 was killed (kill -9, the kernel's OOM killer), which closed no tracker: its MLflow run, still
    RUNNING in its store, is ended FAILED, and said. Called by what outlives rank 0: launcher.Supervisor, and a
    one-process run's watcher (resource_errors.reports_a_kill). Anything that fails here, or a store that does not
    answer within END_WAIT_S, is one line."""
    # (what read_ids says of a file it does not follow is about new runs, which start here only with a resume: unsaid)
    ids = read_ids(os.path.join(cfg.output_dir, IDS_FILE), lambda line: None) if "mlflow" in names(cfg) else {}
    run_id = ids.get("mlflow")
    if not run_id:
        return
    said = []

    def end():
        try:
            client = mlflow_client(cfg)
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, status="FAILED")
                said.append(f"note: MLflow run {run_id}, left RUNNING by rank 0's death, is marked FAILED")
        except Exception as e:  # a store gone, a server down: the crash is what matters
            said.append(f"warning: MLflow run {run_id} was not marked FAILED after rank 0's death "
                        f"({first_line(e, limit=100)})")
    # In a thread, waited for END_WAIT_S at most: a server that takes connections and never answers keeps MLflow
    # retrying for minutes, and the launcher (or watcher) would keep the job from ending, without a word
    ending = threading.Thread(target=end, name="end-mlflow-run", daemon=True)
    ending.start()
    ending.join(END_WAIT_S)
    if ending.is_alive():
        said.append(f"warning: MLflow run {run_id} was not marked FAILED after rank 0's death (its store, "
                    f"{mlflow_uri(cfg)}, did not answer within {END_WAIT_S:g} s)")
    for line in said:
        say(line)


@contextlib.contextmanager
def closed_failed_on_crash(trainer):
    """A training run that ends in an exception (a crash, a divergence; a stop closes them itself) closes rank 0's
    trackers marked failed: MLflow's run FAILED, W&B's exit code 1, each file flushed. Left open, MLflow's run stayed
    RUNNING and W&B's atexit handler (when it ran at all) closed its run as a success."""
    try:
        yield
    except BaseException:
        if trainer.trackers is not None:
            trainer.trackers.close(failed=True)
        raise


class CSV:
    """`path` (output_dir/metrics.csv): a `step,tag,value` row per value. Resumed at `step`, it keeps the rows up
    to that step (what the checkpoint saw); the rows after it are written again by the resumed run."""
    FIELDS = ("step", "tag", "value")

    def __init__(self, path: str, step: int):
        self.path, self.last_step = path, step
        resumed = bool(step) and os.path.lexists(path)

        def write(f):
            writer = csv.DictWriter(f, self.FIELDS)
            writer.writeheader()
            if resumed:  # row by row: a long run's rows, ten times the file as dicts, are never in memory at once
                writer.writerows(self.rows_up_to(path, step))
        write_beside(path, write)  # a full disk or a kill halfway leaves the old rows, not a cut file
        with disk_errors.name_unnamed_errors(path):
            self.file = open(path, "a", newline="")
            self.writer = csv.DictWriter(self.file, self.FIELDS)

    @staticmethod
    def rows_up_to(path: str, step: int) -> Iterator[dict]:
        """The rows of metrics.csv up to `step`, its summary left out, one at a time; a file that is not ours (a
        symlink: read from outside output_dir; a FIFO: open() blocks) or that is unreadable is one line naming it."""
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise UserError(f"{shown_name(path)}: not a regular file (a symlink, FIFO or device), which a resumed run "
                            "does not read: move it away (the resumed run starts a new one)")
        try:
            with open(path, newline="") as f:
                yield from (r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= step
                            and not r.get("tag", "").startswith("summary/"))
        except (UnicodeDecodeError, csv.Error) as e:  # not text, or a field over csv's limit
            raise UserError(f"{shown_name(path)}: unreadable ({first_line(e, limit=120)}): move it away (the resumed "
                            "run starts a new one)") from None

    def config(self, values: dict) -> None:
        pass  # config.yml, beside it, holds the config

    def scalars(self, step: int, values: dict) -> None:
        self.last_step = step
        with disk_errors.name_unnamed_errors(self.path):
            self.writer.writerows({"step": step, "tag": k, "value": repr(float(v))} for k, v in values.items())
            self.file.flush()  # a reader (the notebook) sees each line as it is logged

    def summary(self, values: dict) -> None:
        self.scalars(self.last_step, {f"summary/{k}": v for k, v in values.items()})

    def close(self, failed: bool = False, stopped: bool = False) -> None:
        with disk_errors.name_unnamed_errors(self.path):
            self.file.close()


class WandB:
    """A Weights & Biases run (WANDB_MODE=offline: files only, under WANDB_DIR, else output_dir/wandb).
    `run_id`: the run to continue (resume="allow"), or None for a new one."""

    def __init__(self, cfg, run_id: Optional[str]):
        wandb = process_end.import_with_own_temp_folder("wandb")  # optional; check_config made sure it is there
        self.step = 0
        try:
            where = os.environ.get("WANDB_DIR") or cfg.output_dir
            # W&B's service, started here, writes its own logs in WANDB_CACHE_DIR/wandb/logs (else ~/.cache/wandb/logs)
            with environ_default("WANDB_CACHE_DIR", where):
                if os.environ.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun"):
                    wandb.login(prompt=False)  # no API key: an error, never a question on stdin
                self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or cfg.task, name=run_name(cfg),
                                      dir=where, id=run_id, resume="allow" if run_id else None)
        except wandb.errors.Error as e:
            line = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise UserError(f"log.report_to: wandb could not start a run: {line} (run `wandb login`, or set "
                            "WANDB_MODE=offline)") from None
        self.run_id = self.run.id
        self.wandb = wandb

    def config(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)  # a resumed run may change some

    def scalars(self, step: int, values: dict) -> None:
        self.step = step
        self.run.log(values, step=step)

    def summary(self, values: dict) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in values.items()})

    def close(self, failed: bool = False, stopped: bool = False) -> None:
        if stopped:  # W&B shows a run that exited non-zero as failed, and one marked preempting first as preempted
            self.run.mark_preempting()
        self.run.finish(exit_code=1 if failed else EXIT_STOPPED if stopped else None)
        self.wandb.teardown()  # W&B's service stops here, not in its atexit handler, which end_process does not run


class MLflow:
    """An MLflow run in mlflow_uri(cfg)'s store (MlflowClient: no process-wide active run). `run_id`: the run to
    continue, or None (or one the store does not hold as active: `not_held` says it, Trackers prints it) for a new
    one. A run resumed from a checkpoint older than its last logged step logs those steps again: MLflow cannot delete
    points, so the steps it holds are not sent twice, key by key (a resume is exact: the values are the ones it
    holds, unless the resumed run changed a setting; an evaluation a stop left to the resumed run is sent at the step
    of the training line held)."""
    BATCH = 100  # MLflow's limit of params per log_batch call

    def __init__(self, cfg, run_id: Optional[str]):
        uri, self.client = mlflow_uri(cfg), mlflow_client(cfg)  # first: MLflow reads its settings as it is imported
        from mlflow.exceptions import MlflowException  # optional; check_config made sure it is there
        self.step, self.logged_up_to = 0, {}  # key: the last step it holds
        self.not_held = None  # what a run id the store does not hold as active is said as (Trackers)
        if run_id:
            try:
                self.client.update_run(run_id, status="RUNNING")
                # Each key's latest point is the one of its largest step: its history (10^5 points: 5 s, 55 MB) unread
                self.logged_up_to = {m.key: m.step for m in self.client.get_run(run_id).data.to_proto().metrics}
            except MlflowException as e:  # another store than the one it was made in, or a deleted run
                self.not_held, run_id = f"MLflow run {run_id} is not an active run of {uri} " \
                                        f"({first_line(e, limit=100)})", None
        if not run_id:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.task
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                name, artifact_location=os.path.abspath(os.path.join(cfg.output_dir, "mlflow-artifacts")))
            run_id = self.client.create_run(experiment_id, run_name=run_name(cfg)).info.run_id
            self.not_held = self.not_held and f"{self.not_held}: a new run, {run_id}, goes on from here"
        self.run_id = run_id

    def config(self, values: dict) -> None:
        from mlflow.entities import Param

        # MLflow refuses to change a logged param: a resumed run logs only the keys its run does not hold yet.
        held = self.client.get_run(self.run_id).data.params
        params = [Param(k, str(v)[:6000]) for k, v in flat(values).items() if k not in held]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self.BATCH])

    def scalars(self, step: int, values: dict) -> None:
        self.step = step
        new = {k: v for k, v in values.items() if step > self.logged_up_to.get(k, 0)}
        if new:
            self.log(step, new)

    def summary(self, values: dict) -> None:
        self.log(self.step, {f"summary/{k}": v for k, v in values.items()})

    def log(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def close(self, failed: bool = False, stopped: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "KILLED" if stopped else "FINISHED")


def mlflow_client(cfg):
    """An MlflowClient of mlflow_uri(cfg)'s store (a server that does not answer: ConnectionError, not 4 minutes)."""
    # MLflow's telemetry, started as it is imported, writes ~/.config/mlflow/telemetry.json: off unless asked for
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # and its INFO lines on stderr ("Creating initial MLflow database tables...") beside the run's own: warnings up
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    from mlflow import MlflowClient  # optional; check_config made sure it is there
    uri = mlflow_uri(cfg)
    if uri.startswith(("http://", "https://")):
        server_answers(uri)
    return MlflowClient(uri)


@contextlib.contextmanager
def environ_default(name: str, value: str):
    """os.environ[name] = value meanwhile, unless it is set."""
    if os.environ.get(name):
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def server_answers(uri: str) -> None:
    """Raise ConnectionError if no server answers at `uri` (a typo, a server not started): MLflow's client retries
    that for about 4 minutes, saying nothing. Any answer will do, an error status or a TLS refusal too."""
    import requests  # MLflow's HTTP client, installed with it (and its proxy settings)
    try:
        requests.head(uri, timeout=(10, 120), allow_redirects=False).close()
    except requests.exceptions.SSLError:
        pass  # a server answered; MLflow's own TLS settings decide
    except requests.ConnectionError as e:  # (its message: urllib3's retry report; the socket's reason is inside)
        reason = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(e))
        raise ConnectionError(f"no server answers at {uri} ({reason.group(1) if reason else type(e).__name__})") \
            from None
