"""The tutorial runs as written: every ```bash block of docs/tutorial/NN_*.md, in order, in one bash per chapter,
with runs/tutorial/ and data/ redirected to tmp_path; then what the chapter claims is checked on what the commands
wrote and printed, and the chapter must leave docs/ and notebooks/ as they were (its figures go under
runs/tutorial/img/; docs/tutorial/img/ is regenerated only when asked). And notebooks/inspect_run.ipynb executes
(nbclient) on a real run and prints the run's own numbers.

A chapter starts 4 to 10 Python processes (each imports torch) and takes 10-30 s: the chapters and the notebook
are marked slow (the whole suite runs them; the quick loop checks the index and the task file only)."""
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, free_port

TUTORIAL = os.path.join(ROOT, "docs", "tutorial")
CHAPTERS = sorted(name for name in os.listdir(TUTORIAL) if re.match(r"\d\d_\w+\.md$", name))
# Paths in the commands that point at what a run writes; rewritten to the test's folder (only where a relative path
# starts, so docs/tutorial/plots.py stays the repository's). docs/tutorial/img is not among them: a chapter that
# wrote there would dirty the tree, which tree_state catches.
REDIRECTED = re.compile(r"(?<![\w/.-])(runs/tutorial|data)(?=[/\s]|$)")


def script(chapter: str, base) -> str:
    """The chapter's ```bash blocks, joined, with the outputs redirected under `base`, and free ports: every
    `python main.py` gets one (the default 29500 may be taken by another run on this machine), and a port the
    chapter names (for the ranks of several commands to meet) becomes a free one."""
    with open(os.path.join(TUTORIAL, chapter)) as f:
        text = "\n".join(re.findall(r"^```bash\n(.*?)^```", f.read(), re.S | re.M))
    text = re.sub(r"python main\.py", lambda _: f"python main.py --set dist.master_port={free_port()}", text)
    text = re.sub(r"dist\.master_port=\d+(?=[\s\"])", lambda _: f"dist.master_port={free_port()}", text)
    return REDIRECTED.sub(lambda m: f"{base}/{m.group(1)}", text)


def tree_state():
    """`git status` of docs/ and notebooks/ (untracked files included), with the content hash of each file listed:
    compared before and after a chapter, so edits elsewhere in the checkout (or made before) do not matter. None
    outside a git checkout."""
    result = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=all", "--",
                             "docs", "notebooks"], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        return None
    state = {}
    for line in result.stdout.splitlines():
        path = os.path.join(ROOT, line[3:])
        state[line] = hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.isfile(path) else None
    return state


