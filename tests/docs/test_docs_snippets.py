"""The code in the docs runs: every fenced block of README.md, docs/**/*.md (less the generated
docs/api/ and docs/benchmarks/) and examples/*/README.md is either run here or marked as not run,
with the reason. Each failure names the block as ``FILE:LINE`` (the opening fence's line).

The convention: an HTML comment on the line right before the fence (neither mkdocs nor GitHub shows it).

- A ```python block runs as it is written, as one process (``python snippet.py`` in a temporary
  folder, the repository on PYTHONPATH, OMP_NUM_THREADS=1, a timeout), and must exit 0. An unmarked
  block that does not run fails. The one-process blocks run as forks of one process that has imported torch
  (unified_dist/testing/preloaded.py: the script, its globals and its environment are its own; only torch's
  import, ~3 CPU-s a block on 2 cores, is shared), so these items are marked ``distributed``.
- ``<!-- snippet: skip (REASON) -->``: not run; the reason is required (``needs 2 GPUs``,
  ``run by tests/docs/test_readme.py under every launcher``, ...).
- ``<!-- snippet: after NAME -->``: a fragment that uses objects defined elsewhere runs after the
  preamble NAME of ``PREAMBLES`` below, then the preamble's epilogue, which may check what the page
  promises. ``imports``: os, torch, ``unified_dist as ud``. ``tiny-loop``: a Linear model returning
  ``.loss``/``.logits`` as Hugging Face models do, SGD, a StepLR ``scheduler``, ``train_loader``
  (= ``loader``) and ``eval_loader`` of dict batches, ``epochs`` = 2. ``tiny-prepared``: the same
  after ``ud.init()`` and ``ud.prepare``, plus one ``batch``. ``tiny-checkpoint``: ``tiny-prepared``
  and a ``ckpt.pt`` saved at epoch 1; the fragment must load it into ``state`` (checked, and that its
  own saves, if any, go on from epoch 1). ``tiny-blocks``: a model with ``blocks.*.w1``/``w2`` (for
  tensor-parallel plans), SGD and a ``loader``; the epilogue trains a step. ``stream``: part-0.csv and
  part-1.csv in the folder, ``model``, ``optimizer``, ``collate``, ``loss_of(model, batch)``, an
  IterableDataset ``dataset``; the epilogue checks that ``loader`` gives each example once, shuffled.
  For shell blocks, ``train-py``: an empty ``train.py`` in the folder (the script the CLI examples name).
- ``<!-- snippet: continue -->``: runs after the previous ```python block of the same page (with that
  block's preamble and launcher, chained back to the first block that is not ``continue``).
- ``<!-- snippet: torchrun 2 -->``: a block whose point is several processes runs under
  ``torchrun --standalone --nproc_per_node 2`` (a free port each time; marked ``distributed``). Keep
  these few: each costs 5-9 s on 2 cores.
- Directives combine with ``;``: ``<!-- snippet: torchrun 2; after tiny-prepared -->``.
- Any other block (bash, console, output, diff) runs only when marked ``<!-- snippet: run -->``. A
  block with ``$ `` prompts runs each command (bash, in the temporary folder, the venv's bin/ first on
  PATH) and compares its stdout with the lines shown under it (a line ``...`` stands for any lines).
  Add ``output from "TEXT"`` to compare from the first line that starts with TEXT on (what comes
  before is the machine's: versions, paths), or ``output varies (REASON)`` to check the exit status
  only. A block without prompts runs as one ``bash -e`` script. Every command must exit 0. Shell runs
  are marked ``distributed`` (a command may start a launcher), and ``horovod`` where they run
  ``unified-dist env`` (it runs ``horovodrun --check-build`` and reports a missing Horovod).
- Every run has a clean environment: no launcher variables and no ``UNIFIED_DIST_*`` setting of the
  shell that runs the tests (a page's example sets its own).
- A marker that is not right before a fence, an unknown directive or preamble, or ``skip`` without a
  reason fails ``test_every_marker_is_well_formed``.
"""
from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from unified_dist.testing.launchers import ROOT, child_env, command, run, run_apart

