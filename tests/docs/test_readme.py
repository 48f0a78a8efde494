"""The README's first snippet (``## Use``), run as it is written under python, torchrun, accelerate
launch and horovodrun, with a stop after one epoch and a resume (under python, torchrun and accelerate launch the
runs of a launcher share one launch: ``CHAINED``).

The snippet is read from README.md at test time (an edit to it is what runs); the test prepends only
what the snippet leaves to the reader: a small classifier with BatchNorm that returns ``.loss`` and
``.logits`` as Hugging Face models do, its optimizer, scheduler, loaders, and ``epochs``. Each
launcher runs it twice in one folder: 1 epoch (writing ckpt.pt), then 2 epochs (resuming from it).

What must hold is arithmetic: the resumed run ends with the weights an uninterrupted 2-epoch run of
the same world size ends with (the reference: one process for python; torchrun's 2 processes for
the 2-process launchers, whose data order and averaged gradients are the same), and it prints one
accuracy line per epoch it ran, on the main process only, over all 37 evaluation examples.
Tolerance 1e-6: with 2 ranks every sum of two gradients is the same in any order, and every
launcher here ended bitwise equal to its reference (0.0, measured 2026-11-24); a lost step, a lost
optimizer state or a restarted epoch moves weights by ~lr = 1e-2.
"""
from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Callable, Dict

import pytest
import torch

from unified_dist.testing.launchers import ROOT, child_env, command, run

sys.path.insert(0, str(ROOT / "tests" / "examples"))
from runs_in_one_launch import split_output  # noqa: E402  (the marker runs_of_a_script.py prints is this module's)

TIMEOUT = 180
ACCURACY = re.compile(r"^(?:\[\d+\]<stdout>:)?accuracy ([0-9.]+)\s*$", re.M)  # horovodrun prefixes "[rank]<stdout>:"

PREAMBLE = textwrap.dedent('''
    import sys
    import types

    import torch

    class TinyClassifier(torch.nn.Module):
        """Returns .loss and .logits, as a Hugging Face model does."""

        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                           torch.nn.Linear(16, 2))

        def forward(self, x, labels):
            logits = self.net(x)
            return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)

    def examples(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 4, generator=g)
        labels = (x[:, 0] + x[:, 1] > 0).long()
        return [{"x": x[i], "labels": labels[i]} for i in range(n)]

    torch.manual_seed(0)
    model = TinyClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    train_loader = torch.utils.data.DataLoader(examples(90, 1), batch_size=8, shuffle=True)
    eval_loader = torch.utils.data.DataLoader(examples(37, 2), batch_size=8)
    epochs = int(sys.argv[1])
''')


def readme_snippet() -> str:
    """The first ```python block after the README's ``## Use`` heading."""
    text = (ROOT / "README.md").read_text()
    use = text.index("\n## Use\n")
    start = text.index("```python\n", use) + len("```python\n")
    return text[start:text.index("```", start)]


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("readme") / "readme_snippet.py"
    path.write_text(PREAMBLE + "\n" + readme_snippet())
    return path


WRAPPER = ROOT / "tests" / "docs" / "workers" / "runs_of_a_script.py"
CHAINED = {"python": ("straight", "first", "resumed"), "torchrun": ("straight", "first", "resumed"),
           "accelerate": ("first", "resumed")}
"""The runs each launcher makes in one launch (tests/docs/workers/runs_of_a_script.py: the second run resumes in
the processes the first ran in, from the checkpoint alone, since the README's loop restores the generators too):
python's and torchrun's uninterrupted runs are the references of 1 and 2 processes. Horovod cannot start twice
in one process: horovodrun launches each run."""
EPOCHS = {"straight": 2, "first": 1, "resumed": 2}


def _accuracies(output: str) -> list:
    return [float(a) for a in ACCURACY.findall(output)]


def _run(launcher: str, script: Path, folder: Path, epochs: int) -> list:
    nproc = 1 if launcher == "python" else 2
    result = run(command(launcher, str(script), [str(epochs)], nproc=nproc), TIMEOUT, child_env(), cwd=folder).check()
    return _accuracies(result.output)