def run_chapter(number: str, base, omp_wait_policy="PASSIVE") -> str:
    """Run the chapter's commands; `omp_wait_policy=None` runs them as from a shell that does not set it (a
    reader's), where the test process otherwise passes PASSIVE on."""
    [chapter] = [c for c in CHAPTERS if c.startswith(number + "_")]
    env = {**os.environ, "MPLBACKEND": "Agg", "OMP_WAIT_POLICY": omp_wait_policy, "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if v is not None and k != "TUTORIAL_IMG_DIR"}  # figures where a reader's go
    before = tree_state()
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script(chapter, base)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{chapter} failed (exit {result.returncode}):\n{output[-4000:]}"
    assert tree_state() == before, f"{chapter} changed files of docs/ or notebooks/ (git status):\n{tree_state()}"
    return output


def quoted_line(number: str, start: str) -> str:
    """The one line of chapter `number` that starts with `start`: a line the chapter quotes from a run's output."""
    [chapter] = [c for c in CHAPTERS if c.startswith(number + "_")]
    with open(os.path.join(TUTORIAL, chapter)) as f:
        [line] = [line for line in f.read().splitlines() if line.startswith(start)]
    return line


def quoted_output(number: str, first: str) -> list[str]:
    """The lines of chapter `number`'s ```console block that starts with `first`, up to its `...` if any: output
    the chapter shows as a run prints it."""
    [chapter] = [c for c in CHAPTERS if c.startswith(number + "_")]
    with open(os.path.join(TUTORIAL, chapter)) as f:
        [block] = [b for b in re.findall(r"^```console\n(.*?)^```", f.read(), re.S | re.M) if b.startswith(first)]
    return block.split("\n...")[0].splitlines()


def as_printed(line: str) -> str:
    """A line of a run's output without what differs between machines and runs: the timings, the core count, and the
    values a CPU's own float kernels (AVX2, AVX-512) may round otherwise in their last digits."""
    line = re.sub(r"\b(samples_per_s|ms_per_step|loss|grad_norm|accuracy|f1|mcc)=\S+", r"\1=*", line)
    return re.sub(r"^(  CPU threads per rank )\d+ \(\d+ cores", r"\1N (N cores", line)


def last_checkpoint_metrics(run) -> dict:
    sys.path.insert(0, ROOT)
    from core import checkpoint
    from core import checkpoint_meta
    return checkpoint_meta.read(checkpoint.complete_checkpoints(str(run))[-1][1])["metrics"]


def test_every_chapter_has_commands_and_the_index_links_it():
    with open(os.path.join(TUTORIAL, "README.md")) as f:
        index = f.read()
    assert len(CHAPTERS) == 9
    for chapter in CHAPTERS:
        assert f"({chapter})" in index, f"docs/tutorial/README.md does not link {chapter}"
        assert "```bash" in open(os.path.join(TUTORIAL, chapter)).read(), f"{chapter} runs nothing"
        for image in re.findall(r"\(img/([\w.]+\.png)\)", open(os.path.join(TUTORIAL, chapter)).read()):
            assert os.path.isfile(os.path.join(TUTORIAL, "img", image)), f"{chapter}: img/{image} is missing"


def test_the_chapters_make_their_figures_outside_the_tree_and_img_dir_regenerates_them(tmp_path):
    """Each figure a chapter shows (img/NAME.png) is made by one of its commands under runs/tutorial/img/ (git-ignored),
    so that TUTORIAL_IMG_DIR=docs/tutorial/img (or --img-dir) regenerates exactly the figures shown."""
    for chapter in CHAPTERS:
        with open(os.path.join(TUTORIAL, chapter)) as f:
            text = f.read()
        commands = "\n".join(re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M))
        shown = set(re.findall(r"\(img/([\w.]+\.png)\)", text))
        made = set(re.findall(r"plots\.py \w+ runs/tutorial/img/([\w.]+\.png)", commands))
        assert shown == made, f"{chapter}: shows {sorted(shown)}, its commands make {sorted(made)}"
        assert not re.search(r"(?<![\w/.-])(docs/(?!tutorial/plots\.py)|notebooks/)", commands), chapter
    bench = {"model": "tiny", "parameters": 10, "rows": [
        {"label": "none", "procs": 1, "formula": 16.0, "per_rank": [{"params": 40, "grads": 40, "optimizer": 80}]}]}
    with open(tmp_path / "memory.json", "w") as f:
        json.dump(bench, f)
    env = {k: v for k, v in os.environ.items() if k != "TUTORIAL_IMG_DIR"}
    env["MPLBACKEND"] = "Agg"
    plot = [sys.executable, os.path.join(TUTORIAL, "plots.py"), "memory", "runs/tutorial/img/03_memory.png",
            str(tmp_path / "memory.json")]
    subprocess.run(plot, cwd=tmp_path, env=env, check=True, capture_output=True)
    assert (tmp_path / "runs/tutorial/img/03_memory.png").stat().st_size > 0  # by default: OUT as given
    subprocess.run(plot + ["--img-dir", str(tmp_path / "flag")], cwd=tmp_path, env=env, check=True,
                   capture_output=True)
    subprocess.run(plot, cwd=tmp_path, env={**env, "TUTORIAL_IMG_DIR": str(tmp_path / "variable")}, check=True,
                   capture_output=True)
    for folder in ("flag", "variable"):  # OUT's file name, in the folder asked for
        assert (tmp_path / folder / "03_memory.png").stat().st_size > 0


@pytest.mark.slow
def test_01_one_process(tmp_path):
    out = run_chapter("01", tmp_path, omp_wait_policy=None)
    # the output the chapter shows is the run's, line for line from the plan on (the clone's path aside)
    shown = [as_printed(line.replace("/path/to/your/clone/", "")) for line in quoted_output("01", "plan:")]
    printed = [as_printed(line) for line in out.replace(f"{tmp_path}/", "").splitlines()]
    start = printed.index("plan:")
    assert printed[start:start + len(shown)] == shown
    assert (tmp_path / "runs/tutorial/img/01_curves.png").stat().st_size > 0
    # the plan's CPU line as quoted (its core count is the machine's; OMP_WAIT_POLICY is what one process gets)
    quoted = quoted_line("01", "  CPU threads per rank ").rsplit(", OMP_WAIT_POLICY ", 1)[1]
    assert re.search(r"^  CPU threads per rank .*, OMP_WAIT_POLICY (.*)$", out, re.M).group(1) == quoted
    # plots.py printed the last dev accuracy from the event files: the one of the final checkpoint
    printed = float(re.search(r"01-one: .*dev/accuracy=(\S+)", out).group(1))
    assert printed == pytest.approx(last_checkpoint_metrics(tmp_path / "runs/tutorial/01-one")["accuracy"], abs=1e-4)
    assert printed > 0.8