PYTHON_TIMEOUT = 90
TORCHRUN_TIMEOUT = 180
SHELL_TIMEOUT = 60
GENERATED = ("docs/api/", "docs/benchmarks/")  # written by tools, not by hand


def pages() -> List[Path]:
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md"))
            if not p.relative_to(ROOT).as_posix().startswith(GENERATED)]
    return [ROOT / "README.md", *docs, *sorted((ROOT / "examples").glob("*/README.md"))]


_IMPORTS = """\
import os

import torch

import unified_dist as ud
"""

_TINY_LOOP = _IMPORTS + '''\
import types

from torch.utils.data import DataLoader


class TinyClassifier(torch.nn.Module):
    """Returns .loss and .logits, as a Hugging Face model does."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x, labels):
        logits = self.linear(x)
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)


def examples(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    labels = (x[:, 0] > 0).long()
    return [{"x": x[i], "labels": labels[i]} for i in range(n)]


torch.manual_seed(0)
model = TinyClassifier()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
train_loader = DataLoader(examples(24, 1), batch_size=4, shuffle=True)
eval_loader = DataLoader(examples(10, 2), batch_size=4)
loader = train_loader
epochs = 2
'''

_TINY_PREPARED = _TINY_LOOP + """\
batch = next(iter(DataLoader(examples(4, 3), batch_size=4)))
ud.init()
model, optimizer, train_loader, eval_loader, scheduler = ud.prepare(
    model, optimizer, train_loader, eval_loader, scheduler)
loader = train_loader
"""

_TINY_CHECKPOINT = _TINY_PREPARED + """\
ud.save({"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": train_loader, "rng": ud.RNG,
         "epoch": 1}, "ckpt.pt")
saved_epochs = []  # the epoch of every ud.save the fragment makes
_save = ud.save


def _recording_save(obj, path, **kwargs):
    saved_epochs.append(obj["epoch"])
    return _save(obj, path, **kwargs)


ud.save = _recording_save
"""
# the fragment loaded the saved epoch into state, went on from there (its saves, if any, are of epoch 2 and
# later: a loop that started again at epoch 0 saves epoch 1), and the file holds what it saved last
_LOADED_EPOCH = """\
assert state["epoch"] >= 1, f"state['epoch'] is {state['epoch']}: the saved epoch 1 was not loaded"
assert all(epoch >= 2 for epoch in saved_epochs), f"saved epochs {saved_epochs}: the loop did not resume at 1"
assert ud.load("ckpt.pt")["epoch"] == state["epoch"], (ud.load("ckpt.pt")["epoch"], state["epoch"])
"""

_TINY_BLOCKS = _IMPORTS + """\
from torch.utils.data import DataLoader, TensorDataset


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
"""

_ONE_STEP = """\
for x, y in loader:
    ud.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    break
ud.shutdown()
"""

_STREAM = _IMPORTS + """\
from torch.utils.data import DataLoader

with open("part-0.csv", "w") as f0, open("part-1.csv", "w") as f1:
    for i in range(50):
        (f0 if i % 2 else f1).write(("x0,x1,y\\n" if i < 2 else "") + f"{i / 50},{1 - i / 50},{i / 25}\\n")


def collate(rows):
    return (torch.tensor([[r["x0"], r["x1"]] for r in rows]), torch.tensor([[r["y"]] for r in rows]))


def loss_of(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


class Pairs(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(50):
            yield torch.tensor([i / 50, 1 - i / 50]), torch.tensor([i / 25])


torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
dataset = Pairs()
"""

_EACH_EXAMPLE_ONCE = """\
order = [round(v * 25) for _, y in loader for v in y.flatten().tolist()]
assert sorted(order) == list(range(50)), order
assert order != list(range(50)), "not shuffled"
"""

