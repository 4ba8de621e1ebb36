"""csv_text's bag of words as a Hugging Face folder that `pipeline("text-classification", model=folder)` reads
with no code of ours (no trust_remote_code): the same predictions as the checkpoint, within float rounding.

The model is `mean over words of embedding(word)`, then a linear layer: the logits are the mean over the words of
`W @ embedding(word) + b`, a vector per word. transformers' EuroBERT classifier with no layers and "late" pooling
computes exactly such a mean over the (unpadded) tokens of a per-token vector, RMSNorm -> dense -> GELU ->
classifier of its embedding; the per-token vectors are chosen so that this chain gives each word's logits:

    embedding row j = [t_j + offset, c_j]   t_j = W e_j + b (the word's logits), offset puts every entry >= 8,
                                            c_j makes every row's norm the same, so RMSNorm only scales it
    norm weight      = that scale's inverse (RMSNorm gives the row back)
    dense            = identity on the logits, 0 on c    GELU(x) = x for x >= 8 (to float32 precision)
    classifier       = identity, bias -offset           -> t_j, averaged over the text's words by the pooling

The tokenizer is csv_text's: lower case, the runs of [a-z0-9'] as words, ids from its vocabulary (1: a word training
never saw); a text without any word is one unknown word, as csv_text reads it (but an empty string has no tokens
there, and gives NaN: pass at least one character).
"""
from __future__ import annotations

import itertools
import math
import os

import torch
from torch import nn

from core.errors import UserError
from tasks.table_files import EncodedLazily, in_chunks, text_stream
from tasks.text_common import VOCABULARY, read_words

FLOOR = 8.0  # GELU(x) == x in float32 from about 6 on: x * Phi(x) with Phi(x) rounding to 1


class BagOfWordsExport:
    """What mode export's `hf` format (and mode predict) asks a task (tasks/base.py), for csv_text: its model as below, its words
    and vocabulary (`vocab`) as a tokenizer, the label names (`classes`) in config.json."""
    export_formats, hf_pipeline = ("hf", "onnx"), "text-classification"
    reads_new_inputs = True  # predict_chunks below

    def hf_model(self, model: nn.Module):
        return hf_classifier(model, self.classes)

    def hf_tokenizer(self):
        return hf_tokenizer(self.vocab, self.cfg.data.max_length)

    def prepare_inference(self, label_names):  # predict, export: the checkpoint's classes, the run's vocabulary
        saved = os.path.join(self.cfg.output_dir, VOCABULARY)
        if label_names is None or not os.path.isfile(saved):  # a run older than both records: the training file's
            self.build_datasets()
            return
        self.classes, self.vocab = list(label_names), word_ids(read_words(saved))

    def predict_chunks(self, path, size):  # mode: predict: a file of texts (text_stream), encoded as training's were,
        for texts in in_chunks(text_stream(path, self.cfg.data.text_column), size):  # each by the rank predicting it
            yield texts, EncodedLazily(texts, self.encode_input)

    def encode_input(self, text):  # one new text, encoded as training's were (encode; its label unused)
        return self.encode("predict", [text], [self.classes[0]])[0]

    def predict_logits(self, model, batch):
        return model(batch["ids"])


def word_ids(words: list[str]) -> dict[str, int]:
    """csv_text's ids of its vocabulary's words: 2, 3, ... (0 pads, 1 is a word training never saw)."""
    return {w: i for i, w in enumerate(words, 2)}


def hf_classifier(model: nn.Module, names: list[str]):
    """The EuroBertForSequenceClassification equal to csv_text's model (EmbeddingBag, Dropout, Linear)."""
    from transformers import EuroBertConfig, EuroBertForSequenceClassification
    parts = list(model.children()) if isinstance(model, nn.Sequential) else []
    if not (parts and isinstance(parts[0], nn.EmbeddingBag) and parts[0].mode == "mean"
            and isinstance(parts[-1], nn.Linear) and all(isinstance(p, nn.Dropout) for p in parts[1:-1])):
        raise UserError(f"export: the hf format converts csv_text's bag of words (EmbeddingBag mean, Dropout, "
                        f"Linear), not a {type(model).__name__} of other layers; write the task's hf_model")
    bag, linear = parts[0], parts[-1]
    with torch.no_grad():
        per_word = (bag.weight.double() @ linear.weight.double().T + linear.bias.double())  # [vocab, classes]
        offset = FLOOR - per_word.min(0).values.clamp(max=0)  # every entry of t_j + offset is >= FLOOR
        rows = per_word + offset
        squared = rows.square().sum(1)
        norm = squared.max() + 1.0
        rows = torch.cat([rows, (norm - squared).sqrt()[:, None]], 1)  # every row's squared norm is `norm`
    width, classes = rows.shape[1], per_word.shape[1]
    config = EuroBertConfig(vocab_size=rows.shape[0], hidden_size=width, intermediate_size=width,
                            num_hidden_layers=0, num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                            classifier_pooling="late", pad_token_id=0, bos_token_id=None, eos_token_id=None, mask_token_id=1,
                            rms_norm_eps=0.0, max_position_embeddings=1 << 20, num_labels=classes,
                            id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})
    hf = EuroBertForSequenceClassification(config).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(rows.float())
        hf.model.norm.weight.fill_(math.sqrt(norm / width))  # RMSNorm divides each row by sqrt(norm / width)
        hf.dense.weight.zero_()
        hf.dense.weight[:classes, :classes] = torch.eye(classes)
        hf.dense.bias.zero_()
        hf.classifier.weight.zero_()
        hf.classifier.weight[:, :classes] = torch.eye(classes)
        hf.classifier.bias.copy_(-offset.float())
    return hf


def hf_tokenizer(vocab: dict[str, int], max_length: int):
    """csv_text's words() and vocabulary as a fast tokenizer: 0 pads, 1 is a word training never saw."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, **vocab}, unk_token="[UNK]"))
    # A text without a word (an emoji, "!!"): one unknown word, as csv_text reads it, not zero tokens (a NaN mean).
    unknown = next("'" * n for n in itertools.count(1) if "'" * n not in vocab)  # a word that training never saw
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(),
                                           normalizers.Replace(Regex(r"\A[^a-z0-9']*\z"), unknown)])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[a-z0-9']+"), behavior="removed", invert=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   model_max_length=max_length)  # pipeline(..., truncation=True) cuts there
