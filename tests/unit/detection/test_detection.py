"""Launcher detection as a table: environment in, backend/launcher/world out. No backend imported."""
import sys

import pytest

from unified_dist.detection import BACKENDS, DERIVED_PORTS, DetectionError, Live, derived_port, detect
from unified_dist.detection.hostlist import HostListError, expand
from unified_dist.errors import UnifiedDistError

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
ACCELERATE = dict(TORCHRUN, ACCELERATE_MIXED_PRECISION="no", ACCELERATE_DYNAMO_BACKEND="NO")
HOROVODRUN = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_CONTROLLER": "gloo"}
# what `srun -n 4` gives task 3 on the second of two nodes (as seen from a real srun here)
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_NODELIST": "node[07-08]", "SLURM_STEP_NUM_NODES": "2"}
SRUN_ONE_NODE = dict(SRUN, SLURM_STEP_NODELIST="vm", SLURM_NODELIST="vm", SLURM_STEP_NUM_NODES="1")
SBATCH_SCRIPT = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4",
                 "SLURM_NODELIST": "node[07-08]"}  # the batch script itself: no SLURM_STEP_ID
OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1632960513"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3", "PMI_KVSNAME": "kvs_77_0"}
MVAPICH = {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "2"}
SPAWNED_TCP = Live("torch", 2, 1, None)  # init_process_group("gloo", init_method="tcp://...") in mp.spawn

