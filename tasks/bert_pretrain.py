"""BERT pre-training (masked LM + next-sentence prediction) on NVIDIA DeepLearningExamples' HDF5 shards.

Each shard holds, for N sequences of fixed length L (128 or 512):
    input_ids, input_mask, segment_ids   [N, L]  token ids, 1 for real tokens, sentence A/B
    masked_lm_positions, masked_lm_ids   [N, P]  where tokens were masked and their original ids (0-padded)
    next_sentence_labels                 [N]     1 if sentence B is a random sentence, 0 if it follows A
`scripts/make_bert_shards.py` writes the same format from raw text.

Memory: samples are read row by row from the one shard that is open. The dataset exposes `shard_sizes`, so the
Trainer's sampler shuffles shard order and samples within a shard and a rank reads one file at a time, as NVIDIA's
loader does. At start-up every shard is checked once, whole arrays at a time (in chunks of rows, vectorised):
a value the model cannot take (a token id outside the vocabulary, a masked position outside the sequence, a
label other than 0/1, ...) is a DataError naming the shard and `dataset[row][column]`, before training starts,
instead of an index error (or a CUDA device-side assert) whenever its batch comes up.

Loss, and what `count` means: one unit is one SEQUENCE. Each sequence contributes
    (mean cross-entropy over its own masked tokens) + (its next-sentence cross-entropy),
so loss_sum is a sum over sequences and the Trainer's global mean is the mean over sequences of the batch.
(NVIDIA averages MLM over all masked tokens of the batch instead; with ~20 masked tokens in nearly every
sequence the two are almost the same, and ours adds up exactly across ranks and accumulation steps.)
Dev metrics: mlm_loss and mlm_accuracy are per masked TOKEN (the usual numbers to compare with papers),
nsp_accuracy per sequence, and `loss` is the training objective above.
"""
from __future__ import annotations

import bisect
import glob
import os
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from core.errors import DataError
from core.file_names import shown_name
from tasks import lm_models
from tasks.base import PipelineLayer, Task
from tasks.text_common import (WEIGHTS_DTYPE, bert_pipeline_layers, bert_tp_plan, check_pretrained_dir, load_report,
                               open_tokenizer, pad_positions, pretrained_dropout)

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")


class ModelLimits(NamedTuple):
    """What the model can index: token ids < vocab_size, segment ids < type_vocab_size, sequences of at most
    max_positions tokens. The shards are checked against these before training."""
    vocab_size: int = 30522  # the uncased WordPiece vocab the shards are made with
    type_vocab_size: int = 2  # sentence A and sentence B
    max_positions: int = 512


RANDOM_MODEL = ModelLimits()  # the randomly initialised models of BERT_PRESETS
CHECK_ELEMENTS = 1 << 22  # values per [rows, L] array read at once by the start-up check (16 MB of int32)

BERT_PRESETS = {  # randomly initialised sizes (vocabulary and positions: RANDOM_MODEL)
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128),
}
BERT_SHAPE = {"layers": ("num_hidden_layers",), "heads": ("num_attention_heads",), "width": ("hidden_size",),
              "mlp": ("intermediate_size",)}  # the model section's shape keys, in BertConfig's words