PREAMBLES: Dict[str, Tuple[str, str, str]] = {
    # name: (kind, code before the block, code after it)
    "imports": ("python", _IMPORTS, ""),
    "tiny-loop": ("python", _TINY_LOOP, ""),
    "tiny-prepared": ("python", _TINY_PREPARED, ""),
    # checkpoints.md and common-mistakes.md promise that state["epoch"] now holds the saved epoch
    "tiny-checkpoint": ("python", _TINY_CHECKPOINT, _LOADED_EPOCH),
    "tiny-blocks": ("python", _TINY_BLOCKS, _ONE_STEP),
    # streaming.md: each example once per epoch, shuffled (both datasets hold y = i / 25 for i in 0..49)
    "stream": ("python", _STREAM, _EACH_EXAMPLE_ONCE),
    "train-py": ("shell", ": > train.py\n", ""),
}

MARKER = re.compile(r"^\s*<!--\s*snippet:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
DIRECTIVE = re.compile(r"^(skip|output varies)\s*(?:\((.*)\))?$|^(after)\s+(\S+)$|^(torchrun)\s+(\d+)$"
                       r"|^(continue|run)$|^output from\s+\"(.+)\"$")


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # the opening fence's line, 1-based
    lang: str
    code: str
    skip: Optional[str] = None
    after: Optional[str] = None
    torchrun: int = 0
    chained: bool = False
    run: bool = False
    output_varies: Optional[str] = None
    output_from: Optional[str] = None
    problems: List[str] = field(default_factory=list)
    previous: Optional["Block"] = None  # for `continue`: the block it continues

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def python(self) -> bool:
        return self.lang in ("python", "py")


def parse_marker(text: str, block: Block) -> None:
    for directive in (d.strip() for d in text.split(";")):
        m = DIRECTIVE.match(directive)
        if not m:
            block.problems.append(f"unknown directive {directive!r}")
        elif m.group(1) == "skip":
            if not (m.group(2) or "").strip():
                block.problems.append("skip needs a reason: <!-- snippet: skip (REASON) -->")
            block.skip = m.group(2)
        elif m.group(1) == "output varies":
            if not (m.group(2) or "").strip():
                block.problems.append("output varies needs a reason: output varies (REASON)")
            block.output_varies = m.group(2)
        elif m.group(3) == "after":
            block.after = m.group(4)
        elif m.group(5) == "torchrun":
            block.torchrun = int(m.group(6))
        elif m.group(7) == "continue":
            block.chained = True
        elif m.group(8):
            block.output_from = m.group(8)
        else:
            block.run = True


def blocks_of(path: Path, page: Optional[str] = None) -> Tuple[List[Block], List[str]]:
    """The fenced blocks of one page, and the page's markers that stand before no fence."""
    page = page or path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks: List[Block] = []
    orphans: List[str] = []
    used, inside = set(), set()  # the markers' lines; the fences' lines and what they hold
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening.groups()
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence[0] * len(fence))
                                        and lines[end].strip().strip(fence[0]) == ""):
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        block = Block(page, i + 1, lang.lower(), "\n".join(body) + "\n")
        marker = MARKER.match(lines[i - 1]) if i else None
        if marker:
            used.add(i - 1)
            parse_marker(marker.group(1), block)
        blocks.append(block)
        inside.update(range(i, end + 1))
        i = end + 1
    for number, line in enumerate(lines):  # a whole-line marker elsewhere (a blank line before the fence...)
        if MARKER.match(line) and number not in used and number not in inside:
            orphans.append(f"{page}:{number + 1}: a snippet marker must be the line right before a fence: "
                           f"{line.strip()}")
    previous_python: Optional[Block] = None
    for block in blocks:
        _check(block, previous_python)
        if block.python:
            previous_python = block
    return blocks, orphans


