"""Language modelling from your text by configuration (issue 21, items 1, 4, 5): text files in every format, the
tokenizer choice, random or block windows (exact on resume), the dev split, the shakespeare_char preset."""
import json
import os
import re
import shutil

import pytest
import torch
import yaml

import main
from conftest import ROOT, load_model_state, make_config, max_diff, run_ranks
from wiring import checked_config
from core.errors import ConfigError, DataError
from tasks import lm_data
from wiring import build_task

PLAY = "".join(f"{'ROMEO' if i % 2 else 'JULIET'}:\nO speak again, bright angel {i} ; thou art\n\n" for i in range(40))


def lm_cfg(out, data_dir, **data):
    return make_config(out, task="gpt2_lm", data={"data_dir": str(data_dir), "max_length": 16, **data},
                       model={"name": "tiny", "dropout": 0.0},
                       train={"best_metric": "loss", "batch_size": 4, "epochs": 0, "max_steps": 2})


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


# ---- files ----------------------------------------------------------------------------------------------------
def test_every_format_reads_the_same_texts(tmp_path):
    texts = ["First text,\nwith a line break.", "Second ✓ text."]
    layouts = {
        "txt": {"a.txt": texts[0], "b.txt": texts[1]},  # one text per file, in name order (no train.*)
        "json": {"train.json": json.dumps(texts)},
        "jsonl": {"train.jsonl": "\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(texts)) + "\n\n"},
        "json_lines_in_.json": {"train.json": "\n".join(json.dumps(t) for t in texts)},
    }
    for name, files in layouts.items():
        folder = tmp_path / name
        for file, content in files.items():
            write(folder / file, content)
        write(folder / "dev.txt", "a dev text")
        data = lm_cfg(tmp_path / "run", folder, text_column="body").data
        assert lm_data.read_splits(data)[0] == {"train": texts, "dev": ["a dev text"]}, name


@pytest.mark.parametrize("file, content, message", [
    ("train.jsonl", '{"text": "ok"}\n\n{"text": "a" "b"}\n', "train.jsonl:3: not valid JSON at column 14"),
    ("train.jsonl", '{"text": "ok"}\n{"body": "no text"}\n', "train.jsonl:2: expected an object with a string "
                                                             "'text' (data.text_column) or a string, got no 'text'"),
    ("train.json", '[\n"one",\n"two" "three"\n]', "train.json:3: not valid JSON"),
    ("train.json", '["one", 2]', "train.json: expected a JSON array of strings; item 1 is a number"),
    ("train.txt", b"fine\nbad \xff byte\n", "train.txt:2: not valid UTF-8 (byte 0xff at column 5)"),
    ("train.txt", "", "train.txt: empty file, no text"),
    ("notes.md", "not a text file it looks for", "no training text. gpt2_lm reads train.txt"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, file, content, message):
    path = tmp_path / file
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    cfg = lm_cfg(tmp_path / "run", tmp_path)
    with pytest.raises(DataError, match=re.escape(message)):
        build_task(cfg).build_datasets()


# ---- tokenizers -----------------------------------------------------------------------------------------------
def test_char_byte_bpe_and_folder_tokenizers(tmp_path):
    data = tmp_path / "data"
    write(data / "input.txt", PLAY + "é✓")
    streams = {}
    for kind in ("char", "byte", "bpe"):
        task = build_task(lm_cfg(tmp_path / kind, data, tokenizer=kind, dev_split="tail", dev_fraction=0.2))
        sets = task.build_datasets()
        tok = task.tokenizer
        stream = torch.cat([sets["train"].stream, sets["dev"].stream]).tolist()  # tail: train + dev is all of it
        assert stream[-1] == tok.eos_token_id and tok.decode(stream[:-1]) == PLAY + "é✓" or kind == "bpe"
        streams[kind] = stream
        assert os.path.isfile(tmp_path / kind / "tokenizer" / "tokenizer.json")
    chars = sorted(set(PLAY + "é✓"))
    assert streams["char"][:-1] == [chars.index(c) for c in PLAY + "é✓"]  # nanoGPT's stoi: sorted characters
    assert streams["byte"][:-1] == list((PLAY + "é✓").encode("utf-8"))  # id = byte value; 256 is end of text
    assert len(build_task(lm_cfg(tmp_path / "char", data, tokenizer="char")).load_tokenizer()) == len(chars) + 1
    # a folder: copied into output_dir, the same ids
    task = build_task(lm_cfg(tmp_path / "folder", data, tokenizer=str(tmp_path / "byte" / "tokenizer"),
                             dev_split="tail", dev_fraction=0.2))
    sets = task.build_datasets()
    assert torch.cat([sets["train"].stream, sets["dev"].stream]).tolist() == streams["byte"]
    assert os.path.isfile(tmp_path / "folder" / "tokenizer" / "tokenizer.json")
    with pytest.raises(DataError, match=re.escape("data.tokenizer: 'chars' is neither bpe, char, byte nor")):
        build_task(lm_cfg(tmp_path / "typo", data, tokenizer="chars")).build_datasets()


def test_a_saved_tokenizer_of_another_kind_is_refused(tmp_path):
    data = tmp_path / "data"
    write(data / "input.txt", PLAY)
    out = tmp_path / "run"
    build_task(lm_cfg(out, data, tokenizer="char")).build_datasets()
    assert json.loads((out / "tokenizer" / "made_as.json").read_text()) == {"kind": "char"}
    build_task(lm_cfg(out, data, tokenizer="char")).build_datasets()  # the same kind: reused
    message = (f"{out / 'tokenizer'}: holds a tokenizer made as char, but data.tokenizer asks for byte; set "
               "train.start_over=true (moves the old run aside) or use another output_dir")
    with pytest.raises(DataError, match=re.escape(message)):
        build_task(lm_cfg(out, data, tokenizer="byte")).build_datasets()
    folder = str(tmp_path / "elsewhere")
    shutil.copytree(out / "tokenizer", folder)
    with pytest.raises(DataError, match=re.escape(f"made as char, but data.tokenizer asks for {folder};")):
        build_task(lm_cfg(out, data, tokenizer=folder)).build_datasets()
    cfg = lm_cfg(out, data, tokenizer="byte")
    cfg.train.start_over = True  # a new run makes its own; the old one is moved aside
    task = build_task(cfg)
    task.build_datasets()
    assert len(task.tokenizer) == 257
    assert [n for n in os.listdir(tmp_path / "run") if n.startswith("tokenizer.replaced-")]
    assert json.loads((out / "tokenizer" / "made_as.json").read_text()) == {"kind": "byte"}


def test_lm_keys_are_refused_where_they_do_nothing(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("data.windows` is gpt2_lm's, not sst2's")):
        make_config(tmp_path, task="sst2", data={"windows": "random"})
    with pytest.raises(ConfigError, match=re.escape("data.tokenizer` is char, but model.pretrained_dir's")):
        make_config(tmp_path, task="gpt2_lm", data={"tokenizer": "char"}, model={"pretrained_dir": str(tmp_path)})


# ---- dev split ------------------------------------------------------------------------------------------------
def test_dev_split_tail_texts_and_files(tmp_path):
    data = tmp_path / "data"
    write(data / "train.json", json.dumps([f"text {i} ." for i in range(20)]))
    tail = build_task(lm_cfg(tmp_path / "tail", data, tokenizer="char", dev_fraction=0.25)).build_datasets()
    n_train, n_dev = len(tail["train"].stream), len(tail["dev"].stream)
    assert n_dev == (n_train + n_dev) - int((n_train + n_dev) * 0.75)  # nanoGPT's data[int(n * 0.9):], at 0.25
    assert tail["dev"].path.endswith("(last 0.25 of its tokens)")
    texts = lm_data.read_splits(lm_cfg(tmp_path / "texts", data, dev_split="texts", dev_fraction=0.2).data)[0]
    assert len(texts["dev"]) == 4 and not set(texts["dev"]) & set(texts["train"])
    write(data / "dev.txt", "the dev file")  # auto: a dev file wins
    assert lm_data.read_splits(lm_cfg(tmp_path / "files", data).data)[0]["dev"] == ["the dev file"]
    os.remove(data / "dev.txt")
    with pytest.raises(DataError, match=re.escape("no dev file, which data.dev_split: files needs")):
        lm_data.read_splits(lm_cfg(tmp_path / "files", data, dev_split="files").data)


# ---- windows --------------------------------------------------------------------------------------------------
def test_random_windows_come_from_seed_epoch_and_index(tmp_path):
    stream = torch.arange(1000)
    blocks = lm_data.Blocks(stream, 16, "x")
    windows = lm_data.RandomWindows(blocks, seed=3)
    assert len(windows) == len(blocks) == 62  # an epoch: as many windows as blocks
    first = [windows[i]["input_ids"] for i in range(len(windows))]
    for w in first:
        assert torch.equal(w, torch.arange(int(w[0]), int(w[0]) + 16))  # a contiguous slice of the stream
    assert len({int(w[0]) for w in first}) > 50 and max(int(w[0]) for w in first) > 900
    torch.manual_seed(123)  # the global RNG plays no part
    again = lm_data.RandomWindows(blocks, seed=3)
    assert all(torch.equal(a, again[i]["input_ids"]) for i, a in enumerate(first))
    again.set_epoch(1)
    assert sum(torch.equal(a, again[i]["input_ids"]) for i, a in enumerate(first)) < 5


def test_random_windows_resume_exactly(tmp_path):
    """6 steps over 3 epochs of 2 batches; resumed from step 3 (mid-epoch 1), the run ends where it would have."""
    data = tmp_path / "data"
    write(data / "input.txt", PLAY[:150])  # 151 tokens: the last 31 dev, 7 blocks of 16 train

    def cfg(out):
        c = lm_cfg(out, data, tokenizer="char", windows="random", dev_fraction=0.2)
        c.model.dropout = 0.1  # the random stream of dropout must resume too
        c.train.max_steps, c.train.save_every, c.train.eval_every, c.train.keep_last = 6, 3, 3, 5
        return c
    assert main.run(cfg(tmp_path / "whole")) == 0
    assert "(2 micro-batches per epoch)" in (tmp_path / "whole" / "logs" / "rank0.log").read_text()
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    shutil.copytree(tmp_path / "whole" / "tokenizer", resumed / "tokenizer")
    assert main.run(cfg(resumed)) == 0
    a, b = load_model_state(tmp_path / "whole", 6), load_model_state(resumed, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.wte.weight"], load_model_state(resumed, 3)["transformer.wte.weight"])


@pytest.mark.slow  # ~60 s: two spawned ranks and one process
def test_random_windows_under_ddp_equal_one_process_on_the_global_batch(tmp_path):
    """2 ranks x 4 windows equal 1 process x 8 over 6 steps (3 epochs: each epoch's windows redrawn alike)."""
    data = tmp_path / "data"
    write(data / "input.txt", PLAY[:300])  # 301 tokens: the last 31 dev, 16 blocks of 16 train: 2 steps of 8

    def cfg(out, batch, **dist):
        c = lm_cfg(out, data, tokenizer="char", windows="random", dev_fraction=0.1)
        c.train.max_steps, c.train.batch_size, c.train.eval_every, c.train.save_every = 6, batch, 0, 3
        c.dist.strategy, c.dist.procs_per_node = dist.get("strategy", "none"), dist.get("procs_per_node", 1)
        return c
    ranks = run_ranks(cfg(tmp_path / "ddp", 4, strategy="ddp", procs_per_node=2), 2, tmp_path / "ddp-params")
    assert max_diff(ranks[0], ranks[1]) == 0.0
    assert main.run(cfg(tmp_path / "one", 8)) == 0
    single = load_model_state(tmp_path / "one", 6)
    assert max_diff(ranks[0], single) < 1e-5
    assert "(2 micro-batches per epoch)" in (tmp_path / "one" / "logs" / "rank0.log").read_text()
    assert max_diff(single, load_model_state(tmp_path / "one", 3)) > 1e-4  # not vacuous: training moves them


def test_random_windows_over_token_shards_equal_the_in_memory_ones(tmp_path):
    import sys
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import prepare_text
    data = tmp_path / "data"
    write(data / "train.txt", PLAY)
    write(data / "dev.txt", PLAY[:100])
    memory = build_task(lm_cfg(tmp_path / "memory", data, tokenizer="char", windows="random")).build_datasets()
    assert prepare_text.main(["--task", "lm", "--train", str(data / "train.txt"), "--dev", str(data / "dev.txt"),
                              "--text-unit", "file", "--tokenizer", str(tmp_path / "memory" / "tokenizer"),
                              "--output", str(tmp_path / "shards"), "--chunk-mb", "0.001", "--workers", "1"]) == 0
    shards = build_task(lm_cfg(tmp_path / "run", tmp_path / "shards", windows="random")).build_datasets()
    for epoch in (0, 1):
        memory["train"].set_epoch(epoch)
        shards["train"].set_epoch(epoch)
        for i in range(len(memory["train"])):
            assert torch.equal(memory["train"][i]["input_ids"], shards["train"][i]["input_ids"])
    with pytest.raises(DataError, match="token shards carry their tokenizer and dev split"):
        build_task(lm_cfg(tmp_path / "run2", tmp_path / "shards", dev_split="tail")).build_datasets()


# ---- the preset -----------------------------------------------------------------------------------------------
def test_shakespeare_char_preset_trains_and_generates(tmp_path, capsys):
    import generate
    data = tmp_path / "plays"
    write(data / "input.txt", PLAY * 3)
    preset = os.path.join(ROOT, "configs", "shakespeare_char.yml")
    overrides = [f"data.data_dir={data}", f"output_dir={tmp_path / 'run'}", "train.max_steps=4", "train.warmup=2",
                 "train.eval_every=2", "log.progress_bar=false", "log.tensorboard=false"]
    cfg = checked_config(preset, overrides)
    assert main.run(cfg) == 0
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert re.search(r"step 4 dev: .*\bloss=", log)
    params = tmp_path / "params.yml"
    params.write_text(yaml.safe_dump(cfg.to_dict()))
    capsys.readouterr()
    assert generate.main(["--params", str(params), "--prompt", "ROMEO:", "--max-new-tokens", "30"]) == 0
    sampled = capsys.readouterr().out
    assert sampled.startswith("ROMEO:") and len(sampled) > 30 and set(sampled) <= set(PLAY) | {"\n"}
    cfg.mode, cfg.export.dir = "export", str(tmp_path / "export")
    assert main.run(cfg) == 0
    capsys.readouterr()
    assert generate.main(["--export", cfg.export.dir, "--prompt", "ROMEO:", "--max-new-tokens", "30"]) == 0
    assert capsys.readouterr().out == sampled  # the export samples what the checkpoint does
    # no prompt: the text starts from <|endoftext|>, which is not printed (it is no part of the text sampled)
    assert generate.main(["--export", cfg.export.dir, "--prompt", "", "--max-new-tokens", "0"]) == 0
    assert capsys.readouterr().out == "\n"
    assert generate.main(["--export", cfg.export.dir, "--max-new-tokens", "20", "--temperature", "0"]) == 0
    unprompted = capsys.readouterr().out
    assert len(unprompted) == 21 and set(unprompted) <= set(PLAY) | {"\n"}, unprompted
    # a character the text never had would become <|endoftext|> unseen: refused in one line, naming it
    assert generate.main(["--export", cfg.export.dir, "--prompt", "ROMEO: yes", "--max-new-tokens", "3"]) == 2
    assert capsys.readouterr().err == ("error: --prompt holds characters the tokenizer does not know: 'y' (each "
                                       "would be read as its unknown token); leave them out\n")


def test_a_checkpoint_read_beside_another_run_s_tokenizer_is_refused(tmp_path, capsys):
    """Two char-level runs on texts with other characters give the same character other ids: test mode and
    generate.py, given the first run's checkpoint in the second's output_dir, refuse it in one line (they sampled
    and scored through the wrong ids before)."""
    import generate
    for run, text in (("one", PLAY), ("two", PLAY.replace("O", "Q"))):
        write(tmp_path / f"data-{run}" / "input.txt", text)
        assert main.run(lm_cfg(tmp_path / run, tmp_path / f"data-{run}", tokenizer="char")) == 0
    first = str(tmp_path / "one" / "checkpoints" / "step-2")
    cfg = lm_cfg(tmp_path / "two", tmp_path / "data-two", tokenizer="char")
    capsys.readouterr()
    cfg.mode, cfg.test.checkpoint = "test", first
    assert main.run(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and first in err[0] and "another vocabulary" in err[0], err
    params = tmp_path / "params.yml"
    params.write_text(yaml.safe_dump({**cfg.to_dict(), "mode": "train"}))
    assert generate.main(["--params", str(params), "--checkpoint", first, "--prompt", "ROMEO", "--max-new-tokens",
                          "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another vocabulary" in err[0], err
    cfg.test.checkpoint = str(tmp_path / "two" / "checkpoints" / "step-2")  # its own: read
    assert main.run(cfg) == 0