@pytest.mark.slow
def test_02_ddp_equals_one_process(tmp_path):
    out = run_chapter("02", tmp_path)
    assert float(re.search(r"each rank's mean: +off by (\S+)", out).group(1)) > 0.1
    assert float(re.search(r"global count \(ours\): +off by (\S+)", out).group(1)) < 1e-5
    diffs = re.findall(r"02-one vs (02-ddp-\S+): largest parameter difference (\S+)", out)
    assert [name for name, _ in diffs] == ["02-ddp-16-16", "02-ddp-24-8"]
    assert all(float(d) < 1e-5 for _, d in diffs), diffs
    assert (tmp_path / "runs/tutorial/img/02_curves.png").stat().st_size > 0


@pytest.mark.slow
def test_03_memory_matches_the_formulas(tmp_path):
    out = run_chapter("03", tmp_path)
    for line in quoted_output("03", "none "):  # the chapter's table of bytes per rank, as plots.py printed it
        assert line in out.splitlines(), line
    with open(tmp_path / "runs/tutorial/03-memory.json") as f:
        bench = json.load(f)
    n = bench["parameters"]
    for row in bench["rows"]:
        per_param = [sum(rank.values()) / n for rank in row["per_rank"]]
        if row["label"].startswith(("none", "ddp", "fsdp")):  # whole tensors split evenly: exactly the formula
            assert per_param == pytest.approx([row["formula"]] * row["procs"], abs=0.02), row["label"]
        else:  # oss splits whole tensors between ranks: on average the formula
            assert sum(per_param) / len(per_param) == pytest.approx(row["formula"], abs=0.02), row["label"]
    assert (tmp_path / "runs/tutorial/img/03_memory.png").stat().st_size > 0


@pytest.mark.slow
def test_04_mixed_precision(tmp_path):
    out = run_chapter("04", tmp_path)
    accuracy = {p: float(re.search(rf"04-{p}: .*dev/accuracy=(\S+)", out).group(1)) for p in ("fp32", "bf16", "fp16")}
    assert accuracy["fp32"] > 0.7
    assert abs(accuracy["bf16"] - accuracy["fp32"]) < 0.1 and abs(accuracy["fp16"] - accuracy["fp32"]) < 0.1
    for name in ("04_curves.png", "04_throughput.png"):
        assert (tmp_path / "runs/tutorial/img" / name).stat().st_size > 0


