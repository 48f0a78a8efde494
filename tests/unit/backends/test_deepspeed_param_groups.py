"""The deepspeed backend's portable optimizer state with several param groups (ZeRO 1 and 2): DeepSpeed 0.19.8 links
each parameter's view of the optimizer state after its first group's first step only, so ``ud.save`` of an
optimizer with a second group (the example's no-decay group) failed with "exp_avg not found in optimizer state
fragment" (found by ``examples/bert_sentiment/train.py --zero-stage 2`` at its first checkpoint). One plain
``python`` process (a world of 1: the views are per rank, the bug needs no second one) trains two AdamW steps in
two groups through the facade and saves; every group's moments must be a plain torch AdamW's after the same steps."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unified_dist.testing.launchers import ROOT, child_env

pytest.importorskip("deepspeed")

SCRIPT = textwrap.dedent('''
    import copy, json, os, sys, torch
    import unified_dist as ud

    out, results = sys.argv[1], {}

    def groups(m):  # weights with decay, biases without: the example's two groups
        return [{"params": [m[0].weight, m[1].weight], "weight_decay": 0.1},
                {"params": [m[0].bias, m[1].bias], "weight_decay": 0.0}]

    for stage in (1, 2):  # one session after another
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
        plain = copy.deepcopy(net)
        x = torch.linspace(-1, 1, 8).reshape(2, 4)
        reference = torch.optim.AdamW(groups(plain), lr=0.1)
        for _ in range(2):
            plain(x).pow(2).mean().backward(); reference.step(); reference.zero_grad()
        ud.init(backend="deepspeed", zero_stage=stage)
        model, optimizer = ud.prepare(net, torch.optim.AdamW(groups(net), lr=0.1))
        for _ in range(2):
            ud.backward(model(x).pow(2).mean()); optimizer.step(); optimizer.zero_grad()
        path = os.path.join(out, f"zero{stage}.pt")
        ud.save({"optimizer": optimizer}, path)
        saved = torch.load(path, weights_only=False)["optimizer"]["state"]
        expected = reference.state_dict()["state"]
        results[stage] = {str(i): {k: [saved[i][k].flatten().tolist(), expected[i][k].flatten().tolist()]
                                   for k in ("exp_avg", "exp_avg_sq")} for i in expected}
        ud.shutdown()
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(results, f)
''')


def test_every_param_groups_optimizer_state_saves_under_zero_1_and_2(tmp_path: Path):
    """Bound: the same float32 arithmetic in one process (no reduction, DeepSpeed's flat copy of each gradient is
    exact), so the moments agree to float32 rounding of the two-term moment sums: 1e-6 relative (measured: equal)."""
    script = tmp_path / "groups.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "result.json").read_text())
    assert sorted(results) == ["1", "2"]
    for stage, result in results.items():
        assert sorted(result) == ["0", "1", "2", "3"], stage  # every parameter of both groups
        for index, moments in result.items():
            for key, (saved, expected) in moments.items():
                assert saved == pytest.approx(expected, rel=1e-6, abs=1e-12), (stage, index, key)