TABLE = [
    # (name, env, explicit, backend, launcher, world, rank, local_rank)
    ("plain python", {}, None, "single", "python", 1, 0, 0),
    ("torchrun", TORCHRUN, None, "torch", "torchrun", 2, 1, 1),
    ("rank+world without elastic (srun script)", {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "0"},
     None, "torch", "torchrun", 8, 3, 0),
    ("accelerate launch (carries torchrun vars too)", ACCELERATE, None, "accelerate", "accelerate", 2, 1, 1),
    ("horovodrun", HOROVODRUN, None, "horovod", "horovodrun", 4, 1, 1),
    ("horovodrun wins over stray torch vars", dict(HOROVODRUN, **TORCHRUN), None, "horovod", "horovodrun", 4, 1, 1),
    ("horovodrun wins over stray accelerate vars", dict(HOROVODRUN, **ACCELERATE), None,
     "horovod", "horovodrun", 4, 1, 1),
    ("env var forces a backend", dict(TORCHRUN, UNIFIED_DIST_BACKEND="accelerate"), None,
     "accelerate", "torchrun", 2, 1, 1),
    ("explicit beats env var", dict(TORCHRUN, UNIFIED_DIST_BACKEND="accelerate"), "torch",
     "torch", "torchrun", 2, 1, 1),
    ("explicit horovod in a plain process", {}, "horovod", "horovod", "python", 1, 0, 0),
    ("explicit name is case-insensitive", {}, "Torch", "torch", "python", 1, 0, 0),
    ("srun", SRUN, None, "torch", "srun", 4, 3, 1),
    ("srun of one task", dict(SRUN, SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1"), None,
     "single", "srun", 1, 0, 0),
    ("srun torchrun: torchrun's variables are the workers'", dict(SRUN, **TORCHRUN), None,
     "torch", "torchrun", 2, 1, 1),
    ("srun accelerate launch", dict(SRUN, **ACCELERATE), None, "accelerate", "accelerate", 2, 1, 1),
    ("horovodrun inside a SLURM step", dict(SRUN, **HOROVODRUN), None, "horovod", "horovodrun", 4, 1, 1),
    ("srun asked to drive accelerate", dict(SRUN, UNIFIED_DIST_BACKEND="accelerate"), None,
     "accelerate", "srun", 4, 3, 1),
    ("sbatch script with one task", dict(SBATCH_SCRIPT, SLURM_NTASKS="1"), None, "single", "python", 1, 0, 0),
    ("Open MPI mpirun", OPENMPI, None, "torch", "mpirun", 2, 1, 1),
    ("MPICH/Intel MPI mpiexec (PMI)", MPICH, None, "torch", "mpirun", 3, 2, 2),
    ("MVAPICH mpirun", MVAPICH, None, "torch", "mpirun", 2, 1, 1),
    ("mpirun -np 1", dict(OPENMPI, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1"), None,
     "single", "mpirun", 1, 0, 0),
    ("mpirun inside a SLURM step: MPI's ranks, not the step's", dict(SRUN, **OPENMPI), None,
     "torch", "mpirun", 2, 1, 1),
    ("srun --mpi=pmi2 also sets PMI_*: SLURM wins", dict(SRUN, PMI_RANK="3", PMI_SIZE="4"), None,
     "torch", "srun", 4, 3, 1),
    ("horovodrun wins over MPI variables", dict(OPENMPI, **HOROVODRUN), None, "horovod", "horovodrun", 4, 1, 1),
    ("mpirun torchrun", dict(OPENMPI, **TORCHRUN), None, "torch", "torchrun", 2, 1, 1),
    ("a group the process joined itself", {}, None, "torch", "existing", 2, 1, None),
    ("a live group beats launcher variables", dict(SRUN), None, "torch", "srun", 2, 1, None),
    ("explicit torch adopts the live group", {}, "torch", "torch", "existing", 2, 1, None),
]
LIVE = {"a group the process joined itself", "a live group beats launcher variables",
        "explicit torch adopts the live group"}


@pytest.mark.parametrize("name,env,explicit,backend,launcher,world,rank,local", TABLE, ids=[t[0] for t in TABLE])
def test_detection_table(name, env, explicit, backend, launcher, world, rank, local):
    live = SPAWNED_TCP if name in LIVE else None
    got = detect(env, explicit, live)
    assert ((got.backend, got.launcher, got.world_size, got.rank, got.local_rank)
            == (backend, launcher, world, rank, local))
    assert got.reason
    assert got.warnings == () and got.problems == ()
    assert got.adopt == (live is not None)
    assert (got.master_addr is not None) == (launcher in ("srun", "mpirun") and world > 1 and live is None)


@pytest.mark.parametrize("live", [Live("horovod", 4, 2, 0), Live("accelerate", 3, 1, 1), Live("torch", 2, 0, 0)])
def test_a_live_stack_is_used_as_it_is(live):
    got = detect({}, None, live)
    assert (got.backend, got.world_size, got.rank, got.adopt) == (live.stack, live.world_size, live.rank, True)


def test_a_live_torch_group_under_accelerate_launch_is_driven_by_accelerate():
    got = detect(ACCELERATE, None, Live("torch", 2, 1, 1))
    assert (got.backend, got.launcher, got.adopt) == ("accelerate", "accelerate", True)


def test_explicit_single_with_several_processes_warns():
    for env, live in ((TORCHRUN, None), ({}, SPAWNED_TCP), (SRUN, None)):
        got = detect(env, "single", live)
        assert got.backend == "single" and got.world_size == 1 and got.problems == ()
        assert len(got.warnings) == 1 and "each one run alone" in got.warnings[0]


def test_srun_rendezvous_first_host_and_port_from_job_id():
    got = detect(SRUN)
    assert got.master_addr == "node07"
    assert got.master_port == derived_port("slurm:4242.0") == detect(dict(SRUN, SLURM_PROCID="0")).master_port
    assert DERIVED_PORTS[0] <= got.master_port < DERIVED_PORTS[1]
    assert got.master_port != detect(dict(SRUN, SLURM_STEP_ID="1")).master_port  # two steps of one job
    assert detect(SRUN_ONE_NODE).master_addr == "127.0.0.1"  # one node: loopback, as torchrun --standalone
    mine = detect(dict(SRUN, MASTER_ADDR="10.1.1.1", MASTER_PORT="29400"))
    assert (mine.master_addr, mine.master_port) == ("10.1.1.1", 29400)


def test_mpirun_rendezvous_loopback_on_one_host_else_master_addr():
    one_host = detect(OPENMPI)
    assert one_host.master_addr == "127.0.0.1"
    assert one_host.master_port == derived_port("mpi:1632960513")
    assert detect(MPICH).master_port == derived_port("mpi:kvs_77_0")
    assert detect(MVAPICH).master_port == 29500  # no job id: torch's default port on one host
    two_hosts = dict(OPENMPI, OMPI_COMM_WORLD_LOCAL_SIZE="1")
    got = detect(two_hosts)
    assert got.problems and "mpirun -x MASTER_ADDR=" in got.problems[0] and "\n" not in got.problems[0]
    ok = detect(dict(two_hosts, MASTER_ADDR="192.0.2.1", MASTER_PORT="29501"))
    assert (ok.master_addr, ok.master_port, ok.problems) == ("192.0.2.1", 29501, ())


@pytest.mark.parametrize("env,words", [
    (SBATCH_SCRIPT, ["4 tasks", "not started by srun", "srun python"]),
    (dict(SRUN, UNIFIED_DIST_SLURM="0"), ["srun started 4 tasks", "UNIFIED_DIST_SLURM=0", "torchrun"]),
    (dict(OPENMPI, OMPI_COMM_WORLD_LOCAL_RANK=""), ["no local rank"]),
])
def test_launches_this_process_cannot_join_are_problems(env, words):
    got = detect(env)
    assert got.problems, got
    assert all(w in got.problems[0] for w in words), got.problems[0]
    assert "\n" not in got.problems[0]


@pytest.mark.parametrize("text,hosts", [
    ("vm", ["vm"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("r[1-2]-n[09-10]", ["r1-n09", "r1-n10", "r2-n09", "r2-n10"]),
    ("gpu[8-11],cpu1", ["gpu8", "gpu9", "gpu10", "gpu11", "cpu1"]),
])
def test_slurm_host_lists_expand(text, hosts):
    assert expand(text) == hosts


@pytest.mark.parametrize("text", ["node[1-3", "node1-3]", "node[a-b]", "node[3-1]"])
def test_bad_host_lists_are_errors(text):
    with pytest.raises(HostListError):
        expand(text)
    with pytest.raises(DetectionError, match="set MASTER_ADDR"):
        detect(dict(SRUN, SLURM_STEP_NODELIST=text))


def test_detection_errors_are_unified_dist_errors():
    assert issubclass(DetectionError, UnifiedDistError) and issubclass(DetectionError, ValueError)


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


@pytest.mark.parametrize("explicit,env", [("mpi", {}), (None, {"UNIFIED_DIST_BACKEND": "colossalai"})])
def test_unknown_backend_is_one_line_error(explicit, env):
    with pytest.raises(DetectionError,
                       match="unknown backend .* choose one of torch, accelerate, horovod, deepspeed, single") as info:
        detect(env, explicit)
    assert "\n" not in str(info.value)


def test_unparsable_rank_is_one_line_error():
    with pytest.raises(DetectionError, match="RANK='one' is not an integer"):
        detect({"RANK": "one", "WORLD_SIZE": "2"})


def test_detection_imports_no_backend():
    before = set(sys.modules)
    detect(ACCELERATE)
    detect(HOROVODRUN)
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("accelerate", "horovod", "deepspeed")}
    assert set(BACKENDS) == {"torch", "accelerate", "horovod", "deepspeed", "single"}


def test_derived_port_is_the_documented_formula_below_the_ephemeral_range():
    """docs/launchers.md: the port is 15000 + crc32(job id) % 10000, below Linux's ephemeral range (32768-60999)."""
    import zlib
    port = detect(SRUN).master_port
    assert port == 15000 + zlib.crc32(b"slurm:4242.0") % 10000
    assert 15000 <= port < 25000 < 32768


# Issue #46 item 5: a backend chosen where another stack's launcher started several processes joins them
# (docs/launchers.md, "Choosing a backend the launcher did not start"), or is a one-line problem: never a
# world of one. Real launches of every pair: tests/launchers/test_contract_under_launchers.py (BACKEND_TABLE).
HOROVODRUN_ONE_HOST = dict(HOROVODRUN, HOROVOD_LOCAL_SIZE="4", HOROVOD_CROSS_SIZE="1",
                           HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT="4916")
HOROVODRUN_TWO_HOSTS = dict(HOROVODRUN_ONE_HOST, HOROVOD_LOCAL_SIZE="2", HOROVOD_CROSS_SIZE="2")
TORCHRUN_ONE_HOST = dict(TORCHRUN, LOCAL_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True")
MULTI_PROCESS = {"torchrun": TORCHRUN_ONE_HOST, "torchrun on 2 hosts": dict(TORCHRUN, LOCAL_WORLD_SIZE="1"),
                 "accelerate": dict(ACCELERATE, LOCAL_WORLD_SIZE="2"), "horovodrun": HOROVODRUN_ONE_HOST,
                 "horovodrun on 2 hosts": HOROVODRUN_TWO_HOSTS, "srun": SRUN_ONE_NODE, "srun on 2 nodes": SRUN,
                 "mpirun": OPENMPI, "mpiexec": MPICH, "mvapich": MVAPICH}


@pytest.mark.parametrize("launch", sorted(MULTI_PROCESS))
@pytest.mark.parametrize("backend", ["torch", "accelerate", "horovod"])
@pytest.mark.parametrize("how", ["init", "variable"])
def test_a_chosen_backend_joins_every_launched_process_or_is_a_problem(launch, backend, how):
    env = MULTI_PROCESS[launch]
    launched = detect(env)
    got = detect(env, backend) if how == "init" else detect(dict(env, UNIFIED_DIST_BACKEND=backend))
    assert got.backend == backend
    if not got.problems:
        assert (got.world_size, got.rank, got.launcher) == (launched.world_size, launched.rank, launched.launcher)
    else:
        assert len(got.problems) == 1 and "\n" not in got.problems[0], got.problems


@pytest.mark.parametrize("backend", ["torch", "accelerate"])
def test_torch_style_backends_under_horovodrun_join_its_ranks_through_a_torch_group(backend):
    got = detect(HOROVODRUN_ONE_HOST, backend)
    assert (got.backend, got.launcher, got.world_size, got.rank, got.local_rank, got.problems) == \
        (backend, "horovodrun", 4, 1, 1, ())
    assert (got.master_addr, got.master_port) == ("127.0.0.1", derived_port("horovodrun:127.0.0.1:4916"))
    assert detect(dict(HOROVODRUN_ONE_HOST, HOROVOD_RANK="0"), backend).master_port == got.master_port  # every rank
    other_job = dict(HOROVODRUN_ONE_HOST, HOROVOD_GLOO_RENDEZVOUS_PORT="4917")
    assert detect(other_job, backend).master_port != got.master_port
    assert detect(HOROVODRUN_TWO_HOSTS, backend).problems == (
        "horovodrun started 4 processes on several hosts and the rendezvous is unknown (MASTER_ADDR/MASTER_PORT "
        "unset); set them: export MASTER_ADDR=<first host> MASTER_PORT=29500 before horovodrun",)
    ok = detect(dict(HOROVODRUN_TWO_HOSTS, MASTER_ADDR="192.0.2.1"), backend)
    assert (ok.master_addr, ok.problems) == ("192.0.2.1", ())


@pytest.mark.parametrize("env,launcher,port", [
    (TORCHRUN_ONE_HOST, "torchrun", 29500),  # torchrun's agent store tells the others the server's port
    (dict(ACCELERATE, LOCAL_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True"), "accelerate", 29500),
    (SRUN_ONE_NODE, "srun", derived_port(f"horovod:127.0.0.1:{derived_port('slurm:4242.0')}")),  # a store of its own
    (OPENMPI, "mpirun", derived_port(f"horovod:127.0.0.1:{derived_port('mpi:1632960513')}")),
])
def test_horovod_under_a_torch_style_launcher_on_one_host_joins(env, launcher, port):
    launched, got = detect(env), detect(env, "horovod")
    assert (got.backend, got.launcher, got.world_size, got.rank, got.problems) == \
        ("horovod", launcher, launched.world_size, launched.rank, ())
    assert got.master_port == port and got.master_port != launched.master_port


@pytest.mark.parametrize("env,live,origin", [
    (dict(TORCHRUN, LOCAL_WORLD_SIZE="1"), None, "started by torchrun"),
    (SRUN, None, "started by srun"),
    (dict(OPENMPI, OMPI_COMM_WORLD_LOCAL_SIZE="1", MASTER_ADDR="192.0.2.1"), None, "started by mpirun"),
    ({}, SPAWNED_TCP, "torch already runs them"),
])
def test_horovod_where_it_cannot_join_is_one_line_naming_horovodrun(env, live, origin):
    got = detect(env, "horovod", live)
    n = got.world_size
    assert n > 1 and got.problems == (
        f"init(backend='horovod'): horovod cannot join the {n} processes of this job ({origin}) and would run each "
        "one alone; it joins another launcher's processes only on one host and before any group runs; launch with "
        f"`horovodrun -np {n} -H host1:slots,host2:slots --gloo python script.py`, or leave the backend unset "
        "(torch joins them)",)


def test_a_torch_style_backend_beside_a_running_horovod_without_horovodrun_is_a_problem():
    got = detect({}, "torch", Live("horovod", 2, 1, 1))
    assert got.problems == (
        "init(backend='torch'): torch cannot join the 2 processes of this job (horovod already runs them) and would "
        "run each one alone; launch with `torchrun --nproc_per_node 2 script.py`, or leave the backend unset "
        "(horovod joins them)",)


def test_horovod_over_a_launch_with_a_problem_keeps_the_problem():
    got = detect(dict(OPENMPI, OMPI_COMM_WORLD_LOCAL_RANK=""), "horovod")
    assert len(got.problems) == 1 and "no local rank" in got.problems[0]
