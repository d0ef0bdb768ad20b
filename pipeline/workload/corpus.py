"""The run's data assets, made once by prepare-dirs: the tokenizer and the token stream, from the configured source.

* ``synthetic``: sentences from a small grammar (the embedded default), a BPE tokenizer trained on them;
* ``text`` / ``jsonl``: local files (a glob; one document per text file or per JSONL line's ``data.field``),
  tokenized with ``data.tokenizer`` (a local directory), the pretrained model's tokenizer, or one trained here;
* ``tokens``: flat uint16/uint32 token files, read in place (memory-mapped) and never copied: their size and
  hash are recorded in ``assets/data.json``, and train refuses a file that changed since.

Every source file is fingerprinted in ``assets/data.json``. Nothing is fetched from a hub.

A tokenizer trained here is built, saved and applied with ``tokenizers`` alone, and the token stream written with
``safetensors``' numpy API: prepare-dirs imports neither torch nor ``transformers`` (seconds of CPU per run) unless
it loads a tokenizer directory it was given. What it writes is what ``transformers`` writes (``AutoTokenizer``
loads it; the token stream is the same bytes).
"""

from __future__ import annotations

import glob
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pipeline.config.workload import DataConfig
from pipeline.errors import ConfigError, VerificationError
from pipeline.storage.atomic import read_json, write_json_atomic
from pipeline.storage.integrity import hash_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

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


SPECIAL_ROLES = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def _trained(corpus: list[str], cfg: DataConfig) -> Tokenizer:
    """A BPE tokenizer trained on ``corpus`` (``tokenizers`` only), with the post-processor ``transformers`` gives
    it (no special tokens added), so its ``tokenizer.json`` is the one ``save_pretrained`` writes."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIALS, show_progress=False)
    )
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    return tok


def train_tokenizer(corpus: list[str], cfg: DataConfig) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - seconds to import: only where needed

    return PreTrainedTokenizerFast(tokenizer_object=_trained(corpus, cfg), **SPECIAL_ROLES)


def _save_trained(tok: Tokenizer, out: Path) -> None:
    """What ``PreTrainedTokenizerFast.save_pretrained`` writes for a tokenizer trained here, without
    ``transformers``: ``tokenizer.json`` and a ``tokenizer_config.json`` naming its special tokens."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(1e30), **SPECIAL_ROLES}
    write_json_atomic(out / "tokenizer_config.json", config)


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
    from transformers import AutoTokenizer  # noqa: PLC0415 - seconds to import: only where needed

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
    ids: list[int] = []
    if tok_dir is None:  # trained here: tokenizers alone
        trained = _trained(corpus, cfg)
        _save_trained(trained, out_dir / TOKENIZER_DIR)
        eos = trained.token_to_id(SPECIAL_ROLES["eos_token"]) or 0  # a special token: always in the vocabulary
        for doc in corpus:  # one at a time: encode_batch starts threads, which a later fork warns about
            ids.extend(trained.encode(doc, add_special_tokens=False).ids)
            ids.append(eos)
    else:
        tokenizer = _load_tokenizer_dir(tok_dir)
        tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
        if cfg.source == "tokens" and len(tokenizer) > 2**16 and cfg.token_dtype == "uint16":
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens: uint16 cannot hold them (data.token_dtype)")
        for doc in corpus:
            ids.extend(tokenizer.encode(doc, add_special_tokens=False))
            ids.append(int(tokenizer.eos_token_id))  # type: ignore[arg-type]
    if cfg.source != "tokens":
        save_file({"tokens": np.array(ids, dtype=np.int64)}, str(out_dir / TOKENS_FILE))
    record = {"source": cfg.source, "dtype": cfg.token_dtype, "files": fingerprint(files)}
    write_json_atomic(out_dir / DATA_FILE, record)


def load_tokenizer(assets: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # noqa: PLC0415 - seconds to import: only where needed

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
