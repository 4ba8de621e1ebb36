"""Sample text from a trained gpt2_lm checkpoint (any tokenizer and decoder it trains), or from an export of one.

    python generate.py --params configs/gpt2_lm.yml --prompt "Once upon a time" --max-new-tokens 20
    python generate.py --params configs/gpt2_lm.yml --checkpoint runs/gpt2_lm/checkpoints/step-400 --prompt "..."
    python generate.py --export runs/gpt2_lm/export --prompt "..."

With --params the model is rebuilt from the training config and the checkpoint (default: the best one in
output_dir), as test mode does; with --export, model and tokenizer come from the exported folder alone.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from core import checkpoint, checkpoint_io, checkpoint_meta
from core.errors import UserError
from tasks import lora
from tasks.text_common import plain_transformers_output
from wiring import TASKS, build_task, checked_config


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Sample text from a gpt2_lm checkpoint.")
    p.add_argument("--params", help="the YAML config the model was trained with")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--checkpoint", default=None, help="a step-N checkpoint folder (default: best in output_dir)")
    p.add_argument("--export", default=None, metavar="FOLDER",
                   help="instead of --params: a folder written by mode: export (any causal LM Hugging Face folder)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (always the likeliest token)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def sample(model, ids, max_new_tokens: int, temperature: float, top_k: int, context: int):
    """Append tokens one at a time. While the text fits in the context window, the model's key/value cache
    means each step runs only the newest token; beyond it, the window slides and the cropped sequence is re-run
    (cached keys carry absolute positions, so they cannot slide with it)."""
    past = None
    for _ in range(max_new_tokens):
        fits = ids.shape[1] < context  # the token appended now still gets a position inside the window
        if past is None:
            out = model(input_ids=ids[:, -context:], use_cache=fits)
        else:  # only set when the previous step fitted, so the newest token's position is in the window
            out = model(input_ids=ids[:, -1:], past_key_values=past, use_cache=True)
        past = out.past_key_values if fits else None
        logits = out.logits[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            # the likeliest at 0 before dividing, in float64: a tiny temperature gives -inf (never inf - inf = NaN)
            scaled = (logits - logits.max(-1, keepdim=True).values).double() / temperature
            nxt = torch.multinomial(torch.softmax(scaled, -1), 1)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def load_export(folder: str):
    """Model and tokenizer of an exported Hugging Face folder."""
    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config):
        raise UserError(f"--export {folder}: no config.json there; give a folder written by mode: export")
    with open(config) as f:
        kinds = json.load(f).get("architectures") or []
    if not any(k.endswith(("LMHeadModel", "ForCausalLM")) for k in kinds):  # else transformers would build a
        raise UserError(f"--export {folder}: holds {', '.join(kinds) or 'no model class'}, not a causal language "
                        "model (export a gpt2_lm run)")                   # causal LM around it, untrained head
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain_transformers_output()  # no loading bars between the samples
    try:
        return (AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False),
                AutoTokenizer.from_pretrained(folder, trust_remote_code=False))
    except (OSError, ValueError) as e:  # not a causal LM, no tokenizer files, ...
        raise UserError(f"--export {folder}: not a causal language model with its tokenizer "
                        f"({str(e).strip().splitlines()[0]})") from None


def load_checkpoint(args):
    """Model and tokenizer of a checkpoint, rebuilt from the training config (as test mode does)."""
    cfg = checked_config(args.params, args.set)
    if not TASKS[cfg.task].generates_text:  # (the task says so: Task.generates_text)
        raise UserError(f"{args.params}: generate.py needs a task that generates text (gpt2_lm), not {cfg.task!r}")
    path = args.checkpoint or checkpoint_meta.best_recorded(cfg.output_dir, named_by="--checkpoint")
    if path is None:
        raise UserError(f"{checkpoint.root(cfg.output_dir)}: no checkpoint; train first or pass --checkpoint")
    task = build_task(cfg)
    tokenizer = task.load_tokenizer()
    model = lora.adapt(task.build_model(), cfg)  # model.lora_rank: the base, the checkpoint's adapters over it
    if checkpoint_io.load_model(model, path, cfg, vocabulary_sha256=task.vocabulary_sha256()) == "ema":  # said, as test mode says it (stdout holds the text)
        print(f"sampling from the weight average of {path} (ema.pt: {checkpoint_io.why_average(cfg)})",
              file=sys.stderr)
    return lora.merged(model), tokenizer


def encode_prompt(tokenizer, prompt: str) -> tuple[list[int], int]:
    """The prompt's ids (empty: the start of a text), and where its own text starts among them. A character the
    tokenizer cannot encode (a char tokenizer knows only its training text's) would silently become <|endoftext|>:
    refused, naming it. Special tokens the tokenizer puts after a text (BART's </s>) are left off: the model would
    read the prompt as a finished document; those before it (<s>) stay, as training texts began with them."""
    wrapped, plain = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    before = next((i for i in range(len(wrapped) - len(plain) + 1) if wrapped[i:i + len(plain)] == plain), 0)
    ids = tokenizer(prompt)["input_ids"]
    ids = ids[:len(ids) - (len(wrapped) - before - len(plain))]
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids and tokenizer.unk_token not in prompt:
        unknown = sorted({c for c in prompt if tokenizer(c, add_special_tokens=False)["input_ids"] == [unk]})
        if unknown:
            raise UserError(f"--prompt holds characters the tokenizer does not know: {', '.join(map(repr, unknown))} "
                            "(each would be read as its unknown token); leave them out")
    return (ids or [tokenizer.eos_token_id]), (before if prompt else len(ids or [None]))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if (args.params is None) == (args.export is None):
            raise UserError("generate.py needs --params (a training config, for its checkpoints) or --export "
                            "(an exported folder), one of the two")
        if args.export and (args.checkpoint or args.set):
            raise UserError("--export takes the model from the folder: --checkpoint and --set go with --params")
        settings = {"--max-new-tokens": args.max_new_tokens, "--temperature": args.temperature, "--top-k": args.top_k}
        wrong = [name for name, value in settings.items() if not 0 <= value < float("inf")]  # NaN too
        if wrong:  # (torch would fail deep inside sampling, with a traceback)
            raise UserError(f"{', '.join(wrong)}: must be a finite number >= 0")
        model, tokenizer = load_export(args.export) if args.export else load_checkpoint(args)
        prompt, text_start = encode_prompt(tokenizer, args.prompt)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model.eval()
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = sample(model, torch.tensor([prompt]), args.max_new_tokens, args.temperature, args.top_k,
                     getattr(model.config, "n_positions", None) or model.config.max_position_embeddings)
    # The ids before the prompt's text (<|endoftext|> for no prompt, a start-of-text token) are no part of it.
    print(tokenizer.decode(out[0, text_start:].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
