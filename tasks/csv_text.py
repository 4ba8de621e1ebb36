"""Text classification from your own files: data.data_dir/{train,dev[,test]}.csv (or .tsv, .jsonl, .parquet, a
`datasets` save_to_disk folder: tasks/table_files.py) with a text and a label column; see docs/tutorial/07."""
import re

import torch
from torch import nn

from core.errors import DataError
from tasks.bag_of_words_hf import BagOfWordsExport, word_ids
from tasks.base import Task
from tasks.metrics import classification_batch, classification_metrics
from tasks.table_files import check_train_rows, read_split, train_dev_test
from tasks.text_common import saved_words


def words(text):  # -----> tokenization: lower-cased words here (a Hugging Face tokenizer fits too)
    return re.findall(r"[a-z0-9']+", text.lower())


class CSVTextTask(BagOfWordsExport, Task):  # BagOfWordsExport: mode export's Hugging Face folder, for pipeline()
    def read(self, split):  # -----> another file format: return (texts, label names) of a split, or None
        d = self.cfg.data  # the format comes from the file name; every row is checked (DataError naming it)
        return read_split(d.data_dir, split, d.text_column, d.label_column)

    def build_datasets(self):
        raw = train_dev_test(self.read, self.cfg.data)  # no dev file: data.dev_fraction of train's rows
        texts, labels = raw["train"]
        self.classes = sorted(set(labels))  # label names -> 0, 1, ... in sorted order
        self.class_note = check_train_rows(self.cfg.data, texts, labels, words)  # refuses stray labels, unread scripts
        self.vocab = word_ids(saved_words(self.cfg, lambda: sorted(set(words(" ".join(texts))))))
        return {split: self.encode(split, *r) if r else None for split, r in raw.items()}

    def classes_note(self):  # the plan: the training classes with their counts (check_train_rows)
        return self.class_note

    def encode(self, split, texts, labels):  # word ids (0 pads, 1 is a word train lacks), class numbers
        if set(labels) - set(self.classes):
            raise DataError(f"{split} split: labels {sorted(set(labels) - set(self.classes))} are not in train's")
        return [{"ids": [self.vocab.get(w, 1) for w in words(t)][:self.cfg.data.max_length] or [1],
                 "labels": self.classes.index(y)} for t, y in zip(texts, labels)]

    def collate(self, samples):  # a batch: word ids padded with 0 to the longest text, and the labels
        return {"ids": nn.utils.rnn.pad_sequence([torch.tensor(s["ids"]) for s in samples], batch_first=True),
                "labels": torch.tensor([s["labels"] for s in samples])}

    def build_model(self):  # -----> the model: the mean of the words' embeddings (padding left out), a linear layer
        m = self.cfg.model
        return nn.Sequential(nn.EmbeddingBag(len(self.vocab) + 2, m.hidden, mode="mean", padding_idx=0),
                             nn.Dropout(m.random_dropout()), nn.Linear(m.hidden, len(self.classes)))

    def loss_sum(self, model, batch):  # -----> the loss, SUMMED over the batch (the Trainer divides by the count)
        return nn.functional.cross_entropy(model(batch["ids"]).float(), batch["labels"], reduction="sum")

    def eval_batch(self, model, batch):  # the dev loss is loss_sum's: edit the loss once, both follow
        return classification_batch(model(batch["ids"]), batch["labels"], self.loss_sum(model, batch))

    def metrics(self, totals):
        return classification_metrics(totals["preds"], totals["labels"], totals["loss_sum"], totals["count"])