class HDF5Shards(Dataset):
    """Map-style view over a list of shard files; sample i lives in shard `bisect(starts, i) - 1`.
    Every shard is checked at construction against what the model can index (`limits`, see check_shards)."""

    def __init__(self, files: list[str], limits: ModelLimits = RANDOM_MODEL):
        import h5py
        self.files = files
        self.shard_sizes = []
        for path in files:  # the shapes, on every rank (metadata only); the values are check_shards' work
            try:
                with h5py.File(path, "r") as f:
                    missing = [k for k in KEYS if k not in f]
                    if missing:
                        raise DataError(f"{shown_name(path)}: not a BERT pre-training shard (missing "
                                        f"{', '.join(missing)})")
                    flat = [k for k in KEYS if not isinstance(f[k], h5py.Dataset) or not f[k].shape]
                    if flat:
                        raise DataError(f"{shown_name(path)}: {', '.join(flat)} must be arrays with one row per "
                                        "sequence")
                    n = f["input_ids"].shape[0]
                    if any(f[k].shape[0] != n for k in KEYS):
                        raise DataError(f"{shown_name(path)}: datasets disagree on the number of sequences "
                                        f"({', '.join(f'{k}={f[k].shape[0]}' for k in KEYS)})")
                    length = check_shapes(path, f)
                    if self.shard_sizes and length != self.seq_length:  # a batch stacks rows of several shards
                        raise DataError(f"{shown_name(path)}: sequences of {length} tokens, but {shown_name(files[0])} "
                                        f"has {self.seq_length}; all shards of a split need one sequence length")
                    self.seq_length = length
            except OSError as e:
                raise DataError(f"{shown_name(path)}: not a readable HDF5 file ({e})") from None
            self.shard_sizes.append(n)
        check_shards(files, limits)
        self.starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).tolist()
        self.open_index, self.open_file = None, None  # the one shard this process has open

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self):  # DataLoader workers get a copy without the open handle and open their own
        state = dict(self.__dict__)
        state["open_index"], state["open_file"] = None, None
        return state

    def shard(self, s: int):
        if self.open_index != s:
            import h5py
            if self.open_file is not None:
                self.open_file.close()
            self.open_file, self.open_index = h5py.File(self.files[s], "r"), s
        return self.open_file

    def __getitem__(self, i: int) -> dict:
        s = bisect.bisect_right(self.starts, i) - 1
        f, j = self.shard(s), i - self.starts[s]
        row = {k: torch.from_numpy(np.asarray(f[k][j]).astype(np.int64)) for k in KEYS}
        # Unused prediction slots are padded with position 0, which is [CLS] and never masked.
        positions, ids = row["masked_lm_positions"], row["masked_lm_ids"]
        used = positions != 0
        mlm_labels = torch.full_like(row["input_ids"], -100)  # -100: not a prediction target
        mlm_labels[positions[used]] = ids[used]
        return {"input_ids": row["input_ids"], "attention_mask": row["input_mask"],
                "token_type_ids": row["segment_ids"], "mlm_labels": mlm_labels,
                "nsp_labels": row["next_sentence_labels"].reshape(())}


# ----------------------------------------------------------------------------------------------------------------
# The start-up check of a shard: shapes, then every value, whole arrays at a time
# ----------------------------------------------------------------------------------------------------------------
def check_shapes(path: str, f) -> int:
    """Integer arrays of the shapes __getitem__ and collate rely on. Returns the sequence length L."""
    for key in KEYS:
        if f[key].dtype.kind not in "iu":  # float ids would be truncated silently by astype(int64)
            raise DataError(f"{shown_name(path)}: {key} holds {f[key].dtype} values; token ids, masks, positions and "
                            "labels are integers")
    n, shape = f["input_ids"].shape[0], lambda key: "x".join(map(str, f[key].shape))  # noqa: E731
    if len(f["input_ids"].shape) != 2:
        raise DataError(f"{shown_name(path)}: input_ids is {shape('input_ids')}; expected [sequences, sequence length]")
    for key in ("input_mask", "segment_ids"):
        if f[key].shape != f["input_ids"].shape:
            raise DataError(f"{shown_name(path)}: {key} is {shape(key)} but input_ids {shape('input_ids')}; they must "
                            "match")
    if len(f["masked_lm_positions"].shape) != 2 or f["masked_lm_ids"].shape != f["masked_lm_positions"].shape:
        raise DataError(f"{shown_name(path)}: masked_lm_positions is {shape('masked_lm_positions')} and masked_lm_ids "
                        f"{shape('masked_lm_ids')}; both must be [sequences, max predictions]")
    if f["next_sentence_labels"].shape not in ((n,), (n, 1)):
        raise DataError(f"{shown_name(path)}: next_sentence_labels is {shape('next_sentence_labels')}; expected one "
                        f"label per sequence ({n})")
    return f["input_ids"].shape[1]


