"""Launcher detection as a table: environment in, backend/launcher/world out. No backend imported."""
import sys

import pytest

from unified_dist.detection import BACKENDS, DetectionError, detect

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
ACCELERATE = dict(TORCHRUN, ACCELERATE_MIXED_PRECISION="no", ACCELERATE_DYNAMO_BACKEND="NO")
HOROVODRUN = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_CONTROLLER": "gloo"}

TABLE = [
    # (name, env, explicit, backend, launcher, world, rank, local_rank)
    ("plain python", {}, None, "single", "python", 1, 0, 0),
    ("torchrun", TORCHRUN, None, "torch", "torchrun", 2, 1, 1),
    ("rank+world without elastic (srun script)", {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "0"},
     None, "torch", "torchrun", 8, 3, 0),
    ("accelerate launch (carries torchrun vars too)", ACCELERATE, None, "accelerate", "accelerate", 2, 1, 1),
    ("horovodrun", HOROVODRUN, None, "horovod", "horovodrun", 4, 1, 1),
    ("horovodrun wins over stray torch vars", dict(HOROVODRUN, **TORCHRUN), None, "horovod", "horovodrun", 4, 1, 1),
    ("horovodrun wins over stray accelerate vars", dict(HOROVODRUN, **ACCELERATE), None, "horovod", "horovodrun", 4, 1, 1),
    ("env var forces a backend", dict(TORCHRUN, UNIFIED_DIST_BACKEND="accelerate"), None, "accelerate", "torchrun", 2, 1, 1),
    ("explicit beats env var", dict(TORCHRUN, UNIFIED_DIST_BACKEND="accelerate"), "torch", "torch", "torchrun", 2, 1, 1),
    ("explicit single under torchrun", TORCHRUN, "single", "single", "python", 1, 0, 0),
    ("explicit horovod in a plain process", {}, "horovod", "horovod", "python", 1, 0, 0),
    ("explicit name is case-insensitive", {}, "Torch", "torch", "python", 1, 0, 0),
]


@pytest.mark.parametrize("name,env,explicit,backend,launcher,world,rank,local", TABLE, ids=[t[0] for t in TABLE])
def test_detection_table(name, env, explicit, backend, launcher, world, rank, local):
    got = detect(env, explicit)
    assert (got.backend, got.launcher, got.world_size, got.rank, got.local_rank) == (backend, launcher, world, rank, local)
    assert got.reason
    assert got.warnings == () and got.problems == ()


def test_accelerate_without_multi_gpu_warns_with_the_right_command():
    # what `accelerate launch --num_processes 2 script.py` (no --multi_gpu) leaves in the environment
    env = {"ACCELERATE_USE_CPU": "False", "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    got = detect(env)
    assert got.backend == "accelerate" and got.world_size == 1
    assert len(got.problems) == 1 and "--multi_gpu --num_processes" in got.problems[0]
    assert detect(env, "single").warnings == got.problems  # an explicit choice only warns


def test_half_set_torch_variables_are_a_problem():
    got = detect({"WORLD_SIZE": "2"})
    assert got.backend == "single"
    assert "RANK missing" in got.problems[0] and "torchrun" in got.problems[0]


@pytest.mark.parametrize("explicit,env", [("mpi", {}), (None, {"UNIFIED_DIST_BACKEND": "deepspeed"})])
def test_unknown_backend_is_one_line_error(explicit, env):
    with pytest.raises(DetectionError, match="unknown backend .* choose one of torch, accelerate, horovod, single") as info:
        detect(env, explicit)
    assert "\n" not in str(info.value)


def test_unparsable_rank_is_one_line_error():
    with pytest.raises(DetectionError, match="RANK='one' is not an integer"):
        detect({"RANK": "one", "WORLD_SIZE": "2"})


def test_detection_imports_no_backend():
    before = set(sys.modules)
    detect(ACCELERATE)
    detect(HOROVODRUN)
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("accelerate", "horovod")}
    assert set(BACKENDS) == {"torch", "accelerate", "horovod", "single"}
