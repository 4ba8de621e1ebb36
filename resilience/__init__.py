"""What keeps a run alive and honest: stop signals and the time limit, failure reports, the heartbeat watchdog, our
launcher, torchrun's elastic restarts, one run per output_dir and resuming. main.py plugs these into the core."""
