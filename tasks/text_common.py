"""Helpers the text tasks share: where the tokenizer comes from, and rank-0-first file writing.

A tokenizer is either loaded from `model.pretrained_dir` (the checkpoint's own), or, for randomly initialised
models, trained once on the training texts and saved to `<output_dir>/tokenizer`. Later runs on the same
output_dir (resume, `mode: test`, generate.py) load that folder, so ids never change under a checkpoint.
"""
from __future__ import annotations

import codecs
import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
import time
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from core import checkpoint, disk_errors
from core.atomic_write import write_beside
from core.errors import ConfigError, DataError, first_line
from strategies.tp import PerRankDropout
from tasks.base import PipelineLayer
from tasks.untrusted_folders import check_folder, refuse_custom_code

DROPOUT_FIELDS = ("dropout", "dropout_prob", "dropout_rate", "pdrop")  # how transformers' configs name them

# from_pretrained's dtype: transformers 5 loads a folder in the one its config.json names (many are saved in bfloat16
# or float16); weights train in float32, and train.precision decides what the forward computes in.
WEIGHTS_DTYPE = torch.float32

# -----> size of the tokenizers trained for randomly initialised models (a small corpus may stop earlier).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # JSON's escape of half a UTF-16 pair
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what json.loads leaves of one without its other half
TRAINED_VOCAB_SIZE = 8000


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def note(message: str) -> None:
    """A message for the user, printed once (by rank 0)."""
    if is_main_process():
        print(message, flush=True)


def main_first(make: Callable[[], None]) -> None:
    """Run `make` on rank 0 while the other ranks wait, so a file is written once and then read by everyone."""
    if is_main_process():
        make()
    if dist.is_initialized():
        dist.barrier()


def tokenizer_dir(cfg) -> str:
    return os.path.join(cfg.output_dir, "tokenizer")


