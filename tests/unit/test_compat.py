"""Each switch of ``unified_dist.compat`` does its job on the installed torch, whichever side of it
that torch takes. Every cell of the version matrix (``make versions``) runs this file, so each side is
run by the cells that take it (docs/versions.md lists them)."""
import inspect
import subprocess
import sys

import torch

from unified_dist import compat
from unified_dist.testing.launchers import ROOT, child_env

FAKE_WORLD = """
import warnings
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from unified_dist import compat

dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
print("registered by:", compat.enable_fake_collectives())
with FakeTensorMode(), warnings.catch_warnings():
    warnings.simplefilter("error", FutureWarning)
    t = torch.ones(3)
    dist.all_reduce(t)
    out = torch.empty(12)
    compat.all_gather_into_tensor(out, t)
    piece = torch.empty(3)
    dist.scatter(piece, None, src=0)
    dist.broadcast(t, src=0)
    print("shapes:", tuple(t.shape), tuple(out.shape), tuple(piece.shape), type(out).__name__)
"""


def test_collectives_run_on_fake_tensors_once_enabled_as_plan_needs():
    """The cells before the kernels were registered at import take the other side: the module is
    imported and the same collectives run (without it: ``UnsupportedOperatorException``)."""
    done = subprocess.run([sys.executable, "-c", FAKE_WORLD], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shapes: (3,) (12,) (3,) FakeTensor" in done.stdout
    assert ("registered by: None" in done.stdout
            or "registered by: torch.distributed._tools.fake_collectives" in done.stdout), done.stdout


def test_ddp_without_buffer_sync_is_a_keyword_of_this_torchs_ddp():
    takes = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    (name, value), = compat.DDP_WITHOUT_BUFFER_SYNC.items()
    assert name in takes and value is False
    assert name == ("forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers")


def test_sides_name_each_switch_and_the_side_this_torch_takes():
    sides = compat.sides()
    assert set(sides) == {"all_gather_into_tensor", "DDP_WITHOUT_BUFFER_SYNC", "enable_fake_collectives"}
    assert sides["all_gather_into_tensor"] == compat.all_gather_into_tensor.__name__
    assert sides["DDP_WITHOUT_BUFFER_SYNC"] in ("forward_sync_buffers", "broadcast_buffers")
