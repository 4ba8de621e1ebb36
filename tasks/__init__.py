"""Tasks: a task = model + data + loss + metrics (base.py is the interface); wiring.TASKS lists them."""
