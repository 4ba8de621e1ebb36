"""How the model is spread over devices: one file per family of strategies (the README's tour lists them), each an
`apply_<name>(model, cfg, ctx, task, train_set)` that returns a `Strategy` (base.py: the one object the Trainer talks
to); wiring.STRATEGIES lists them."""