def _weights(folder: Path) -> dict:
    return torch.load(folder / "ckpt.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def runs(script, tmp_path_factory) -> Callable[[str], Dict[str, tuple]]:
    """``runs(launcher)``: each run's (accuracies printed, folder), launched once by the first test that asks:
    the uninterrupted 2 epochs (``straight``, python and torchrun only), 1 epoch (``first``), then 2 epochs in
    the first one's folder (``resumed``, from its ckpt.pt)."""
    done: Dict[str, Dict[str, tuple]] = {}

    def of(launcher: str) -> Dict[str, tuple]:
        if launcher in done:
            return done[launcher]
        base = tmp_path_factory.mktemp(f"readme-{launcher}")
        folders = {"straight": base / "straight", "first": base / "stopped", "resumed": base / "stopped"}
        for folder in set(folders.values()):
            folder.mkdir()
        if launcher not in CHAINED:
            done[launcher] = {name: (_run(launcher, script, folders[name], EPOCHS[name]), folders[name])
                              for name in ("first", "resumed")}
            return done[launcher]
        plan = [{"name": name, "args": [str(EPOCHS[name])], "cwd": str(folders[name])} for name in CHAINED[launcher]]
        (base / "plan.json").write_text(json.dumps(plan))
        result = run(command(launcher, str(WRAPPER), [str(script), str(base / "plan.json")],
                             nproc=1 if launcher == "python" else 2), TIMEOUT, child_env(), cwd=base).check()
        parts = split_output(result.output)
        assert sorted(parts) == sorted(CHAINED[launcher]), result.output[-3000:]
        done[launcher] = {name: (_accuracies(parts[name]), folders[name]) for name in CHAINED[launcher]}
        return done[launcher]

    return of


@pytest.fixture(scope="module")
def uninterrupted(runs) -> Callable[[int], tuple]:
    """The reference per world size: 2 epochs in one run (python for 1 process, torchrun for 2): (final
    weights, the two epochs' accuracies)."""

    def of(nproc: int) -> tuple:
        accuracies, folder = runs("python" if nproc == 1 else "torchrun")["straight"]
        assert len(accuracies) == 2, accuracies
        return _weights(folder), accuracies

    return of


def test_the_readme_is_a_first_screen_that_links_the_site():
    """Issue #30: README.md stays at most 15,000 bytes, and every page it links is a page of the site
    (a file under docs/ that mkdocs.yml's nav lists), so the links work on GitHub and in the site."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15_000, len(text.encode())
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 15, links
    nav = (ROOT / "mkdocs.yml").read_text()
    for link in links:
        assert (ROOT / link).is_file(), link
        assert link.removeprefix("docs/") in nav, f"{link} is not in mkdocs.yml's nav"


def test_the_snippet_is_the_readme_loop():
    snippet = readme_snippet()
    for line in ('ud.load("ckpt.pt", state)', "ud.save(state, \"ckpt.pt\")", '"rng": ud.RNG',
                 "ud.gather_for_metrics(preds == batch[\"labels\"])",
                 "with ud.accumulate(model), ud.autocast():"):
        assert line in snippet, line


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun", "accelerate", "horovodrun"])
def test_snippet_runs_unchanged_and_resumes_to_the_uninterrupted_weights(launcher, runs, uninterrupted):
    expected, accuracies = uninterrupted(1 if launcher == "python" else 2)
    first, resumed, folder = runs(launcher)["first"][0], *runs(launcher)["resumed"]
    assert len(first) == 1 and 0 <= first[0] <= 1, first  # one line: ud.print prints on the main process only
    # every example counted once: the accuracy is a multiple of 1/37 ...
    assert abs(first[0] * 37 - round(first[0] * 37)) < 1e-6, first
    # ... and every launcher measures what the reference run measured at the same point
    assert first == accuracies[:1], (first, accuracies)
    assert len(resumed) == 1, f"the resumed run trained {len(resumed)} epochs, expected only the second"
    assert resumed == accuracies[1:], (resumed, accuracies)
    got = _weights(folder)
    assert list(got) == list(expected), (list(got), list(expected))
    for name, value in expected.items():
        difference = (got[name].double() - value.double()).abs().max().item()
        assert difference <= 1e-6, f"{name}: {difference:.3g} from the uninterrupted run"