@pytest.mark.slow
def test_05_two_nodes_and_balancing(tmp_path):
    out = run_chapter("05", tmp_path)
    runs = tmp_path / "runs/tutorial"
    assert "world size 2, ranks per node [1, 1]" in out
    assert (runs / "05-two-nodes/logs/rank1.log").is_file()
    with open(runs / "05-auto/logs/rank0.log") as f:
        fast, slow = map(int, re.search(r"batch per rank \[(\d+), (\d+)\]", f.read()).groups())
    assert fast + slow == 256 and fast > slow  # rank 1 is twice as slow: it gets less
    assert re.search(r"05-auto: \d+ samples/s", out)
    assert (tmp_path / "runs/tutorial/img/05_throughput.png").stat().st_size > 0


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Chapter 6, run once: a run that resumed and was tested (the notebook test reads it too)."""
    base = tmp_path_factory.mktemp("tutorial06")
    return base, run_chapter("06", base)


@pytest.mark.slow
def test_06_resume_is_exact_and_test_mode(resumed_run):
    base, out = resumed_run
    run = base / "runs/tutorial/06-resume"
    assert float(re.search(r"06-resume: largest parameter difference (\S+)", out).group(1)) == 0.0
    with open(run / "logs/rank0.log") as f:
        assert re.search(r"resumed from \S+step-40 at step 40", f.read())
    with open(run / "test_results.json") as f:
        assert json.load(f)["metrics"]["accuracy"] > 0.5
    kept = sorted(os.listdir(base / "runs/tutorial/06-best/checkpoints"))
    assert "step-60" in kept and 3 <= len(kept) <= 4, kept  # keep_best: the 3 best and the last
    assert "dev run passed" in out
    assert (base / "runs/tutorial/06-lr/lr_find.png").stat().st_size > 0 and "lr_find: suggested lr" in out
    assert sorted(os.listdir(base / "runs/tutorial/06-onnx")) == ["README.md", "labels.json", "model.onnx"]


@pytest.mark.slow
def test_07_own_task(tmp_path):
    out = run_chapter("07", tmp_path)
    # the plan's task line, as the chapter quotes it (the test runs it with data/ under tmp_path)
    assert quoted_line("07", "  task ") in out.replace(f"{tmp_path}/", "").splitlines()
    run = tmp_path / "runs/tutorial/07-reviews"
    with open(run / "test_results.json") as f:
        assert json.load(f)["metrics"]["accuracy"] > 0.9
    with open(run / "config.yml") as f:
        assert "csv_text" in f.read()
    assert (tmp_path / "runs/tutorial/img/07_curves.png").stat().st_size > 0


@pytest.mark.slow
def test_08_pipeline_equals_one_process_and_carries_on_under_fsdp(tmp_path):
    out = run_chapter("08", tmp_path)
    assert "layers per stage [2, 2] (even split), parameters per stage [0.0188M, 0.0342M]" in out
    assert re.search(r"resumed from \S+/runs/tutorial/08-switch/checkpoints/step-40 at step 40", out)
    diffs = re.findall(r"08-one vs (08-\S+): largest parameter difference (\S+)", out)
    assert [name for name, _ in diffs] == ["08-pipe", "08-switch"]
    assert all(float(d) < 1e-5 for _, d in diffs), diffs
    with open(tmp_path / "runs/tutorial/08-switch/checkpoints/step-60/meta.json") as f:
        assert json.load(f)["format"] == "sharded-dcp"  # the last steps ran under fsdp
    assert (tmp_path / "runs/tutorial/img/08_curves.png").stat().st_size > 0


def logged_losses(run) -> list[str]:
    """The training losses rank 0 logged, as printed (`step 3/6 loss=10.72 ...`)."""
    with open(run / "logs" / "rank0.log") as f:
        return re.findall(r"\bstep \d+/\d+ [^\n]*?\bloss=(\S+)", f.read())


@pytest.mark.slow
def test_09_tensor_parallel_counts_memory_and_fsdp_x_tp_equals_one_process(tmp_path):
    out = run_chapter("09", tmp_path)
    lines = out.splitlines()
    runs = tmp_path / "runs/tutorial"
    # the lines the chapter quotes, as printed: the collectives counted, the mesh, the memory, the compare
    for start in ("BERT hidden 128, ", "tp 1 (ddp 4): ", "ddp 2 x tp 2: ", "tp 4: ", "fsdp 2 x tp 2: ", "fsdp 4: ",
                  "  mesh dp_replicate 1 x dp_shard 2 x tp 2 ", "  batch per tp group ", "the formula for BERT-base"):
        assert quoted_line("09", start) in lines, start
    for label in ("tp 1 (ddp 4)", "ddp 2 x tp 2", "tp 4", "fsdp 2 x tp 2", "fsdp 4"):
        quoted = quoted_line("09", f"{label:34s} x4: ")
        assert quoted.split("; ", 1)[1] in out, label  # bytes/param per rank and formula (MiB: the model's size)
    # the counts and bytes themselves: 2 all-reduces per block forward, 4 backward; each rank holds the formula
    with open(runs / "09-tp.json") as f:
        bench = json.load(f)
    rows, blocks = {row["label"]: row for row in bench["rows"]}, 4
    for label in ("ddp 2 x tp 2", "tp 4", "fsdp 2 x tp 2"):
        assert rows[label]["forward"]["all-reduce"] == 2 * blocks
        assert rows[label]["step"]["all-reduce"] == 6 * blocks + (label == "ddp 2 x tp 2")  # + one over dp
    assert "all-reduce" not in rows["fsdp 4"]["step"]
    for row in bench["rows"]:
        per_param = [sum(rank.values()) / bench["parameters"] for rank in row["per_rank"]]
        assert per_param == pytest.approx([row["formula"]] * 4, abs=0.02), row["label"]
    # 2 x 2 fsdp x tp ends where one process does: parameters and logged losses
    diff = float(re.search(r"09-one vs 09-tp: largest parameter difference (\S+)", out).group(1))
    assert diff < 1e-5
    assert logged_losses(runs / "09-one") == logged_losses(runs / "09-tp") and len(logged_losses(runs / "09-tp")) == 6
    with open(runs / "09-tp/checkpoints/step-6/meta.json") as f:
        assert json.load(f)["format"] == "sharded-dcp"
    assert (tmp_path / "runs/tutorial/img/09_memory.png").stat().st_size > 0


def test_the_task_file_is_under_60_lines_with_its_edit_places():
    with open(os.path.join(ROOT, "tasks", "csv_text.py")) as f:
        source = f.read()
    assert source.count("\n") < 60
    assert source.count("# ----->") >= 4


def kernel(tmp_path) -> str:
    """A kernelspec for this interpreter in tmp_path (found through JUPYTER_PATH), so the notebook runs with the
    Python that runs the tests, whatever kernels (if any) the machine has installed."""
    from ipykernel.kernelspec import install
    install(kernel_name="tutorial-test", prefix=str(tmp_path / "jupyter"))
    return str(tmp_path / "jupyter" / "share" / "jupyter")


@pytest.mark.slow
def test_inspect_run_notebook(resumed_run, tmp_path, monkeypatch):
    import nbformat
    base, _ = resumed_run
    run = base / "runs/tutorial/06-resume"
    monkeypatch.setenv("JUPYTER_PATH", kernel(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "inspect_run.ipynb"), as_version=4)
    nbformat.validate(nb)  # cell ids included: nbconvert warns without them
    [first] = [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])]
    assert first is next(cell for cell in nb.cells if cell.cell_type == "code")  # parameters come first
    printed = execute_notebook(run, tmp_path)
    for split in ("dev", "test"):  # the results files, as printed
        with open(run / f"{split}_results.json") as f:
            accuracy = json.load(f)["metrics"]["accuracy"]
        assert float(re.search(rf"{split} results: .*accuracy=(\S+)", printed).group(1)) == pytest.approx(accuracy,
                                                                                                        abs=1e-4)
    # the last training loss of the event files (the resumed run rewrote steps 41-60: the last write wins)
    sys.path.insert(0, TUTORIAL)
    import plots
    loss = plots.scalars(str(run))["train/loss"][1][-1]
    assert float(re.search(r"train/loss: last (\S+)", printed).group(1)) == pytest.approx(loss, rel=1e-3)
    for name in ("curves.png", "dev.png"):
        assert (tmp_path / "figures" / name).stat().st_size > 0


def execute_notebook(run, tmp_path) -> str:
    """notebooks/inspect_run.ipynb run on `run` (every cell, as Jupyter's "Run all" does); what its cells printed."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "inspect_run.ipynb"), as_version=4)
    [first] = [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])]
    first.source = f"run = {str(run)!r}\nfigures = {str(tmp_path / 'figures')!r}"
    NotebookClient(nb, kernel_name="tutorial-test", timeout=120,
                   resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
    return "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)


@pytest.mark.slow
def test_inspect_run_notebook_on_a_run_with_csv_and_no_tensorboard(tmp_path, monkeypatch):
    """log.report_to: [csv] (the tiny presets write no TensorBoard files either): the notebook still runs to its
    last cell, which reads metrics.csv, instead of stopping at the TensorBoard plots."""
    run = tmp_path / "run"
    subprocess.run([sys.executable, "main.py", "--set", f"output_dir={run}", "--set", "train.max_steps=4",
                    "--set", "train.warmup=1", "--set", "train.log_every=2", "--set", "log.report_to=[csv]",
                    "--set", "log.progress_bar=false", "--set", f"dist.master_port={free_port()}"],
                   cwd=ROOT, check=True, capture_output=True)
    monkeypatch.setenv("JUPYTER_PATH", kernel(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    printed = execute_notebook(run, tmp_path)
    assert "TensorBoard scalars: none" in printed
    assert re.search(r"csv train/loss: last \S+ at step 4 \(2 rows\)", printed), printed


@pytest.mark.slow  # two processes, one of them imports torch: 7 s
def test_plots_py_says_a_mistake_in_one_line_with_exit_code_2(tmp_path):
    """docs/tutorial/plots.py given a run without TensorBoard files, or a folder without checkpoints, exited 1 (raise
    SystemExit(text)), where main.py and the scripts say a user's mistake with exit code 2."""
    plots = os.path.join(TUTORIAL, "plots.py")
    for args, words in ((["curves", str(tmp_path / "out.png"), str(tmp_path)], "no TensorBoard events"),
                        (["compare", str(tmp_path), str(tmp_path)], "neither a checkpoint nor a run with one")):
        done = subprocess.run([sys.executable, plots, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.startswith(f"error: {tmp_path}") and words in done.stderr, done
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.png").exists(), done