def _check(block: Block, previous: Optional[Block]) -> None:
    if block.after and block.after not in PREAMBLES:
        block.problems.append(f"no preamble {block.after!r} (there are: {', '.join(PREAMBLES)})")
    elif block.after and PREAMBLES[block.after][0] != ("python" if block.python else "shell"):
        block.problems.append(f"preamble {block.after!r} is for {PREAMBLES[block.after][0]} blocks")
    if block.python:
        if block.run or block.output_varies or block.output_from:
            block.problems.append("a python block runs unless skipped: `run` and `output ...` are for shell blocks")
        if block.chained:
            if previous is None or previous.skip is not None:
                block.problems.append("`continue` needs a previous ```python block on the page that runs")
            elif block.after or block.torchrun:
                block.problems.append("a `continue` block takes the preamble and launcher of the block it continues")
            else:
                block.previous = previous
    else:
        if (block.after or block.output_varies or block.output_from) and not block.run:
            block.problems.append("a shell block runs only when marked `run`")
        if block.torchrun or block.chained:
            block.problems.append("`torchrun` and `continue` are for ```python blocks")
    if block.skip is not None and (block.after or block.torchrun or block.chained or block.run):
        block.problems.append("a skipped block takes no other directive")


ALL: List[Block] = []
ORPHANS: List[str] = []
for _page in pages():
    _blocks, _orphans = blocks_of(_page)
    ALL += _blocks
    ORPHANS += _orphans


def head(block: Block) -> Block:
    while block.previous is not None:
        block = block.previous
    return block


def program(block: Block) -> str:
    """The code that runs for ``block``: preamble, the blocks it continues, the block, epilogue."""
    chain = []
    b: Optional[Block] = block
    while b is not None:
        chain.append(b)
        b = b.previous
    first = chain[-1]
    _, before, after = PREAMBLES[first.after] if first.after else ("", "", "")
    parts = [before] + [f"# ---- {b.name}\n{b.code}" for b in reversed(chain)] + [after]
    return "\n".join(parts)


def runnable(kind: str) -> List[Block]:
    chosen = []
    for block in ALL:
        chain = [block]
        while chain[-1].previous is not None:
            chain.append(chain[-1].previous)
        if any(b.problems for b in chain) or block.skip is not None:  # test_every_marker_is_well_formed says why
            continue
        if kind == "shell" and not block.python and block.run:
            chosen.append(block)
        elif kind == "python" and block.python and not head(block).torchrun:
            chosen.append(block)
        elif kind == "torchrun" and block.python and head(block).torchrun:
            chosen.append(block)
    return chosen


def _params(kind: str):
    # `unified-dist env` runs `horovodrun --check-build` and reports a missing Horovod as a problem
    return [pytest.param(block, id=block.name, marks=[pytest.mark.horovod] if "unified-dist env" in block.code else [])
            for block in runnable(kind)]


def _env(tmp_path: Path, caches: Optional[Path] = None) -> Dict[str, str]:
    """A clean environment: no launcher variables (child_env) and no UNIFIED_DIST_* setting of the shell that
    runs the tests (a page's example sets its own), the repository on PYTHONPATH, Hugging Face's caches in
    ``caches`` (default: the folder). The one-process blocks share one (huggingface_hub reads ``HF_HOME`` at its
    import, which their preloaded process made once)."""
    env = {k: v for k, v in child_env().items() if not k.startswith("UNIFIED_DIST_")}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str((caches or tmp_path) / "hf"), HF_DATASETS_OFFLINE="1",
               PYTHONPATH=str(ROOT))
    return env


HINT = ("If it is not meant to run, mark it on the line before its fence: <!-- snippet: skip (REASON) -->; "
        f"a fragment can run <!-- snippet: after NAME --> (NAME one of {', '.join(PREAMBLES)}) or "
        "<!-- snippet: continue --> (see this module's docstring).")


def _numbered(code: str) -> str:
    return "\n".join(f"{n:4} | {line}" for n, line in enumerate(code.splitlines(), 1))


def _failed(block: Block, code: str, timed_out: bool, returncode: int, timeout: float, how: str, output: str):
    what = f"timed out after {timeout} s" if timed_out else f"exit {returncode}"
    pytest.fail(f"{block.name}: the snippet failed ({what}) under {how} ...\n"
                f"{_numbered(code)}\n---- output (tail)\n{output[-3000:]}\n{HINT}", pytrace=False)


