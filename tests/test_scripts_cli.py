"""The helper scripts as a user runs them: --help and a wrong command line write nothing and say one line."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_bert_shards  # noqa: E402
import make_sample_text_data as sample  # noqa: E402
import prepare_text  # noqa: E402


def test_make_sample_text_data_help_and_extra_arguments_write_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # once wrote the data into a folder named --help
        sample.main(["--help"])
    assert e.value.code == 0 and "data/sample" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a second folder was ignored without a word
        sample.main(["one", "two"])
    assert e.value.code == 2 and "unrecognized arguments: two" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    assert sample.main(["out"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["bert_text.txt", "gpt2", "sst2"]


def test_make_bert_shards_says_a_wrong_input_or_option_in_one_line(tmp_path, capsys):
    """Each was a traceback: a missing or non-UTF-8 file, a folder that is no tokenizer,
    --shards 0 or below, a --seq-length too short for [CLS] A [SEP] B [SEP]."""
    text = sample.write_bert_text(str(tmp_path / "text.txt"), __import__("random").Random(0), documents=12)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    folder = os.path.join(ROOT, "tasks")  # not a tokenizer folder at all
    cases = [(["--input", str(tmp_path / "nope.txt")], "nope.txt: no such file"),
             (["--input", str(tmp_path / "latin1.txt")], "latin1.txt, line 1: not UTF-8 text (byte 3 of the line)"),
             (["--input", text, "--tokenizer", folder], f"--tokenizer {folder}: its tokenizer could not be loaded"),
             (["--input", text, "--shards", "0"], "--shards must be >= 1, got 0"),
             (["--input", text, "--dev-shards", "-1"], "--dev-shards must be >= 0, got -1"),
             (["--input", text, "--seq-length", "4"], "--seq-length must be >= 5"),
             (["--input", text, "--dev-fraction", "1"], "--dev-fraction must be in [0, 1)")]
    for args, message in cases:
        try:
            code = make_bert_shards.main([*args, "--output-dir", str(tmp_path / "out")])
        except SystemExit as e:  # argparse's refusals
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "out").exists()


def test_make_bert_shards_refuses_to_leave_stale_shards_beside_new_ones(tmp_path, capsys):
    """Rerun with fewer shards into the same folder, the earlier run's extra shards stayed and were read as
    training data with the new ones (each sequence twice) without a word."""
    text = sample.write_bert_text(str(tmp_path / "text.txt"), __import__("random").Random(0), documents=30)
    out = tmp_path / "bert"
    args = ["--input", text, "--output-dir", str(out), "--seq-length", "32", "--max-predictions", "5"]
    assert make_bert_shards.main([*args, "--shards", "3"]) == 0
    assert make_bert_shards.main([*args, "--shards", "3", "--seed", "1"]) == 0  # the same files: replaced
    capsys.readouterr()
    assert make_bert_shards.main([*args, "--shards", "2"]) == 2
    err = capsys.readouterr().err
    assert "shard_00002.hdf5" in err and "another --output-dir" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(out / "training")) == [f"shard_0000{i}.hdf5" for i in range(3)]
    assert make_bert_shards.main([*args, "--shards", "3", "--dev-shards", "0"]) == 2  # test/ would stay as dev
    assert "test/shard_00000.hdf5" in capsys.readouterr().err


def notebook_cells(run, figures) -> list[str]:
    """notebooks/inspect_run.ipynb's code cells, its parameters cell set to `run` (run in this process: no kernel)."""
    import nbformat
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "inspect_run.ipynb"), as_version=4)
    cells = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    return [f"run = {str(run)!r}\nfigures = {str(figures)!r}", *cells[1:]]


def run_notebook(run, figures) -> str:
    """What the notebook's cells print, every cell run in order as "Run all" does, in a fresh namespace."""
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        for source in notebook_cells(run, figures):
            exec(compile(source, "inspect_run.ipynb", "exec"), namespace)
    return printed.getvalue()


