"""Training data: a corpus generated from a small grammar, a BPE tokenizer trained on it locally, and a
resumable, rank-aware sample order. Nothing is fetched from a hub.

The data position is ``(epoch, offset)`` into a per-epoch permutation seeded by ``train.seed + epoch``; it is
saved in every checkpoint, so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pipeline.config.schema import DataConfig
from pipeline.errors import ConfigError

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
TOKENS_FILE = "tokens.safetensors"

_SUBJECTS = ["the cat", "a dog", "the model", "my friend", "the robot", "a bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "builds", "finds", "reads", "carries", "trains", "moves"]
_OBJECTS = ["a red ball", "the old book", "some data", "a small box", "the green tree", "a long road"]
_TAILS = ["today", "at night", "in the park", "with care", "again", "very slowly", "on the table"]


def generate_corpus(cfg: DataConfig) -> list[str]:
    rng = random.Random(cfg.seed)
    return [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)} ."
        for _ in range(cfg.num_documents)
    ]


def train_tokenizer(corpus: list[str], cfg: DataConfig) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_assets(cfg: DataConfig, out_dir: Path) -> None:
    """Write the tokenizer files and the token stream into ``out_dir`` (a staging dir of prepare-dirs)."""
    corpus = generate_corpus(cfg)
    tokenizer = train_tokenizer(corpus, cfg)
    tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    ids: list[int] = []
    for line in corpus:
        ids.extend(tokenizer.encode(line, add_special_tokens=False))
        ids.append(tokenizer.eos_token_id)
    save_file({"tokens": torch.tensor(ids, dtype=torch.int64)}, str(out_dir / TOKENS_FILE))


def load_tokenizer(assets: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(assets / "tokenizer"))


@dataclass
class DataPosition:
    epoch: int = 0
    offset: int = 0


class SampleStream:
    """Fixed-length samples; step batches are slices of a seeded permutation, split by rank."""

    def __init__(self, assets: Path, seq_len: int, seed: int, micro_batch_size: int, rank: int, world_size: int):
        tokens = load_file(str(assets / TOKENS_FILE))["tokens"]
        n = tokens.numel() // seq_len
        self.samples = tokens[: n * seq_len].view(n, seq_len)
        self.seed = seed
        self.mbs = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.pos = DataPosition()
        self._perm_cache: tuple[int, torch.Tensor] | None = None
        if n < micro_batch_size * world_size:
            raise ConfigError(
                f"the corpus gives only {n} samples of data.seq_len={seq_len} tokens, fewer than "
                f"train.micro_batch_size x strategy.world_size = {micro_batch_size * world_size}: raise "
                "data.num_documents or lower data.seq_len / train.micro_batch_size"
            )

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm_cache = (epoch, torch.randperm(self.samples.shape[0], generator=gen))
        return self._perm_cache[1]

    def next_batch(self) -> torch.Tensor:
        global_bs = self.mbs * self.world_size
        if self.pos.offset + global_bs > self.samples.shape[0]:
            self.pos = DataPosition(self.pos.epoch + 1, 0)
        idx = self._perm(self.pos.epoch)[self.pos.offset : self.pos.offset + global_bs]
        self.pos = DataPosition(self.pos.epoch, self.pos.offset + global_bs)
        return self.samples[idx[self.rank * self.mbs : (self.rank + 1) * self.mbs]]
