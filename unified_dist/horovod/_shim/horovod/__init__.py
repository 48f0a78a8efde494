"""Stands in for the ``horovod`` package (see :mod:`unified_dist.horovod.redirect`).

Where Horovod is installed, this module hands the import over to it (the installed package replaces
this one in ``sys.modules``: ``horovodrun``, ``horovod.common`` and the rest stay Horovod's), and then,
unless the facade's detection runs real Horovod in this process (a process that horovodrun started),
makes ``horovod.torch`` :mod:`unified_dist.horovod`. Without Horovod installed this package stays, and
its ``torch`` subpackage answers with :mod:`unified_dist.horovod`.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _installed_spec():
    """The spec of the installed ``horovod`` package (this directory left out), or ``None``."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    return importlib.machinery.PathFinder.find_spec("horovod", path)


def _runs_real_horovod() -> bool:
    from unified_dist.detection import detect

    return detect(os.environ).backend == "horovod"


def _answer_for_horovod_torch(package) -> None:
    import unified_dist.horovod as api

    sys.modules["horovod.torch"] = api
    package.torch = api
    import unified_dist.horovod.elastic as elastic

    sys.modules["horovod.torch.elastic"] = elastic


_spec = _installed_spec()
if _spec is not None:
    _installed = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _installed  # the import system hands this module out instead of the stand-in
    _spec.loader.exec_module(_installed)
    if not _runs_real_horovod():
        _answer_for_horovod_torch(_installed)