def _run_torchrun(block: Block, tmp_path: Path) -> None:
    code = program(block)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    cmd = command("torchrun", str(script), nproc=head(block).torchrun)
    result = run(cmd, TORCHRUN_TIMEOUT, _env(tmp_path), cwd=tmp_path)
    if result.timed_out or result.returncode != 0:
        _failed(block, code, result.timed_out, result.returncode, TORCHRUN_TIMEOUT, " ".join(cmd[:3]), result.output)


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """Every one-process python block, each ``python snippet.py`` in a folder of its own, run in one launch of
    unified_dist/testing/preloaded.py (a fork each, after one import of torch). Returns the launch, each block's
    result (by name) and each block's (folder, code)."""
    base = tmp_path_factory.mktemp("snippets")
    plan, where = [], {}
    for n, block in enumerate(runnable("python")):
        folder = base / str(n)
        folder.mkdir()
        code = program(block)
        (folder / "snippet.py").write_text(code)
        where[block.name] = folder, code
        plan.append({"name": block.name, "script": "snippet.py", "args": [], "cwd": str(folder),
                     "env": _env(folder, caches=base), "output": str(folder / "output.txt"), "timeout": PYTHON_TIMEOUT})
    (base / "plan.json").write_text(json.dumps(plan))
    launched = run([sys.executable, "-m", "unified_dist.testing.preloaded", str(base / "plan.json"),
                    str(base / "results.json")], PYTHON_TIMEOUT * max(len(plan), 1), _env(base), cwd=base)
    results = json.loads((base / "results.json").read_text()) if (base / "results.json").exists() else {}
    return launched, results, where


