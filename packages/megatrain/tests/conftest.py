import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megacore import parallel_state as ps

# Spawned ranks import the test modules (their rank functions) by name: they inherit
# this sys.path from the parent.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """tp = pp = 1 in this process: a gloo world of one, with megacore's groups."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(
            "gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'rendezvous'}"
        )
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
