"""The second half of `python main.py --help`: the modes, the presets of this clone, examples."""
from __future__ import annotations

import os


def epilog() -> str:
    # The presets are listed from the folder itself, so that --help names exactly the files a clone has.
    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    presets = sorted(f for f in os.listdir(configs) if f.endswith((".yml", ".yaml"))) if os.path.isdir(configs) else []
    return "\n".join([
        "modes (--set mode=...):",
        "  train    train (the default): checkpoints, logs, TensorBoard files and config.yml go to output_dir",
        "  test     evaluate the best checkpoint of output_dir (or test.checkpoint) on the dev and test splits,",
        "           in one process; writes <output_dir>/<split>_results.json",
        "  export   write that checkpoint for use outside this project (export.format; export.dir, by default",
        "           <output_dir>/export)",
        "  lr_find  a learning-rate range test: output_dir/lr_find.csv and lr_find.png, a suggested lr",
        "  predict  label new inputs (predict.input: a folder of images, or a file of texts) with",
        "           that checkpoint, in one process; writes <output_dir>/predictions.csv",
        "",
        "presets (--params configs/NAME.yml; each file's first lines say what it needs):",
        *(f"  configs/{name}" for name in presets),
        "",
        "parameters.yml lists every field with its default and a one-line comment (core/config.py: a docstring",
        "per field). An unknown or mistyped field is refused before anything starts.",
        "",
        "examples:",
        "  python main.py --params parameters.yml",
        "  python main.py --set dist.strategy=ddp --set dist.procs_per_node=2",
        "  python main.py --params parameters.yml --set mode=test",
        "  python main.py --params configs/NAME.yml --dev-run     after an edit: every stage for a step or two",
    ])
