"""What some runs add: measured batch sizes and precision (balance.py), profiling, test and export modes, the help
text. Each is imported by main.py or wiring.py, never by the core."""
