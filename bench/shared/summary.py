"""The README's five-line benchmark summary, made from the benchmarks' results files
(bench/<topic>/results/*.json).

    python bench/shared/summary.py

Prints five Markdown bullet lines: what belongs between README.md's ``<!-- bench-summary:start -->``
and ``<!-- bench-summary:end -->`` (tests/docs/test_docs_benchmarks.py checks that it is there, word for
word). The same lines open the documentation site's benchmark index (docs/benchmarks/index.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from docs_hook import ROOT, inline, value  # noqa: E402  (tools/docs_hook.py: the site's reader)


def lines(root: Path = ROOT) -> list:
    """The five summary lines; a missing results file or key raises docs_hook.ResultsError."""
    def v(name, path, fmt):
        return inline(name, path, fmt, root)

    hp = "bench/hotpath/results/hotpath.json"
    ratio = {b: v(hp, f"facade_vs_native.{b}.ratio", ".3f") for b in ("torch", "accelerate", "horovod")}
    iqr = value(hp, "facade_vs_native.horovod.ratio_iqr", root)
    acc = "bench/time_to_accuracy/results/accuracy.json"
    trainer, example = '["Trainer, fp32 (1 process, 2 threads)"]', '["example, fp32 (python, 1 process, 2 threads)"]'
    sc, net = "bench/step/results/scaling.json", "bench/network/results/network_accum4_repeat.json"
    ml = "bench/memory_layouts/results/memory_layouts.json"
    ds = "bench/deepspeed/results/deepspeed.json"

    mib = 2 ** 20
    total = {layout: value(ml, f"rows[model=bert,processes=4,layout={layout}].bytes.total", root) / mib
             for layout in ("ddp", "fsdp", "hsdp", "fsdp_tp")}
    ac = value(ml, '["verdict"]["bert: saved for backward with AC <= 0.35 x without"].value', root)
    comp = value(hp, "eager_vs_compiled.compile_s_per_repeat", root)
    return [
        f"- **Facade overhead** (facade / hand-written native training step, paired in one launch, 2 processes): "
        f"torch {ratio['torch']}, Accelerate {ratio['accelerate']}, Horovod {ratio['horovod']} "
        f"(quartiles {iqr[0]:.2f}-{iqr[1]:.2f}).",
        f"- **Scaling**, 1 → 2 processes on 2 cores: efficiency torch {v(sc, 'results.torch.efficiency', '.2f')}, "
        f"Accelerate {v(sc, 'results.accelerate.efficiency', '.2f')}, "
        f"Horovod {v(sc, 'results.horovod.efficiency', '.2f')}; "
        f"2 hosts over 1 Gbit/s with bf16 and accumulation 4: torch "
        f"{v(net, 'rows.0.efficiency', '.2f')}, Accelerate {v(net, 'rows.2.efficiency', '.2f')}.",
        f"- **Time to 80 % validation accuracy**: the example "
        f"{v(acc, f'summary{example}.time_to_threshold_s.mean', '.0f')}"
        f" ± {v(acc, f'summary{example}.time_to_threshold_s.std', '.0f')} s, Hugging Face `Trainer` "
        f"{v(acc, f'summary{trainer}.time_to_threshold_s.mean', '.0f')} ± "
        f"{v(acc, f'summary{trainer}.time_to_threshold_s.std', '.0f')} s "
        f"({v(acc, f'summary{example}.time_ratio_vs_reference', '.2f')} × wall, "
        f"{v(acc, f'summary{example}.cpu_ratio_vs_reference', '.2f')} × CPU time; 3 seeds each).",
        f"- **torch.compile** (inductor) step / eager step on CPU: "
        f"{v(hp, 'eager_vs_compiled.compiled_over_eager', '.3f')}"
        f" under torchrun × 2 (target 0.85 not met: BLAS matmuls dominate), after {min(comp):.0f}-{max(comp):.0f} s "
        f"of compiling per launch.",
        f"- **Memory per rank** (parameters, gradients, AdamW state; BERT, 4 ranks): DDP {total['ddp']:.1f} MiB, "
        f"FSDP {total['fsdp']:.1f}, HSDP 2x2 {total['hsdp']:.1f}, FSDP x TP {total['fsdp_tp']:.1f}; activation "
        f"checkpointing keeps {ac:.3f} × the bytes saved for backward; DeepSpeed ZeRO-3 (2 ranks, parameters and "
        f"AdamW state) {v(ds, 'summary.zero3.total_vs_zero0', '.3f')} × ZeRO-0's, "
        f"ZeRO-2 {v(ds, 'summary.zero2.total_vs_zero0', '.3f')} × (docs/deepspeed.md).",
    ]


if __name__ == "__main__":
    print("\n".join(lines()))