def check_shards(files: list[str], limits: ModelLimits) -> None:
    """check_shard on every file. Under torch.distributed each rank checks every world-th file (reading all the
    data once per job, not once per rank) and the ranks then share what they found, so every rank raises the
    same one-line DataError, or none does."""
    import h5py
    import torch.distributed as dist
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = None
    for path in files[rank::world]:
        try:
            with h5py.File(path, "r") as f:
                check_shard(path, f, limits)
        except DataError as e:
            found = str(e)
        except OSError as e:  # a chunk that cannot be read or decompressed
            found = f"{shown_name(path)}: not a readable HDF5 file ({e})"
        if found:
            break
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, found)  # the rank order decides which error is shown: the same everywhere
        found = next((e for e in everyone if e), None)
    if found:
        raise DataError(found)


def check_shard(path: str, f, limits: ModelLimits) -> None:
    """Every value of the shard is one the model can take, checked with numpy on blocks of rows, each array read
    once. The first bad value is reported as `dataset[row][column] = value`, with what is allowed. Reading each
    array once costs a small fraction of one epoch's row reads (benchmarks/RESULTS.md, "BERT shards' check")."""
    n, length = f["input_ids"].shape
    rows = max(1, CHECK_ELEMENTS // max(length, 1))
    for start in range(0, n, rows):
        block = {k: f[k][start:start + rows] for k in KEYS}
        check_block(path, block, start, length, limits)


def check_block(path: str, b: dict, start: int, length: int, limits: ModelLimits) -> None:
    """check_shard on rows start.. of the shard (`b`: each dataset's rows)."""
    def fail_if(bad: np.ndarray, key: str, values: np.ndarray, what: str) -> None:
        """DataError at the first True of `bad`: `key[row][column] = value what`, and how many more there are."""
        if bad.any():
            first = np.unravel_index(int(np.argmax(bad)), bad.shape)  # argmax: the first True, row-major
            where = f"{key}[{start + first[0]}]" + "".join(f"[{i}]" for i in first[1:])
            more = int(bad.sum()) - 1
            others = f" (and {more} more in rows {start}-{start + len(bad) - 1})" if more else ""
            raise DataError(f"{shown_name(path)}: {where} {what.format(values[first])}{others}")

    mask, ids, segments = b["input_mask"], b["input_ids"], b["segment_ids"]
    fail_if((mask != 0) & (mask != 1), "input_mask", mask, "= {} is not 0 or 1 (1: a real token, 0: padding)")
    # collate keeps the first max(real tokens) columns of a batch: real tokens come first, then padding.
    after_padding = np.zeros(mask.shape, bool)
    after_padding[:, 1:] = mask[:, 1:] > mask[:, :-1]
    fail_if(after_padding, "input_mask", mask, "= {} follows a 0: real tokens must come first, then padding")
    real = mask.sum(axis=1)
    fail_if(real == 0, "input_mask", real, "is all 0: an empty sequence (a sequence has at least [CLS])")
    fail_if(real > limits.max_positions, "input_mask", real, f"has {{}} real tokens, more than the model's "
            f"{limits.max_positions} positions (max_position_embeddings)")
    vocab = f"(vocab_size {limits.vocab_size}: ids 0-{limits.vocab_size - 1})"
    fail_if((ids < 0) | (ids >= limits.vocab_size), "input_ids", ids, f"= {{}} is outside the vocabulary {vocab}")
    fail_if((segments < 0) | (segments >= limits.type_vocab_size), "segment_ids", segments,
            f"= {{}} is not a segment id (0-{limits.type_vocab_size - 1}: 0 for sentence A, 1 for sentence B)")
    positions, targets = b["masked_lm_positions"], b["masked_lm_ids"]
    fail_if((positions < 0) | (positions >= length), "masked_lm_positions", positions,
            f"= {{}} is outside the sequence (length {length}: positions 0-{length - 1})")
    # 0 marks an unused slot ([CLS] is never masked); a used one must point at a real token, not at padding.
    fail_if((positions != 0) & (positions >= real[:, None]), "masked_lm_positions", positions,
            "= {} points at padding, past the sequence's real tokens (input_mask is 0 there)")
    fail_if((targets < 0) | (targets >= limits.vocab_size), "masked_lm_ids", targets,
            f"= {{}} is outside the vocabulary {vocab}")
    labels = b["next_sentence_labels"].reshape(-1)
    fail_if((labels != 0) & (labels != 1), "next_sentence_labels", labels,
            "= {} is not 0 or 1 (0: sentence B follows A, 1: B is a random sentence)")


class PretrainingModel(nn.Module):
    """BertForPreTraining whose forward scores only the masked positions (the vocabulary projection of every
    position would cost ~7x the memory of the rest of the model at seq 128). It is one module with one forward,
    so DDP and the other strategies see every parameter used."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert  # transformers' BertForPreTraining: .bert (encoder) and .cls (both heads)

    def forward(self, input_ids, attention_mask, token_type_ids, mlm_labels):
        out = self.bert.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden, pooled = out.last_hidden_state, out.pooler_output
        masked = mlm_labels != -100
        mlm_logits = self.bert.cls.predictions(hidden[masked])  # [masked tokens, vocab]
        nsp_logits = self.bert.cls.seq_relationship(pooled)     # [batch, 2]
        return mlm_logits, nsp_logits


def bert_folder_config(folder: str):
    """model.pretrained_dir's config, a BERT's: BertForPreTraining finds none of another architecture's weights under
    its names (RoBERTa's roberta.*: all made new, a random model) or finds them of other shapes (a traceback)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(check_pretrained_dir(folder), trust_remote_code=False)
    if config.model_type != "bert":
        raise DataError(f"model.pretrained_dir: {shown_name(folder)} holds a {config.model_type} model; bert_pretrain "
                        "continues pre-training BERT models (model_type bert, MiniLM's too)")
    return config


class BertPretrainTask(Task):
    best_metric_default = "loss"
    lower_is_better = ("loss", "mlm_loss", "nsp_loss")
    has_pipeline_chain = has_tp_plan = True

    def build_datasets(self) -> dict:
        d = self.cfg.data
        train = self.find_shards(d.train_files or self.default_pattern("training"), "train_files")
        dev = self.find_shards(d.dev_files or self.default_pattern("test"), "dev_files")
        limits = self.model_limits()
        datasets = {"train": HDF5Shards(train, limits), "dev": HDF5Shards(dev, limits), "test": None}
        if datasets["train"].seq_length != datasets["dev"].seq_length:
            raise DataError(f"{dev[0]}: sequence length {datasets['dev'].seq_length} differs from the training "
                            f"shards' {datasets['train'].seq_length}")
        return datasets

    def default_pattern(self, split: str) -> str:
        """Where a split's shards are when data.train_files / dev_files are not set: NVIDIA's layout, one folder
        per split (<data_dir>/training/*.hdf5, <data_dir>/test/*.hdf5), or else the flat one that HetSeq and
        NVIDIA's older scripts leave, the splits side by side and told apart by file name
        (<data_dir>/wikicorpus_en_training_0.hdf5 next to wikicorpus_en_test_0.hdf5)."""
        folder = os.path.join(self.cfg.data.data_dir, split, "*.hdf5")
        flat = os.path.join(self.cfg.data.data_dir, f"*_{split}_*.hdf5")
        return flat if not glob.glob(folder) and glob.glob(flat) else folder

    @staticmethod
    def find_shards(pattern: str, key: str) -> list[str]:
        files = sorted(glob.glob(pattern))  # sorted: the same index order on every rank and every run
        if not files:
            raise DataError(f"data.{key}: no HDF5 shards match {pattern!r} (data.data_dir holds them in training/ "
                            "and test/ folders, or side by side as *_training_N.hdf5 and *_test_N.hdf5; make some "
                            "with scripts/make_bert_shards.py, or set data.train_files / data.dev_files)")
        return files

    def model_limits(self) -> ModelLimits:
        """What build_model's model can index, known before it is built (the shards are checked against it):
        pretrained_dir's config.json, or the random models' sizes."""
        if not self.cfg.model.pretrained_dir:
            return RANDOM_MODEL
        c = bert_folder_config(self.cfg.model.pretrained_dir)
        return ModelLimits(c.vocab_size, c.type_vocab_size, c.max_position_embeddings)

    def model_built(self, model: dict) -> dict:
        return lm_models.built_shape(self.cfg, model, BERT_PRESETS, BERT_SHAPE)

    def build_model(self) -> nn.Module:
        from transformers import BertConfig, BertForPreTraining
        m = self.cfg.model
        if m.pretrained_dir:
            # -----> continue pre-training another BERT-style checkpoint (its vocabulary must match the shards).
            folder = bert_folder_config(m.pretrained_dir)
            lm_models.check_folder_shape(self.cfg, folder)
            with load_report(self.cfg):
                return PretrainingModel(BertForPreTraining.from_pretrained(
                    m.pretrained_dir, trust_remote_code=False, dtype=WEIGHTS_DTYPE,
                    **pretrained_dropout(self.cfg, folder)))
        # -----> the randomly initialised model: sizes from BERT_PRESETS, or model.layers, heads and width.
        shape = lm_models.sized(self.cfg, BERT_PRESETS, BERT_SHAPE)
        config = BertConfig(vocab_size=RANDOM_MODEL.vocab_size, type_vocab_size=RANDOM_MODEL.type_vocab_size,
                            max_position_embeddings=RANDOM_MODEL.max_positions, hidden_dropout_prob=m.random_dropout(),
                            attention_probs_dropout_prob=m.random_dropout(), tie_word_embeddings=m.tie_embeddings is not False,
                            **shape)
        model = BertForPreTraining(config)
        if m.bias is False:
            lm_models.freeze_biases(model)
        return PretrainingModel(model)

    def tp_plan(self, model: nn.Module, tp: int) -> dict:
        return bert_tp_plan(model, tp, self.cfg.dist.sequence_parallel)

    def collate(self, samples: list) -> dict:
        batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
        if self.cfg.dist.strategy != "pipe":  # (pipeline stages need the same shapes every step: the shards' L)
            # Shards pad every sequence to L; cut the columns that are padding in every row of this batch.
            width = int(batch["attention_mask"].sum(1).max())
            batch = {k: (v[:, :width].contiguous() if v.dim() == 2 else v) for k, v in batch.items()}
        return pad_positions(batch, self.cfg.dist.tp if self.cfg.dist.sequence_parallel else 1, {"mlm_labels": -100})

    def count(self, batch: dict) -> int:
        return len(batch["nsp_labels"])  # one unit = one sequence (see the module docstring)

    def losses(self, model: nn.Module, batch: dict):
        output = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], batch["mlm_labels"])
        return self.losses_from_output(output, batch["mlm_labels"], batch["nsp_labels"])

    @staticmethod
    def losses_from_output(output, mlm_labels: torch.Tensor, nsp_labels: torch.Tensor):
        """Per-token MLM cross-entropy, the sequence each masked token belongs to, per-sequence NSP loss. The
        MLM logits are for the masked tokens only, or (under pipe) for every position."""
        mlm_logits, nsp_logits = output
        masked = mlm_labels != -100
        if mlm_logits.dim() == 3:
            mlm_logits = mlm_logits[masked]
        targets = mlm_labels[masked]
        mlm = F.cross_entropy(mlm_logits.float(), targets, reduction="none")
        owner = masked.nonzero()[:, 0]  # row of each masked token, in the same (row-major) order as mlm
        nsp = F.cross_entropy(nsp_logits.float(), nsp_labels, reduction="none")
        return mlm, mlm_logits, targets, owner, nsp, nsp_logits

    @staticmethod
    def objective_sum(mlm: torch.Tensor, owner: torch.Tensor, nsp: torch.Tensor) -> torch.Tensor:
        # -----> the pre-training objective: per-sequence mean MLM loss + NSP loss, summed over sequences.
        # Training minimises it (loss_sum) and dev reports it as `loss` (eval_batch): one definition for both.
        return masked_mean_per_row(mlm, owner, len(nsp)).sum() + nsp.sum()

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        mlm, _, _, owner, nsp, _ = self.losses(model, batch)
        return self.objective_sum(mlm, owner, nsp)

    def eval_batch(self, model: nn.Module, batch: dict) -> dict:
        return self.eval_from_losses(batch, *self.losses(model, batch))

    def eval_from_losses(self, batch, mlm, mlm_logits, targets, owner, nsp, nsp_logits) -> dict:
        one = lambda x: torch.as_tensor(x, dtype=torch.float64, device=nsp.device)  # noqa: E731
        return {"objective_sum": self.objective_sum(mlm, owner, nsp),
                "mlm_loss_sum": mlm.sum(), "mlm_correct": (mlm_logits.argmax(-1) == targets).sum().double(),
                "mlm_tokens": one(len(targets)), "nsp_loss_sum": nsp.sum(),
                "nsp_correct": (nsp_logits.argmax(-1) == batch["nsp_labels"]).sum().double(),
                "sequences": one(len(nsp))}

    # ---- pipe: BertForPreTraining as a chain (embeddings, encoder layers, heads) ------------------------------
    def pipeline_layers(self, model: nn.Module) -> list[nn.Module]:
        """The last link scores every position: the masked positions are picked out in the loss, which alone sees
        the labels. The MLM decoder shares its weight with the word embeddings (added up under pipe)."""
        bert, heads = model.bert.bert, model.bert.cls

        def head(hidden, attention_mask):
            return heads.predictions(hidden), heads.seq_relationship(bert.pooler(hidden))
        return bert_pipeline_layers(bert, PipelineLayer(head, bert.pooler, heads))

    def pipeline_inputs(self, batch: dict) -> tuple:
        return batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]

    def pipeline_target(self, batch: dict) -> torch.Tensor:
        # One tensor, cut into micro-batches with the inputs: the MLM labels and, as a last column, the NSP label.
        return torch.cat([batch["mlm_labels"], batch["nsp_labels"][:, None]], 1)

    def loss_from_output(self, output, target: torch.Tensor) -> torch.Tensor:
        mlm, _, _, owner, nsp, _ = self.losses_from_output(output, target[:, :-1], target[:, -1])
        return self.objective_sum(mlm, owner, nsp)

    def eval_from_output(self, output, batch: dict) -> dict:
        return self.eval_from_losses(batch, *self.losses_from_output(output, batch["mlm_labels"],
                                                                      batch["nsp_labels"]))

    # mode: export (export.py): the BertForPreTraining inside PretrainingModel, as a Hugging Face folder.
    export_formats = ("hf",)
    hf_pipeline = "fill-mask"

    def prepare_inference(self, label_names: Optional[list[str]]) -> None:
        pass  # build_model needs nothing from the data

    def hf_model(self, model: nn.Module):
        return model.bert

    def hf_tokenizer(self):
        """pretrained_dir's tokenizer. The shards were tokenized beforehand (scripts/make_bert_shards.py), so a
        random model has none here: export.py says so, and which folder to copy in."""
        d = self.cfg.model.pretrained_dir
        if not d or not os.path.isfile(os.path.join(d, "tokenizer_config.json")):
            return None
        return open_tokenizer(d)

    def metrics(self, totals: dict) -> dict:
        tokens, seqs = max(totals["mlm_tokens"], 1), max(totals["sequences"], 1)
        return {"loss": totals["objective_sum"] / seqs, "mlm_loss": totals["mlm_loss_sum"] / tokens,
                "mlm_accuracy": totals["mlm_correct"] / tokens, "nsp_loss": totals["nsp_loss_sum"] / seqs,
                "nsp_accuracy": totals["nsp_correct"] / seqs, "sequences": int(totals["sequences"])}


def masked_mean_per_row(values: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Mean of `values` grouped by `rows` (0 for a row without values): [n_rows]."""
    sums = torch.zeros(n_rows, device=values.device, dtype=values.dtype).index_add_(0, rows, values)
    counts = torch.zeros(n_rows, device=values.device, dtype=values.dtype).index_add_(
        0, rows, torch.ones_like(values))
    return sums / counts.clamp(min=1)
