"""Save a small "pretrained" ``transformers`` model and its tokenizer to a local directory (nothing fetched).

The fine-tuning examples (``+experiment=finetune_lora``) start from it, as they would from a model you
downloaded once: ``python examples/make_pretrained.py /tmp/tiny-gpt2`` then
``python -m pipeline +experiment=finetune_lora model.pretrained=/tmp/tiny-gpt2``.

The tokenizer is a byte-level BPE trained on the project's synthetic corpus; the weights are a seeded random
initialisation briefly trained on that corpus (a few hundred steps on CPU), so fine-tuning starts from a model
that has learned something.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.config.workload import DataConfig
from pipeline.workload.corpus import generate_corpus, train_tokenizer

ARCHS = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128},
    "llama": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write (config.json, model.safetensors, tokenizer)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="gpt2")
    ap.add_argument("--steps", type=int, default=100, help="pre-training steps on the synthetic corpus")
    args = ap.parse_args()
    data = DataConfig()
    corpus = generate_corpus(data)
    tokenizer = train_tokenizer(corpus, data)
    values = dict(ARCHS[args.arch])
    model_type = values.pop("model_type")
    ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **ids, **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokens = torch.tensor([t for line in corpus for t in tokenizer.encode(line + " </s>")])
    n = tokens.numel() // 32
    samples = tokens[: n * 32].view(n, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(args.steps):
        batch = samples[torch.randint(0, n, (8,))]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(args.out))
    tokenizer.save_pretrained(str(args.out))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"saved {args.arch} ({n_params} parameters, loss {loss.item():.3f}) to {args.out}")


if __name__ == "__main__":
    main()