def test_inspect_run_notebook_on_a_crashed_ema_run_and_on_a_folder_that_is_no_run(tmp_path, monkeypatch):
    """A run killed before its first training log line (dev scalars written, train/ ones not yet) stopped the
    notebook at the plots (matplotlib: 'Number of columns must be a positive integer, not 0'), before metrics.csv;
    a run evaluated with train.eval_ema writes dev_ema/ scalars, which were never plotted; and a folder that holds
    no run was a FileNotFoundError on config.yml instead of a line saying so."""
    from torch.utils.tensorboard import SummaryWriter
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(ROOT)  # as Jupyter starts the notebook: inside the repository
    monkeypatch.setattr(sys, "path", list(sys.path))  # the notebook puts the repository and docs/tutorial first
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yml").write_text(yaml.safe_dump({
        "task": "gpt2_lm", "dist": {"strategy": "none"},
        "train": {"precision": "fp32", "batch_size": 16, "max_steps": 400, "epochs": 0, "lr": 0.002}}))
    with SummaryWriter(str(run / "tensorboard")) as writer:
        for step, loss in ((3, 5.5), (6, 5.25)):
            writer.add_scalar("dev_ema/loss", loss, step)
    (run / "metrics.csv").write_text("step,tag,value\n3,dev_ema/loss,5.5\n6,dev_ema/loss,5.25\n")
    printed = run_notebook(run, tmp_path / "figures")
    assert "dev_ema/loss: last 5.25 at step 6 (2 points)" in printed
    assert "training curves: none yet" in printed
    assert "csv dev_ema/loss: last 5.25 at step 6 (2 rows)" in printed  # the last cell ran
    assert os.listdir(tmp_path / "figures") == ["dev.png"]
    with pytest.raises(RuntimeError, match=f"{tmp_path}: no config.yml; not a run's output_dir"):
        run_notebook(tmp_path, tmp_path / "figures")


