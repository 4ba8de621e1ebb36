"""Every benchmark still runs: each script of benchmarks/ at its tiny size (`--tiny`: seconds, figures meaningless)
exits 0 and prints its result line, so a rename in the product cannot break one silently. Not run here:
gpu_session.sh and gpu_sharded.sh (they need a GPU) and bench_elastic.py, which times tests/test_elastic_launch.py's
lost-node scenario (root and network namespaces; the suite runs that scenario itself): the line it reads is checked."""
import glob
import os
import re
import subprocess
import sys

import pytest

from cluster import clean_env
from conftest import ROOT

# The line each prints last (or its table row): what a reader of the benchmark looks for.
RESULT_LINE = {
    "bench_async_save.py": r"stall ratio sync / async: [\d.]+x",
    "bench_bert_mfu.py": r"\nhf +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+%",
    "bench_bf16_tasks.py": r"\| cnn digits, batch 32 \| \d+ \| \d+ \| [\d.]+x \| loss=",
    "bench_checkpoint_hash.py": r"save with / without the record: [\d.]+x",
    "bench_compile.py": r"speed compiled/eager [\d.]+x",
    "bench_data_scale.py": r"\| shards \| 0 MB \| [\d,]+ \| [\d.]+ s",
    "bench_images.py": r"ours / hand-written: [\d.]+; HF's Trainer / hand-written: [\d.]+; ours / HF's: [\d.]+\n"
                       r"[\s\S]*loader, num_workers=auto \(\d+\): [\d.]+ images/s",
    "bench_hetero.py": r"gain of auto [\d.]+x \(ideal split: [\d.]+x\)",
    "bench_lora.py": r"\| LoRA r=8 \(query, value\) \+ head \| .* \| [\d.]+ \|",
    "bench_mesh.py": r"\ntp 2 +[\d, ]+ +\d+ +[\d.]+ +[\d.]+x",
    "bench_nanogpt.py": r"\| nanoGPT \| [\d.]+ \| [\d.]+ \| [\d.]+ \|",
    "bench_omp_wait.py": r"median samples/s: before [\d.]+, after [\d.]+ \(x[\d.]+\)",
    "bench_own_dropout.py": r"median step: own masks [\d.]+ ms, shared [\d.]+ ms, ratio [\d.]+",
    "bench_pipeline.py": r"\| zero_bubble \| 2 \| 4 \| [\d.]+ / [\d.]+ \|",
    "bench_sharded_memory.py": r"\| fsdp \(FSDP2, ZeRO-3\) \| 2 \|",
    "bench_sp_memory.py": r"tp 2 \+ both +[\d.]+ MiB +\([\d.]+ of one process\)",
    "bench_text_tokens.py": r"\ngpt2_lm +[\d,]+ +[\d,]+ +[\d,]+ +[\d,]+ +[\d.]+ +[\d.]+",
    "bench_trainer_overhead.py": r"ratio trainer/hand: [\d.]+",
    "bench_vs_hf.py": r"ratio ours/HF \([\w ]+\): [\d.]+ in samples/s",
    "ab.py": r"ratio B/A: median [\d.]+, min-max [\d.]+-[\d.]+, bootstrap 95% interval [\d.]+-[\d.]+",
    "fault_drill.py": r"bad inputs: 2/2 kinds end with exit 2 and one `error:` line",
}
NOT_RUN = {"bench_elastic.py"}
ARGS = {"ab.py": ["HEAD", "."]}  # this commit against this tree: the two sides of an A/B as a user runs it
TIMEOUT_S = 240


def test_every_benchmark_is_listed():
    scripts = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))}
    assert scripts == set(RESULT_LINE) | NOT_RUN, "benchmarks/ and RESULT_LINE disagree: add the new script here"


def test_ab_reads_rates_the_log_writes_in_scientific_notation():
    """The training line writes 4 significant digits: 15020 samples/s is `1.502e+04`, which ab.py once read as 1.5."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import ab
    assert ab.logged_rates("step 20/300 loss=0.3 samples_per_s=1.502e+04 grad_norm=1\n"
                           "step 40/300 loss=0.2 samples_per_s=955.9 grad_norm=1") == [15020.0, 955.9]


def test_bench_elastic_still_finds_its_line():
    with open(os.path.join(ROOT, "tests", "test_elastic_launch.py")) as f:
        assert 'print("recovery after node 1 was lost (s from the kill):", ' in f.read()  # what it parses


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(RESULT_LINE))
def test_benchmark_runs_at_its_tiny_size(script, tmp_path):
    if script == "ab.py" and not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("ab.py compares commits: this tree is not a git checkout")
    r = subprocess.run([sys.executable, os.path.join("benchmarks", script), *ARGS.get(script, []), "--tiny"], cwd=ROOT,
                       env=clean_env(TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=TIMEOUT_S)
    out = r.stdout + r.stderr
    skipped = re.search(r"^skipped: .*", r.stdout, re.M)
    if r.returncode == 0 and skipped:
        pytest.skip(f"{script}: {skipped.group(0)}")
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{out[-3000:]}"
    assert re.search(RESULT_LINE[script], r.stdout), f"{script} did not print its result line:\n{r.stdout[-3000:]}"


@pytest.mark.slow
def test_gpu_sharded_without_a_gpu_is_one_line_and_its_pieces_load(tmp_path):
    """benchmarks/gpu_sharded.sh (docs/sharded.md) needs CUDA: on a machine without it, one line and exit 2 at once,
    nothing run. What it runs there must still load here: its params file (read by the schema) and the imports of
    its resume check (a module renamed since it was written once made that a traceback after all the runs)."""
    path = os.path.join(ROOT, "benchmarks", "gpu_sharded.sh")
    with open(path) as f:
        script = f.read()
    params = re.search(r"--params (\S+)", script).group(1)
    from core.config import read_config
    read_config(os.path.join(ROOT, params))
    check = re.search(r"<<'PY'\n(.*?)^PY$", script, re.S | re.M).group(1)
    imports = "\n".join(line for line in check.splitlines() if line.startswith(("import ", "from ")))
    subprocess.run([sys.executable, "-c", imports], cwd=ROOT, check=True, capture_output=True)
    import torch
    if torch.cuda.is_available():
        return
    r = subprocess.run(["bash", path], cwd=ROOT, env=clean_env(OUT=str(tmp_path / "out")), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and (r.stdout + r.stderr).strip().count("\n") == 0, r.stdout + r.stderr
    assert (r.stdout + r.stderr).startswith("error: ") and "GPU" in r.stdout + r.stderr
    assert not (tmp_path / "out").exists()
