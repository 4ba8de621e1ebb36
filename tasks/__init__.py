"""Task registry: name -> "module:Class". Imported lazily, so the image task never imports transformers."""
import importlib

# -----> register a new task here (and write it as a subclass of tasks.base.Task).
TASKS = {
    "image": "tasks.image:ImageTask",
    "sst2": "tasks.sst2:SST2Task",
    "bert_pretrain": "tasks.bert_pretrain:BertPretrainTask",
    "gpt2_lm": "tasks.gpt2_lm:GPT2LMTask",
    "csv_text": "tasks.csv_text:CSVTextTask",  # the tutorial's own task (docs/tutorial/07_your_own_task.md)
}


def build_task(cfg):
    module, cls = TASKS[cfg.task].split(":")
    return getattr(importlib.import_module(module), cls)(cfg)
