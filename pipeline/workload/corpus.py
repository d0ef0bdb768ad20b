"""The run's data assets, made once by prepare-dirs: the tokenizer and the token stream, from the configured source.

* ``synthetic``: sentences from a small grammar (the embedded default), a BPE tokenizer trained on them;
* ``text`` / ``jsonl``: local files (a glob; one document per text file or per JSONL line's ``data.field``),
  tokenized with ``data.tokenizer`` (a local directory), the pretrained model's tokenizer, or one trained here;
* ``tokens``: flat uint16/uint32 token files, read in place (memory-mapped) and never copied: their size and
  hash are recorded in ``assets/data.json``, and train refuses a file that changed since.

Every source file is fingerprinted in ``assets/data.json``. Nothing is fetched from a hub.
"""

from __future__ import annotations

import glob
import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pipeline.config.workload import DataConfig
from pipeline.errors import ConfigError, VerificationError
from pipeline.storage.atomic import read_json, write_json_atomic
from pipeline.storage.integrity import hash_file

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
TOKENS_FILE = "tokens.safetensors"
DATA_FILE = "data.json"
TOKENIZER_DIR = "tokenizer"

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


def source_files(cfg: DataConfig) -> list[Path]:
    """The files ``data.path`` names, sorted (the order is part of the data); at least one."""
    files = sorted({Path(p).resolve() for p in glob.glob(str(Path(str(cfg.path)).expanduser()), recursive=True)})
    files = [f for f in files if f.is_file()]
    if not files:
        raise ConfigError(f"data.path={cfg.path} matches no file (data.source={cfg.source})")
    return files


def _documents(cfg: DataConfig, files: list[Path]) -> list[str]:
    if cfg.source == "text":
        return [f.read_text(encoding="utf-8", errors="replace") for f in files]
    docs: list[str] = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{f}:{n} is not a JSON line ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(cfg.field), str):
                raise ConfigError(f"{f}:{n} has no string field {cfg.field!r} (set data.field=<name>)")
            docs.append(record[cfg.field])
    return docs


def tokenizer_source(cfg: DataConfig, pretrained: str | None) -> Path | None:
    """The local tokenizer directory to use, or None (train one on the corpus)."""
    if cfg.tokenizer:
        return Path(cfg.tokenizer).expanduser()
    if pretrained and (Path(pretrained).expanduser() / "tokenizer.json").is_file():
        return Path(pretrained).expanduser()
    return None


def _load_tokenizer_dir(path: Path) -> PreTrainedTokenizerBase:
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        why = str(e).splitlines()[0][:200]
        raise ConfigError(f"data.tokenizer={path}: not a tokenizer directory ({why})") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"data.tokenizer={path} has no eos token (documents are separated by it)")
    return tok


def fingerprint(files: list[Path]) -> list[dict[str, Any]]:
    return [{"path": str(f), "bytes": f.stat().st_size, "hash": hash_file(f)} for f in files]


def build_assets(cfg: DataConfig, out_dir: Path, pretrained: str | None = None) -> None:
    """Write the tokenizer, the token stream (not for ``tokens``: read in place) and ``data.json`` into
    ``out_dir`` (a staging dir of prepare-dirs)."""
    files = source_files(cfg) if cfg.source != "synthetic" else []
    tok_dir = tokenizer_source(cfg, pretrained)
    if cfg.source == "tokens" and tok_dir is None:
        raise ConfigError("data.source=tokens needs the tokenizer the files were made with: data.tokenizer=<dir>")
    if cfg.source == "synthetic":
        corpus = generate_corpus(cfg)
    else:
        corpus = [] if cfg.source == "tokens" else _documents(cfg, files)
    tokenizer = _load_tokenizer_dir(tok_dir) if tok_dir is not None else train_tokenizer(corpus, cfg)
    tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
    if cfg.source != "tokens":
        ids: list[int] = []
        for doc in corpus:
            ids.extend(tokenizer.encode(doc, add_special_tokens=False))
            ids.append(int(tokenizer.eos_token_id))  # type: ignore[arg-type]
        save_file({"tokens": torch.tensor(ids, dtype=torch.int64)}, str(out_dir / TOKENS_FILE))
    elif len(tokenizer) > 2**16 and cfg.token_dtype == "uint16":
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens: uint16 cannot hold them (data.token_dtype)")
    record = {"source": cfg.source, "dtype": cfg.token_dtype, "files": fingerprint(files)}
    write_json_atomic(out_dir / DATA_FILE, record)


def load_tokenizer(assets: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(assets / TOKENIZER_DIR), local_files_only=True)


def recorded_files(assets: Path) -> list[dict[str, Any]]:
    path = assets / DATA_FILE
    return list(read_json(path).get("files", [])) if path.exists() else []


def check_unchanged(assets: Path) -> None:
    """Refuse token files read in place that changed since prepare-dirs fingerprinted them (rank 0, at start)."""
    for rec in recorded_files(assets) if data_source(assets) == "tokens" else []:
        path = Path(rec["path"])
        now = path.stat().st_size if path.exists() else None
        if now != rec["bytes"] or hash_file(path) != rec["hash"]:
            raise VerificationError(
                f"data file {path} changed since the run was prepared (recorded {rec['bytes']} bytes, hash "
                f"{rec['hash'][:12]}; now {now if now is not None else 'missing'}): restore it, or start a new run "
                "(a resumed run must read the same tokens)"
            )


def data_source(assets: Path) -> str:
    path = assets / DATA_FILE
    return str(read_json(path).get("source", "synthetic")) if path.exists() else "synthetic"
