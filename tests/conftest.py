import os
import shutil
import subprocess
import tempfile

import pytest

from unified_dist.testing.launchers import ROOT, unavailable


def pytest_collection_modifyitems(config, items):
    """Horovod is skipped only where it was deliberately left out (UNIFIED_DIST_WITHOUT_HOROVOD=1)."""
    if os.environ.get("UNIFIED_DIST_WITHOUT_HOROVOD") != "1":
        return
    skip = pytest.mark.skip(reason="UNIFIED_DIST_WITHOUT_HOROVOD=1: Horovod deliberately not installed")
    for item in items:
        if "horovod" in item.nodeid or item.get_closest_marker("horovod"):
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "horovod: launches horovodrun although its name does not say so")


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-node SLURM (tools/slurm_cluster.sh): yields the environment srun needs; stopped afterwards."""
    script = ROOT / "tools" / "slurm_cluster.sh"
    check = subprocess.run([str(script), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        unavailable(f"no SLURM here: {check.stderr.strip()}")
    directory = tempfile.mkdtemp(prefix="ud-slurm-")
    up = subprocess.run([str(script), "up", directory], capture_output=True, text=True, timeout=120)
    try:
        if up.returncode != 0:
            pytest.fail(f"SLURM did not start: {up.stderr.strip()}")
        yield {"SLURM_CONF": os.path.join(directory, "slurm.conf")}
    finally:
        subprocess.run([str(script), "down", directory], capture_output=True, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def mpirun_available():
    if shutil.which("mpirun") is None:
        unavailable("no mpirun here (Debian: apt-get install openmpi-bin)")
