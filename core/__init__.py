"""The teaching core: what one DDP or FSDP step needs besides trainer.py and data_loader.py (the config schema and
its errors, process groups, the checkpoint format, the run log). It imports nothing from the packages around it."""
