"""Download a Hugging Face checkpoint (weights + tokenizer) into a local folder for `model.pretrained_dir`.

    python scripts/download_pretrained.py                      # facebook/bart-base -> pretrained/bart-base
    python scripts/download_pretrained.py gpt2 pretrained/gpt2
    python scripts/download_pretrained.py bert-base-uncased pretrained/bert-base-uncased

Needs network access to the Hugging Face hub (run it on a login node, then copy the folder to the cluster).
Training never downloads anything: it reads the folder this writes.
"""
from __future__ import annotations

import argparse
import os
import sys

# Only what from_pretrained needs: config, tokenizer files and safetensors weights (not TF/Flax/ONNX copies).
PATTERNS = ["*.json", "*.txt", "*.model", "*.safetensors", "merges.txt", "vocab.*"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Fetch a Hugging Face checkpoint folder.")
    p.add_argument("model_id", nargs="?", default="facebook/bart-base", help="hub id (default facebook/bart-base)")
    p.add_argument("dest", nargs="?", default=None, help="target folder (default pretrained/<last part of id>)")
    p.add_argument("--revision", default=None, help="a branch, tag or commit of the hub repository")
    args = p.parse_args(argv)
    dest = args.dest or os.path.join("pretrained", args.model_id.split("/")[-1])
    from huggingface_hub import snapshot_download
    try:
        path = snapshot_download(repo_id=args.model_id, revision=args.revision, local_dir=dest,
                                 allow_patterns=PATTERNS)
    except Exception as e:  # offline, unknown id, no permission: one line, not a traceback
        print(f"error: could not download {args.model_id} ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
              file=sys.stderr)
        return 1
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"error: {path} has no config.json: not a transformers checkpoint", file=sys.stderr)
        return 1
    print(f"{args.model_id} -> {path}  (use it with --set model.pretrained_dir={path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
