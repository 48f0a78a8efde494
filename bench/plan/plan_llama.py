"""A Llama training script for ``unified-dist plan`` (bench/plan/plan_scale.py, docs/plan.md): random weights,
offline, one AdamW step on a random batch. The layout comes from ``unified-dist plan``'s flags.

    unified-dist plan --nnodes 64 --nproc 8 --sharding fsdp --tp 4 bench/plan/plan_llama.py --size 1b
"""
import argparse

import torch

import unified_dist as ud

SIZES = {
    # TinyLlama-1.1B's shape: 1,100,048,384 parameters
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False),
    # a tiny one for the worked example: 4 layers, hidden 256, 8 heads
    "tiny": dict(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False),
}


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    args = parser.parse_args()
    ud.init(tp_plan="auto")
    config = LlamaConfig(**SIZES[args.size])
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    model, optimizer = ud.prepare(model, optimizer)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    loss = model(input_ids=ids, labels=ids).loss
    ud.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    ud.print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