def load_or_train_tokenizer(cfg, texts: Optional[Callable[[], Iterable[str]]], kind: str,
                            folder_from: Optional[str] = None):
    """The tokenizer of this run: pretrained_dir's, else output_dir/tokenizer, else make one and save it there:
    `folder_from`'s (a Hugging Face tokenizer folder, copied), or one trained on `texts` (train_tokenizer's
    `kind`: gpt2, bpe, char or byte). What it was made as is saved beside it (made_as.json): a saved tokenizer of
    another kind is refused, and train.start_over makes a new one (the old folder is moved aside)."""
    plain_transformers_output()
    if cfg.model.pretrained_dir:
        folder = check_pretrained_dir(cfg.model.pretrained_dir)
        return with_vocabulary(open_tokenizer(folder), folder)
    folder = tokenizer_dir(cfg)
    saved = lambda: os.path.isfile(os.path.join(folder, "tokenizer.json"))  # noqa: E731
    asked = {"kind": "folder", "folder": os.path.abspath(folder_from)} if folder_from else {"kind": kind}
    if texts is None or cfg.mode in ("test", "predict"):  # the training run must have saved one
        if not saved():
            raise DataError(f"{folder}: no tokenizer saved there; train first (it is written by the training run) "
                            "or set model.pretrained_dir")
    else:
        def make():  # rank 0 decides and writes; every rank takes part in the barrier either way
            if saved() and cfg.train.start_over:  # a new run: its tokenizer is made from its own texts
                os.rename(folder, aside := f"{folder}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
                note(f"start over: moved the previous run's tokenizer aside to {aside}")
            if not saved():
                made = load_tokenizer_folder(folder_from) if folder_from else train_tokenizer(texts(), kind)
                with disk_errors.name_unnamed_errors(folder + ".part"):  # (a full disk's error may name no file)
                    made.save_pretrained(folder + ".part")
                    with open(os.path.join(folder + ".part", MADE_AS), "w") as f:
                        json.dump(asked, f)
                os.replace(folder + ".part", folder)  # never a half-written folder under the final name
        main_first(make)
        check_made_as(folder, asked)
    # Always load from the folder (transformers 5 pitfall: building BertTokenizerFast(vocab_file=...) directly
    # silently gives a 5-token vocabulary; from_pretrained(folder) reads the full tokenizer.json).
    return open_tokenizer(folder, "the saved tokenizer")


def open_tokenizer(folder: str, key: str = "model.pretrained_dir"):
    """AutoTokenizer.from_pretrained(folder), never running the folder's code; what it cannot read is one line
    naming `key` and the folder. A sentencepiece file it cannot read (the package missing, the file damaged) ended in
    a traceback asking for tiktoken, the last format transformers tries."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, ImportError) as e:
        pieces = sorted(n for n in os.listdir(folder) if n.endswith(".model"))
        why = first_line(e)
        if pieces and "tiktoken" in str(e):
            why = (f"{pieces[0]} is a sentencepiece model: install the sentencepiece package (requirements.txt)"
                   if importlib.util.find_spec("sentencepiece") is None else
                   f"{pieces[0]}, a sentencepiece model, could not be read: damaged, or not sentencepiece's")
        raise DataError(f"{key} {folder}: its tokenizer could not be loaded ({why})") from None


def saved_words(cfg, make: Callable[[], list[str]]) -> list[str]:
    """A word-level vocabulary (csv_text's), in id order, kept beside the checkpoints as the tokenizer is: where the
    weights come from a checkpoint (test, predict, export, a resume) the saved one, so that a training file edited
    since cannot give its words other ids under them; else `make()`'s, saved (a run saved before this file: made)."""
    path = os.path.join(cfg.output_dir, VOCABULARY)
    made = functools.cache(make)  # (a fresh run writes the words it returns: made once)

    def save():  # rank 0 decides and writes, the other ranks wait: every rank then reads the same file
        # a fresh run's own, or a start over's; never under checkpoints that read the saved one (lr_find trains too)
        if os.path.isfile(path) and not cfg.train.start_over and checkpoint.latest(cfg.output_dir):
            return
        if os.path.isfile(path) and cfg.train.start_over:  # the previous run's goes aside with its checkpoints
            os.rename(path, aside := f"{path}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            note(f"start over: moved the previous run's vocabulary aside to {aside}")
        os.makedirs(cfg.output_dir, exist_ok=True)
        write_beside(path, lambda f: json.dump(made(), f))
    if cfg.mode == "train":
        main_first(save)
    if not (weights_from_checkpoint(cfg) and os.path.isfile(path)):
        return made()
    return read_words(path)


def read_words(path: str) -> list[str]:
    """A vocabulary saved_words kept (a JSON list of words), checked."""
    with open(path, "rb") as f:
        try:
            words = json.loads(f.read().decode("utf-8"))
        except ValueError:
            words = None
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise DataError(f"{path}: unreadable (not a JSON list of words); train.start_over=true makes a new run")
    return words


VOCABULARY = "vocabulary.json"  # in output_dir: saved_words's


MADE_AS = "made_as.json"  # in the tokenizer folder: {"kind": gpt2 | bpe | char | byte | folder, "folder": PATH}


def check_made_as(folder: str, asked: dict) -> None:
    """The saved tokenizer is the kind this run asks for: another kind's ids would be read as this one's, and
    checkpoints trained on them continued, with no error (a folder saved before made_as.json existed passes)."""
    path = os.path.join(folder, MADE_AS)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        made = json.load(f)
    if made != asked:
        name = lambda m: m.get("folder") or TOKENIZER_NAMES.get(m.get("kind"), m.get("kind"))  # noqa: E731
        raise DataError(f"{folder}: holds a tokenizer made as {name(made)}, but data.tokenizer asks for "
                        f"{name(asked)}; set train.start_over=true (moves the old run aside) or use another "
                        "output_dir")


TOKENIZER_NAMES = {"gpt2": "bpe (gpt2_lm's)", "bpe": "bpe (BART's special tokens)", "char": "char", "byte": "byte"}


def load_tokenizer_folder(folder: str):
    """A Hugging Face tokenizer folder given as data.tokenizer; one that has no end-of-text token cannot separate
    documents, so it is refused here rather than failing inside the data pipeline."""
    if not os.path.isdir(folder):
        raise DataError(f"data.tokenizer: {folder!r} is neither bpe, char, byte nor a tokenizer folder")
    refuse_custom_code(folder, "data.tokenizer")
    tokenizer = open_tokenizer(folder, "data.tokenizer")
    with_vocabulary(tokenizer, folder, "data.tokenizer")
    if tokenizer.eos_token_id is None:
        raise DataError(f"data.tokenizer: {folder}'s tokenizer has no end-of-text (eos) token to separate texts")
    return tokenizer


def with_vocabulary(tokenizer, folder: str, key: str = "model.pretrained_dir"):
    """`tokenizer`, loaded from `folder`, unless it holds only its special tokens: from a folder without tokenizer
    files (config.json and weights only) transformers 5 makes such a one, with no error, and every word is unknown."""
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise DataError(f"{key}: {folder} holds no tokenizer files; transformers made one of only its {len(tokenizer)} "
                        "special tokens (every word unknown): save the model's tokenizer there too "
                        "(tokenizer.save_pretrained)")
    return tokenizer


def train_tokenizer(texts: Iterable[str], kind: str):
    """A tokenizer for `texts`, wrapped for transformers (generate.py, exports and pipelines load it as any other):
    `gpt2` a byte-level BPE with <|endoftext|>, `bpe` the same with BART's special tokens, `char` one id per
    character of the texts (nanoGPT's shakespeare_char), `byte` one id per byte (256) + <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    if kind in ("char", "byte"):
        return char_tokenizer(texts) if kind == "char" else byte_tokenizer()
    if kind == "gpt2":
        specials = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                    "pad_token": "<|endoftext|>"}
        special_list = ["<|endoftext|>"]
    else:  # BART's ids: <s>=0, <pad>=1, </s>=2, <unk>=3, as BartConfig's defaults expect
        specials = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                    "mask_token": "<mask>"}
        special_list = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB_SIZE, special_tokens=special_list,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(pieces(texts), trainer)
    if kind != "gpt2":  # sequence classification with BART reads the final </s>: wrap every text as <s> ... </s>
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1024, **specials)


PIECE_CHARS = 1 << 20


def pieces(texts: Iterable[str]) -> Iterable[str]:
    """The texts for the BPE trainer, a long one cut before a space into pieces of about PIECE_CHARS characters:
    one long text costs the trainer about 80 bytes of memory per character (a 57 MiB text: 4.5 GiB; a 2 GB text
    aborted it), its pieces a few hundred MiB in all; the words it counts are the same (a cut keeps the space
    with the word after it, as the byte-level pre-tokenizer does)."""
    for text in texts:
        start = 0
        while len(text) - start > PIECE_CHARS:
            cut = text.rfind(" ", start + 1, start + PIECE_CHARS)
            cut = cut if cut > start else start + PIECE_CHARS
            yield text[start:cut]
            start = cut
        yield text[start:] if start else text


def char_tokenizer(texts: Iterable[str]):
    """Ids 0..V-1 for the texts' characters in sorted order (nanoGPT's stoi), then <|endoftext|> (also what an
    unseen character becomes). A BPE without merges splits a text into characters, much faster than a regex
    pre-tokenizer; Fuse joins them back without spaces."""
    from tokenizers import Tokenizer, decoders, models
    chars = sorted(set().union(*map(set, texts)))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOT] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token=EOT))
    tok.decoder = decoders.Fuse()
    return wrap_small_vocabulary(tok)


def byte_tokenizer():
    """Id b for byte b (its byte-level character: GPT-2's byte-to-unicode table), 256 for <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: b for b, c in byte_level_chars().items()}
    vocab[EOT] = 256
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return wrap_small_vocabulary(tok)


EOT = "<|endoftext|>"


def wrap_small_vocabulary(tok):
    """A char or byte tokenizer for transformers, with GPT-2's special tokens. No cleanup on decode: it would
    remove the space before punctuation, and these tokenizers give back the text exactly."""
    from transformers import PreTrainedTokenizerFast
    tok.add_special_tokens([EOT])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 30, bos_token=EOT, eos_token=EOT,
                                   unk_token=EOT, pad_token=EOT, clean_up_tokenization_spaces=False)


def byte_level_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: each byte as a printable character (what ByteLevel pre-tokenizers emit)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def json_lines(path: str, text: Optional[str] = None, lines: Optional[Iterable[str]] = None) \
        -> Iterable[tuple[int, object]]:
    """A JSON lines file's values with their line numbers (blank lines skipped); bad JSON names its line. `lines`:
    the file's lines as utf8_lines streams them (mode predict), instead of its whole `text`."""
    if lines is None:
        lines = (read_utf8(path) if text is None else text).split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not valid JSON at column {e.colno} ({e.msg}); JSON lines hold one "
                            "value per line") from None
        if SURROGATE_ESCAPE.search(line):  # json.loads joins a whole pair; half of one stays, a tokenizer's TypeError
            lone = LONE_SURROGATE.search(json.dumps(value, ensure_ascii=False))
            if lone:
                raise DataError(f"{path}:{number}: \\u{ord(lone.group()):04x} is half of a UTF-16 pair (a text cut "
                                "inside an emoji?), not a character; the file must hold whole characters")
        yield number, value


def read_utf8(path: str) -> str:
    """The text of `path`, decoded as strict UTF-8 in one call (a leading byte-order mark is dropped), with line
    ends made `\\n` (`\\r\\n` and a lone `\\r` too, as Python's text mode reads them). Invalid bytes are a DataError
    naming the line and column: decoding lazily line by line would instead raise a UnicodeDecodeError traceback
    that names neither (text mode decodes 8 KB blocks at a time, far ahead of the line being read)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = str(memoryview(data)[start:], "utf-8")  # no copy of the bytes; the error path below is the slow one
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{utf8_error_where(data, start, start + e.start, start + e.end)}") from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def utf8_lines(path: str) -> Iterator[str]:
    """The lines of `path` as read_utf8 splits its text (each without its `\\n`), a line at a time: mode predict
    holds one line, not the file, whatever its line ends (universal newlines: a file of lone `\\r`, Excel's `CSV
    (Macintosh)`, was one line read whole when bytes were split at `\\n`). A bad byte is read_utf8's DataError,
    naming its line and column: decoded with surrogateescape, it stays in its line, where encoding finds it."""
    try:
        f = open(path, encoding="utf-8-sig", errors="surrogateescape", newline=None)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    with f:
        line = "\n"  # (an empty file: one empty line, as read_utf8's split gives)
        for number, line in enumerate(f, 1):
            try:
                line.encode("utf-8")  # (a lone surrogate: a byte surrogateescape kept, undecoded)
            except UnicodeEncodeError:
                raise DataError(f"{path}:{number}: {line_error(line)}") from None
            yield line[:-1] if line.endswith("\n") else line
        if line.endswith("\n"):
            yield ""  # (after a last line end: the empty line read_utf8's split ends with too)


def line_error(line: str) -> str:
    """utf8_error_where's words for a line utf8_lines decoded with surrogateescape: its first bad bytes."""
    data = line.encode("utf-8", "surrogateescape")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return utf8_error_where(data, 0, e.start, e.end).split(": ", 1)[1]
    raise AssertionError("a line without bad bytes")


def utf8_error_where(data: bytes, start: int, bad: int, bad_end: int) -> str:
    """`LINE: not valid UTF-8 (byte 0xff at column C)` for the invalid bytes data[bad:bad_end]; lines counted as
    read_utf8 splits them, the column in characters (what an editor shows: all before the bad byte is valid)."""
    head = data[start:bad].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    line_start = head.rfind(b"\n") + 1
    column = len(head[line_start:].decode("utf-8")) + 1
    shown = data[bad:max(bad_end, bad + 1)]
    what = f"byte 0x{shown.hex()}" if len(shown) == 1 else "bytes " + " ".join(f"0x{b:02x}" for b in shown)
    line = head.count(b"\n") + 1
    return f"{line}: not valid UTF-8 ({what} at column {column}); the file must be saved as UTF-8"


def plain_transformers_output() -> None:
    """transformers draws loading bars and colours its load report with terminal escape codes, even when its
    output goes to a file: in a log file both are noise. Bars off; colours kept on a terminal, stripped elsewhere
    (the report's text stays). Called before the text tasks load anything; idempotent."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # transformers' bars, and huggingface_hub's
    hf_logging.get_verbosity()  # makes sure transformers has installed its console handler
    for handler in logging.getLogger("transformers").handlers:
        if not any(isinstance(f, _PlainText) for f in handler.filters):
            handler.addFilter(_PlainText(handler))


class _PlainText(logging.Filter):
    """Strips ANSI escape codes (ESC[1m ...) from records written by `handler`, unless it writes to a terminal."""
    ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        try:  # a closed stream raises here, and logging lets a filter's error end the caller: no terminal then
            terminal = self.handler.stream.isatty()
        except (AttributeError, ValueError):
            terminal = False
        if not terminal:
            record.msg, record.args = self.ANSI.sub("", record.getMessage()), None
        return True


def weights_from_checkpoint(cfg) -> bool:
    """The model built now gets a checkpoint's weights next (test, export, a run that resumes), not only the
    pretrained folder's."""
    if cfg.mode != "train":
        return True
    which = False if cfg.train.start_over else cfg.train.resume
    return bool(which) and (which != "auto" or checkpoint.latest(cfg.output_dir) is not None)


@contextlib.contextmanager
def load_report(cfg):
    """Around from_pretrained: transformers reports the weights the folder lacks as "newly initialized", true
    when training starts from the folder, misleading when a checkpoint's weights replace them next: silenced then
    (errors still show)."""
    if not weights_from_checkpoint(cfg):
        yield
        return
    # A filter, not the logger's level: transformers reads that level to decide on other warnings.
    logger = logging.getLogger("transformers.modeling_utils")  # where transformers logs the report
    only_errors = _OnlyErrors()
    logger.addFilter(only_errors)
    try:
        yield
    finally:
        logger.removeFilter(only_errors)


class _OnlyErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def pretrained_dropout(cfg, config) -> dict:
    """model.dropout for model.pretrained_dir's model: its config's dropout probabilities (BERT's hidden_dropout_prob,
    BART's dropout, GPT-2's resid_pdrop, ...) as from_pretrained's keyword arguments; null: none (the folder's own).
    A dropout > 0 for a model without any is one line: it could not apply. Only training needs it (test, predict and
    export run in eval mode, and read the configs of runs saved when model.dropout was 0.25 by default)."""
    p = cfg.model.dropout
    if p is None or cfg.mode not in ("train", "lr_find"):
        return {}
    fields = {name: p for name, value in vars(config).items()
              if name.endswith(DROPOUT_FIELDS) and isinstance(value, (int, float)) and not isinstance(value, bool)}
    if not fields and p > 0:
        raise ConfigError(f"model.dropout is {p} but model.pretrained_dir's {config.model_type} model has no dropout "
                          "to set; set it to null (or 0)")
    return fields


def check_pretrained_dir(path: str) -> str:
    plain_transformers_output()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise DataError(f"model.pretrained_dir: {path}/config.json not found. Download a checkpoint with "
                        f"`python scripts/download_pretrained.py MODEL_ID {path}` (needs network), point it at "
                        "another Hugging Face folder, or set it to null for a random model")
    check_folder(path)  # no code from the folder runs, no pickle in it executes: one line, before transformers
    return path


def bert_pipeline_layers(bert, head) -> list:
    """A transformers BertModel (BERT, MiniLM, ...) as a pipeline chain (Task.pipeline_layers): embeddings, each
    encoder layer, then `head`, a PipelineLayer taking (hidden states, attention mask). This is what BertModel.forward
    does, link by link. The attention mask travels along with the hidden states, as 0/1 integers: a float
    tensor between stages would be taken for an activation that needs a gradient."""

    def embed(input_ids, attention_mask, token_type_ids=None):
        return bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids), attention_mask

    def encoder_layer(layer):
        def run(hidden, attention_mask):
            # The additive mask BertModel builds once, rebuilt per layer (cheap) so that no stage needs another's;
            # for all the positions (under sequence parallelism `hidden` holds this rank's share of them).
            whole = hidden.new_empty(*attention_mask.shape, 1)
            mask, _ = bert._create_attention_masks(attention_mask=attention_mask, encoder_attention_mask=None,
                                                   embedding_output=whole, encoder_hidden_states=None,
                                                   past_key_values=None)
            return layer(hidden, mask, None), attention_mask  # positional, as BertEncoder calls it (the tp plan's layouts)
        return PipelineLayer(run, layer)
    return [PipelineLayer(embed, bert.embeddings), *[encoder_layer(x) for x in bert.encoder.layer], head]


def bart_pipeline_layers(bart, head) -> list:
    """A transformers BartModel (encoder-decoder) as a pipeline chain: encoder embeddings, each encoder layer,
    decoder embeddings, each decoder layer, then `head`, a PipelineLayer taking (decoder hidden states, attention mask,
    input ids). This is BartModel.forward link by link, with decoder inputs = input ids shifted right (what BART
    does when given none). Through the encoder the chain carries (hidden, mask, ids); through the decoder
    (hidden, encoder output, mask, ids), since every decoder layer attends to the encoder output (its gradient
    flows back through every decoder stage). The last decoder layer drops the encoder output: a stage input that
    gets no gradient would stall the pipeline's backward. Masks and ids travel as integers (no gradient)."""
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
    from transformers.models.bart.modeling_bart import shift_tokens_right

    config, encoder, decoder = bart.config, bart.encoder, bart.decoder

    def embed(part, ids):
        inputs = part.embed_tokens(ids)
        positions = part.embed_positions(ids, 0, position_ids=torch.arange(ids.shape[1], device=ids.device))
        hidden = part.layernorm_embedding(inputs + positions.to(inputs.device))
        # in the mode of the stage (its link holds layernorm_embedding), not of the encoder or decoder, which none holds
        return torch.nn.functional.dropout(hidden, p=part.dropout, training=part.layernorm_embedding.training)

    def encoder_embed(input_ids, attention_mask):
        return embed(encoder, input_ids), attention_mask, input_ids

    def encoder_layer(layer):
        def run(hidden, attention_mask, input_ids):
            mask = create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask)
            return layer(hidden, mask), attention_mask, input_ids
        return PipelineLayer(run, layer)

    def decoder_embed(encoded, attention_mask, input_ids):
        decoder_ids = shift_tokens_right(input_ids, config.pad_token_id, config.decoder_start_token_id)
        return embed(decoder, decoder_ids), encoded, attention_mask, input_ids

    def decoder_layer(layer, last):
        def run(hidden, encoded, attention_mask, input_ids):
            ones = torch.ones(hidden.shape[:2], device=hidden.device)  # what the decoder uses when given no mask
            causal = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=ones,
                                        past_key_values=None)
            cross = create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask,
                                              encoder_hidden_states=encoded)
            hidden = layer(hidden, causal, encoded, encoder_attention_mask=cross)
            return (hidden, attention_mask, input_ids) if last else (hidden, encoded, attention_mask, input_ids)
        return PipelineLayer(run, layer)
    n = len(decoder.layers)
    return [PipelineLayer(encoder_embed, encoder.embed_tokens, encoder.embed_positions, encoder.layernorm_embedding),
            *[encoder_layer(x) for x in encoder.layers],
            PipelineLayer(decoder_embed, decoder.embed_tokens, decoder.embed_positions, decoder.layernorm_embedding),
            *[decoder_layer(x, i == n - 1) for i, x in enumerate(decoder.layers)], head]


def bert_tp_plan(model: torch.nn.Module, tp: int, sequence_parallel: bool = False) -> dict:
    """Megatron's split of every BERT layer in `model` (BERT, MiniLM, RoBERTa-style: attention.self.query/key/value
    and intermediate.dense by columns, attention.output.dense and output.dense by rows). The attention reshapes to
    (-1 heads, head size), so each rank simply computes its own heads. sequence_parallel: bert_sequence_plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    rows = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())  # summed and cut, or whole
    plan, layers = {}, []
    for name, m in model.named_modules():
        attention = getattr(getattr(m, "attention", None), "self", None)
        if attention is None or not hasattr(attention, "query") or not hasattr(m, "intermediate"):
            continue
        heads, hidden = attention.num_attention_heads, m.intermediate.dense.out_features
        if heads % tp or hidden % tp:
            raise ConfigError(f"dist.tp: {tp} does not divide the model's {heads} attention heads and {hidden} MLP "
                              "units; pick a divisor of both")
        layers.append(name)
        plan.update({f"{name}.attention.self.{x}": ColwiseParallel() for x in ("query", "key", "value")})
        plan.update({f"{name}.attention.output.dense": rows, f"{name}.intermediate.dense": ColwiseParallel(),
                     f"{name}.output.dense": rows})
    if not plan:
        raise ConfigError(f"dist.tp: found no BERT layers (attention.self.query, intermediate) in the "
                          f"{type(model).__name__} model to split; use dist.tp: 1")
    plan = {**plan, **bert_sequence_plan(layers)} if sequence_parallel else plan
    return bert_own_dropout(model, layers, plan, sequence_parallel)


def bert_own_dropout(model: torch.nn.Module, layers: list, plan: dict, sequence_parallel: bool) -> dict:
    """Where dropout sees split data, each rank draws its own masks (strategies/tp.PerRankDropout): the attention
    probabilities of its own heads, and under sequence parallelism the hidden dropout on its own positions."""
    for name in layers:
        layer = model.get_submodule(name)
        split = {"attention.self": layer.attention.self.dropout.p}  # the attention function reads its p
        if sequence_parallel:
            split.update({"attention.output.dropout": layer.attention.output.dropout.p,
                          "output.dropout": layer.output.dropout.p})
        for key, p in split.items():
            if p > 0:
                plan[f"{name}.{key}"] = PerRankDropout(plan.get(f"{name}.{key}"))
    return plan


def bert_sequence_plan(layers: list) -> dict:
    """Sequence parallelism for post-LN BERT layers: between the row splits' reduce-scatter and the next column
    splits' all-gather each rank holds T / tp positions, so the dropout + LayerNorm(x + residual) of
    attention.output and output run on them. The first layer cuts its input, the last gathers its output whole
    for the heads and the pooler (the embeddings and the attention mask stay whole: the mask is built from them)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
                                                   SequenceParallel)
    whole, cut = (Replicate(),), (Shard(1),)
    gather = dict(input_layouts=cut, desired_input_layouts=whole, use_local_output=True)
    plan = {}
    for name in layers:
        plan.update({f"{name}.attention.output.LayerNorm": SequenceParallel(use_local_output=True),
                     f"{name}.output.LayerNorm": SequenceParallel(use_local_output=True),
                     f"{name}.attention.self": PrepareModuleInput(**gather),  # hidden_states, its first argument
                     f"{name}.intermediate": PrepareModuleInput(**gather)})
    first, last = layers[0], layers[-1]
    whole_in, cut_in = (*whole, None, None), (*cut, None, None)  # BertLayer(hidden_states, mask, encoder states)
    if first == last:  # one layer: it both cuts its input and gathers its output
        plan[first] = PrepareModuleInputOutput(input_layouts=whole_in, desired_input_layouts=cut_in,
                                               use_local_input=True, output_layouts=cut, desired_output_layouts=whole)
    else:
        plan[first] = PrepareModuleInput(input_layouts=whole_in, desired_input_layouts=cut_in, use_local_output=True)
        plan[last] = PrepareModuleOutput(output_layouts=cut, desired_output_layouts=whole, use_local_output=True)
    return plan


def pad_positions(batch: dict, multiple: int, fill: dict) -> dict:
    """The batch's [B, T] tensors padded on the right to a multiple of `multiple` positions (sequence parallelism
    cuts T into dist.tp equal pieces); `fill`: a key's padding value where it is not 0. The padding is masked out."""
    extra = -batch["input_ids"].shape[1] % multiple
    if not extra:
        return batch
    return {k: (torch.nn.functional.pad(v, (0, extra), value=fill.get(k, 0)) if v.dim() == 2 else v)
            for k, v in batch.items()}