def commands(code: str) -> List[Tuple[str, List[str]]]:
    """A prompted block's ``(command, expected stdout lines)``: each ``$ `` line and the lines up to the next."""
    out: List[Tuple[str, List[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line.rstrip())
    return out


def matches(expected: List[str], got: List[str]) -> bool:
    """Line by line; a line ``...`` in ``expected`` stands for any number of lines."""
    pattern = "".join(r"(?:[^\n]*\n)*?" if line == "..." else re.escape(line) + r"\n" for line in expected)
    return re.fullmatch(pattern, "".join(line + "\n" for line in got)) is not None


@pytest.mark.distributed  # the preloaded process and its fork (see the module's docstring)
@pytest.mark.parametrize("block", _params("python"))
def test_python_snippet_runs(block: Block, one_process_runs):
    launched, results, where = one_process_runs
    folder, code = where[block.name]
    got = results.get(block.name)
    assert got is not None, f"{block.name}: the preloaded launch did not run it\n{launched.output[-3000:]}"
    if got["timed_out"] or got["returncode"] != 0:
        _failed(block, code, got["timed_out"], got["returncode"], PYTHON_TIMEOUT, "python snippet.py (preloaded)",
                (folder / "output.txt").read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("block", _params("torchrun"))
def test_multi_process_snippet_runs_under_torchrun(block: Block, tmp_path):
    _run_torchrun(block, tmp_path)


def _shell(cmd: str, env: Dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``bash -c cmd`` in its own session, stdout and stderr apart; on timeout the session is killed."""
    return run_apart(["bash", "-c", cmd], SHELL_TIMEOUT, env, cwd, what=f"`{cmd}`")


def _from(text: str, lines: List[str], where: str) -> List[str]:
    starts = [n for n, line in enumerate(lines) if line.startswith(text)]
    assert starts, f"no line of {where} starts with {text!r}:\n" + "\n".join(lines)
    return lines[starts[0]:]


@pytest.mark.distributed
@pytest.mark.parametrize("block", _params("shell"))
def test_shell_snippet_runs_and_prints_what_the_page_shows(block: Block, tmp_path):
    env = _env(tmp_path)
    setup = PREAMBLES[block.after][1] if block.after else ""
    if setup:
        assert _shell(setup, env, tmp_path).returncode == 0, setup
    prompted = commands(block.code) or [(f"set -e -o pipefail\n{block.code}", [])]
    for cmd, expected in prompted:
        result = _shell(cmd, env, tmp_path)
        assert result.returncode == 0, (f"{block.name}: `{cmd}` exited {result.returncode}\n"
                                        f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
        if block.output_varies is None:
            got = [line.rstrip() for line in result.stdout.rstrip("\n").splitlines()]
            while expected and expected[-1] == "":
                expected.pop()
            if block.output_from:
                expected, got = _from(block.output_from, expected, "the page"), _from(block.output_from, got, cmd)
            assert matches(expected, got), (f"{block.name}: `{cmd}` printed other lines than the page shows "
                                             "(- the page, + the output):\n"
                                             + "\n".join(difflib.unified_diff(expected, got, lineterm="", n=1)))


def test_every_marker_is_well_formed():
    problems = [f"{block.name}: {problem}" for block in ALL for problem in block.problems] + ORPHANS
    assert not problems, "\n".join(problems)


def test_the_extractor_sees_every_page_and_block():
    """The extractor itself can fail: it must find the pages and the blocks this module was written
    against (counted by hand in docs/cli.md: 12 fence lines = 6 blocks; preemption.md: 1 python, 1 bash)."""
    names = {block.page for block in ALL}
    assert {"README.md", "docs/cli.md", "docs/checkpoints.md", "examples/minimal/README.md"} <= names, names
    assert not any(name.startswith(GENERATED) for name in names)
    cli = [b for b in ALL if b.page == "docs/cli.md"]
    assert len(cli) == 6, [b.name for b in cli]
    preemption = [b.lang for b in ALL if b.page == "docs/preemption.md"]
    assert preemption.count("python") == 1 and preemption.count("bash") == 1, preemption
    bert = [b for b in ALL if b.page == "examples/bert_sentiment/README.md" and b.python]
    assert len(bert) == 1 and bert[0].code.startswith("with ud.accumulate(model):\n    with"), bert  # dedented


def test_the_directives_parse_as_documented(tmp_path):
    """The parser on a page written here: each directive, each refusal, and what a chain runs."""
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        <!-- snippet: torchrun 2; after tiny-loop -->
        ```python
        a = 1
        ```
        <!-- snippet: continue -->
        ```python
        b = a
        ```
        <!-- snippet: skip -->
        ```python
        c
        ```
        <!-- snippet: after nowhere -->
        ```python
        d
        ```
        <!-- snippet: run -->
        ```python
        e
        ```
        <!-- snippet: run; output varies (clock) -->
        ```console
        $ date
        ```
        1. a list item:

           <!-- snippet: skip (a fragment) -->
           ```py
           f(
           ```
        <!-- snippet: after imports -->

        ```python
        g
        ```
        """))
    blocks, orphans = blocks_of(page, "page.md")
    assert [(b.line, b.lang) for b in blocks] == [(2, "python"), (6, "python"), (10, "python"), (14, "python"),
                                                 (18, "python"), (22, "console"), (28, "py"), (33, "python")]
    first, chained, unreasoned, unknown, run_python, shell, indented, separated = blocks
    assert (first.torchrun, first.after, first.problems) == (2, "tiny-loop", [])
    assert chained.previous is first and head(chained) is first and not chained.problems
    assert program(chained).index("class TinyClassifier") < program(chained).index("a = 1\n") \
        < program(chained).index("b = a\n")
    assert unreasoned.problems == ["skip needs a reason: <!-- snippet: skip (REASON) -->"]
    assert unknown.problems and "no preamble 'nowhere'" in unknown.problems[0]
    assert run_python.problems and "runs unless skipped" in run_python.problems[0]
    assert (shell.run, shell.output_varies, shell.problems) == (True, "clock", [])
    assert commands(shell.code) == [("date", [])]
    assert (indented.skip, indented.code, indented.python) == ("a fragment", "f(\n", True)
    assert separated.after is None and orphans == ["page.md:31: a snippet marker must be the line right before a "
                                                   "fence: <!-- snippet: after imports -->"]
    marked = Block("page.md", 1, "console", "")
    parse_marker('run; output from "this environment"', marked)
    assert (marked.run, marked.output_from, marked.problems) == (True, "this environment", [])
    assert _from("b", ["a", "b", "c"], "x") == ["b", "c"]
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"]) and matches(["a", "..."], ["a"])
    assert not matches(["a", "d"], ["a", "b", "d"]) and not matches(["a"], ["a", "b"])