def test_prepare_text_overwrite_discards_a_preparation_only(tmp_path, capsys):
    """--overwrite ("discard an earlier preparation in --output") deleted any non-empty --output folder: with
    --output data/ it deleted the user's files there, the corpus being prepared among them."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text("the cat sees a dog\nthe king helps a bird\n")
    (data / "notes.md").write_text("mine\n")
    prepare = ["--task", "lm", "--workers", "1", "--no-progress", "--tokenizer-sample-mb", "1"]
    assert prepare_text.main([*prepare, "--train", str(data / "corpus.txt"), "--output", str(data), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"--train {data / 'corpus.txt'}: inside --output {data}" in err, err
    assert sorted(os.listdir(data)) == ["corpus.txt", "notes.md"]
    (tmp_path / "corpus.txt").write_text("the cat sees a dog\nthe king helps a bird\n")
    assert prepare_text.main([*prepare, "--train", str(tmp_path / "corpus.txt"), "--output", str(data),
                              "--overwrite"]) == 2
    assert f"{data}: not empty and not a preparation folder" in capsys.readouterr().err
    assert sorted(os.listdir(data)) == ["corpus.txt", "notes.md"]
    out = tmp_path / "shards"  # a preparation of other options is still discarded
    assert prepare_text.main([*prepare, "--train", str(tmp_path / "corpus.txt"), "--output", str(out)]) == 0
    assert prepare_text.main([*prepare, "--train", str(tmp_path / "corpus.txt"), "--output", str(out),
                              "--text-unit", "file", "--overwrite"]) == 0
    assert json.load(open(out / "manifest.json"))["splits"]["train"]["documents"] == 1


def test_prepare_text_goes_on_after_a_failed_preparation_once_the_command_is_mended(tmp_path, capsys):
    """A preparation that failed before finishing a chunk (labels named in the file, --labels forgotten) left its
    plan, so the mended command was refused until --overwrite. One with chunks done still needs it (they would be
    lost)."""
    corpus, out = tmp_path / "reviews.csv", tmp_path / "shards"
    corpus.write_text("text,label\nthe cat sees a dog,pos\nthe king helps a bird,neg\n")
    prepare = ["--task", "classification", "--workers", "1", "--no-progress", "--tokenizer-sample-mb", "1",
               "--train", str(corpus), "--output", str(out)]
    assert prepare_text.main(prepare) == 2
    assert f"{corpus}:2: label 'pos'" in capsys.readouterr().err
    assert prepare_text.main([*prepare, "--labels", "neg,pos"]) == 0, capsys.readouterr().err
    assert "which finished no chunk, discarded" in capsys.readouterr().out
    assert json.load(open(out / "manifest.json"))["splits"]["train"]["documents"] == 2
    assert prepare_text.main([*prepare, "--labels", "pos,neg"]) == 2
    assert "holds a preparation of other inputs or options (1 of its chunks done)" in capsys.readouterr().err


def test_generate_continues_the_prompt_of_a_tokenizer_that_wraps_texts(tmp_path, capsys, monkeypatch):
    """A tokenizer that wraps every text as <s> ... </s> (BART's specials, or a folder given as data.tokenizer) gave
    the model "<s> the cat </s>": it saw the prompt's document end and began another instead of continuing it, and
    "<s>" was printed before the text. The model sees "<s> the cat" (as its training texts began), prints "the cat"."""
    import random
    import generate
    from transformers import GPT2Config, GPT2LMHeadModel
    from tasks.text_common import train_tokenizer
    texts = [sample.sentence(random.Random(i)) for i in range(200)]
    folder, run = str(tmp_path / "export"), generate.sample
    for kind, prefix in (("bpe", [0]), ("gpt2", [])):  # BART's <s>=0 ... </s>=2; GPT-2's adds nothing
        tokenizer = train_tokenizer(texts, kind)
        tokenizer.save_pretrained(folder)
        GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=8, n_layer=1, n_head=1,
                                   eos_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
        seen = []
        monkeypatch.setattr(generate, "sample", lambda model, ids, *rest: seen.append(
            ids[0].tolist()) or run(model, ids, *rest))
        for prompt in ("the cat", ""):
            assert generate.main(["--export", folder, "--prompt", prompt, "--max-new-tokens", "2"]) == 0
            printed = capsys.readouterr().out
            assert printed.lstrip().startswith(prompt) and "<s>" not in printed, (kind, printed)
        text = tokenizer("the cat", add_special_tokens=False)["input_ids"]
        assert seen == [prefix + text, prefix or [tokenizer.eos_token_id]], kind


def test_a_shard_shorter_than_its_manifest_says_is_one_line(tmp_path, capsys):
    """A shard file holding a whole array of another length than its manifest says (another preparation's shard
    of the same name copied in: other --chunk-mb, other inputs) was read unverified: blocks that reached into it came
    out short (training died in the collate, 'stack expects each tensor to be equal size'), and a classification
    example's tokens silently fewer. (Bytes cut off a file were already refused: np.load cannot map it.)"""
    import numpy as np
    from core.errors import DataError
    from tasks import token_shards as ts
    data = sample.write_gpt2(str(tmp_path / "gpt2"), __import__("random").Random(0))
    out = tmp_path / "shards"
    assert prepare_text.main(["--task", "lm", "--train", os.path.join(data, "train.json"), "--dev-fraction", "0.1", "--output", str(out),
                              "--workers", "1", "--no-progress", "--chunk-mb", "0.01"]) == 0
    manifest = ts.read_manifest(str(out), "lm")
    shard = out / "train-00001.tokens.npy"
    np.save(shard, np.load(shard)[:-10])
    blocks = ts.TokenBlocks(str(out), manifest, "train", 32)
    with pytest.raises(DataError, match=f"{shard}: holds \\d+ values, its manifest says \\d+; prepare"):
        for k in range(len(blocks)):
            blocks[k]


def test_an_output_folder_that_is_a_file_is_one_line(tmp_path, capsys):
    """prepare_text.py --output and make_bert_shards.py --output-dir naming a file were tracebacks
    (NotADirectoryError, FileExistsError)."""
    (tmp_path / "corpus.txt").write_text("the cat sees a dog\n\nthe king helps a bird\na dog finds the king\n")
    (tmp_path / "file").write_text("mine\n")
    assert prepare_text.main(["--task", "lm", "--train", str(tmp_path / "corpus.txt"), "--output",
                              str(tmp_path / "file"), "--workers", "1"]) == 2
    assert f"--output {tmp_path / 'file'}: a file, not a folder" in capsys.readouterr().err
    assert make_bert_shards.main(["--input", str(tmp_path / "corpus.txt"), "--output-dir", str(tmp_path / "file")]) == 2
    assert f"--output-dir {tmp_path / 'file'}: a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine\n"


def test_prepare_text_says_a_folder_that_is_no_tokenizer_in_one_line(tmp_path, capsys):
    """transformers' message for a folder it cannot load a tokenizer from runs over five lines: all were printed."""
    (tmp_path / "corpus.txt").write_text("the cat sees a dog\n")
    folder = os.path.join(ROOT, "tasks")
    assert prepare_text.main(["--task", "lm", "--train", str(tmp_path / "corpus.txt"), "--output",
                              str(tmp_path / "out"), "--workers", "1", "--tokenizer", folder]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer {folder}: its tokenizer could not be loaded (")
    assert len(err.strip().splitlines()) == 1, err


def test_slurm_job_resumes_on_requeue_even_when_told_to_start_over(tmp_path):
    """`sbatch scripts/slurm_job.sh ... --set train.start_over=true` (a new run in a used output_dir) started over
    again at every requeue: each stop's checkpoint was moved aside and the run began anew, never to finish. A
    requeued start (SLURM_RESTART_COUNT > 0) resumes; the first start is as given. (srun and scontrol stubbed.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGS_FILE"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for stub in ("srun", "scontrol"):
        os.chmod(bin_dir / stub, 0o755)
    for restarts, ends_with in (("0", "train.start_over=true"), ("2", "train.start_over=false")):
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGS_FILE": str(tmp_path / "args"),
               "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node1", "SLURM_RESTART_COUNT": restarts}
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_job.sh"), "--params", "p.yml", "--set",
                        "train.start_over=true"], env=env, check=True, capture_output=True, timeout=30)
        args = (tmp_path / "args").read_text().split()
        assert args[:2] == ["python", "main.py"] and args[-1] == ends_with, (restarts, args)


def test_slurm_job_says_its_usage_and_refuses_to_run_outside_a_job(tmp_path):
    """`bash scripts/slurm_job.sh --help` (or the script run without sbatch) called srun, whose four lines of DNS
    errors ended in "main.py exited with code 1 (1 crash, ...)": a crash that was no crash. --help says the usage
    (exit 0); outside a SLURM job it is one line naming sbatch (exit 2), and srun is never called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\ntouch "$CALLED"\n')
    os.chmod(bin_dir / "srun", 0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", CALLED=str(tmp_path / "called"))
    script = os.path.join(ROOT, "scripts", "slurm_job.sh")
    for args in (["--help"], ["-h"]):
        done = subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "sbatch scripts/slurm_job.sh --params" in done.stdout, done
        assert done.stderr == "" and "#" not in done.stdout, done
    done = subprocess.run(["bash", script, "--params", "parameters.yml"], env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("error: ") and "sbatch" in done.stderr, done
    assert len(done.stderr.strip().splitlines()) == 1, done
    assert not (tmp_path / "called").exists()


def test_the_data_scripts_say_an_output_folder_they_cannot_make_in_one_line(tmp_path, capsys):
    """make_sample_text_data.py, make_bert_shards.py and prepare_text.py given an output folder under a file (or one
    they may not write) ended in os.makedirs' traceback; now one line naming the path, exit 2."""
    (tmp_path / "file").write_text("not a folder\n")
    under_a_file = str(tmp_path / "file" / "out")
    text = sample.write_bert_text(str(tmp_path / "text.txt"), __import__("random").Random(0), documents=10)
    runs = [lambda: sample.main([under_a_file]),
            lambda: make_bert_shards.main(["--input", text, "--output-dir", under_a_file, "--seq-length", "32",
                                           "--max-predictions", "5"]),
            lambda: prepare_text.main(["--task", "lm", "--train", text, "--output", under_a_file, "--workers", "1",
                                       "--train-tokenizer", "bpe"])]
    for run in runs:
        assert run() == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {under_a_file}") and "Not a directory" in err, err
        assert len(err.strip().splitlines()) == 1, err
