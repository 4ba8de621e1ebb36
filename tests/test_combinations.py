"""Task x strategy x mode x knob combinations: each either runs (and matches one process where the docs promise it)
or is refused before training in one line naming the keys, exit code 2."""
import pytest

from conftest import make_config

from core.errors import ConfigError


def test_a_task_without_a_pipeline_chain_or_a_tp_plan_is_refused_before_the_ranks_start(tmp_path):
    # csv_text under pipe was a NotImplementedError traceback from every rank; image under tp a line from the ranks.
    cells = [
        ("csv_text", {"strategy": "pipe", "procs_per_node": 2}, "`dist.strategy` is pipe, but task csv_text"),
        ("image", {"strategy": "ddp", "procs_per_node": 2, "tp": 2}, "`dist.tp` is 2, but task image"),
        ("csv_text", {"strategy": "fsdp", "procs_per_node": 2, "tp": 2}, "`dist.tp` is 2, but task csv_text"),
        ("image_folder", {"strategy": "pipe", "procs_per_node": 4, "tp": 2}, "`dist.tp` is 2, but task image_folder"),
    ]
    for task, dist, words in cells:
        with pytest.raises(ConfigError) as e:
            make_config(tmp_path, task=task, dist=dist)
        assert words in str(e.value) and "\n" not in str(e.value), (task, dist, str(e.value))
