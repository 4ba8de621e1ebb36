"""Write small synthetic data for the three text tasks, to try the pipeline (and for the tests).

    python scripts/make_sample_text_data.py data/sample     # -> data/sample/{sst2,gpt2,bert_text.txt}

- sst2/{train,dev,test}.tsv: `sentence<TAB>label` reviews whose label follows from the adjectives they contain
- gpt2/train.json, gpt2/dev.json: JSON arrays of short stories from a small grammar
- bert_text.txt: one sentence per line, a blank line between documents (input of make_bert_shards.py)
The text is made up and tiny; it only shows that losses fall and files are read and written correctly.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

POSITIVE = ["good", "great", "wonderful", "moving", "funny", "brilliant", "charming", "beautiful"]
NEGATIVE = ["bad", "dull", "boring", "awful", "tedious", "clumsy", "lifeless", "ugly"]
NOUNS = ["film", "movie", "story", "plot", "cast", "script", "ending", "music"]
SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a bird", "the king", "our neighbour"]
VERBS = ["sees", "likes", "finds", "follows", "paints", "calls", "visits", "helps"]
PLACES = ["in the park", "at home", "by the river", "in the city", "on the hill", "at school"]


def review(rng: random.Random) -> tuple[str, int]:
    label = rng.randrange(2)
    words = POSITIVE if label else NEGATIVE
    sentence = f"the {rng.choice(NOUNS)} is {rng.choice(words)}"
    if rng.random() < 0.7:
        sentence += f" and the {rng.choice(NOUNS)} is {rng.choice(words)}"
    return sentence + " .", label


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(SUBJECTS)} {rng.choice(PLACES)} ."


def write_sst2(folder: str, rng: random.Random, sizes=(400, 100, 100)) -> str:
    os.makedirs(folder, exist_ok=True)
    for name, n in zip(("train", "dev", "test"), sizes):
        with open(os.path.join(folder, f"{name}.tsv"), "w") as f:
            f.write("sentence\tlabel\n")
            for _ in range(n):
                text, label = review(rng)
                f.write(f"{text} \t{label}\n")  # the space before the tab, as in real SST-2
    return folder


def write_gpt2(folder: str, rng: random.Random, sizes=(300, 40)) -> str:
    os.makedirs(folder, exist_ok=True)
    for name, n in zip(("train", "dev"), sizes):
        texts = [" ".join(sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(n)]
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(texts, f)
    return folder


def write_bert_text(path: str, rng: random.Random, documents: int = 200) -> str:
    with open(path, "w") as f:
        for _ in range(documents):
            for _ in range(rng.randint(3, 8)):
                f.write(sentence(rng) + "\n")
            f.write("\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write small synthetic data for the sst2, gpt2_lm and bert_pretrain "
                                            "tasks: <folder>/{sst2,gpt2,bert_text.txt}.")
    p.add_argument("folder", nargs="?", default="data/sample", help="where to write (default data/sample)")
    out = p.parse_args(argv).folder  # (argv[0] once was the folder: --help wrote the data into ./--help)
    rng = random.Random(0)
    try:
        print(write_sst2(os.path.join(out, "sst2"), rng))
        print(write_gpt2(os.path.join(out, "gpt2"), rng))
        print(write_bert_text(os.path.join(out, "bert_text.txt"), rng))
    except OSError as e:  # a file where a folder goes, no permission, a full disk: one line, not a traceback
        print(f"error: {os.fsdecode(e.filename) if e.filename else out}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
