"""Conversations held as tables: Parquet files (read with pyarrow) and `datasets.save_to_disk` directories (read
with `datasets.load_from_disk`).

pyarrow and datasets are an optional extra (`pip install 'eyas[datasets]'`), imported only when such a source is
read: a missing one is an `EyasError` that names the package. A table's rows are the records of a JSONL file: a
`messages` column (lists of {role, content}) or a ShareGPT `conversations` column (lists of {from, value}), and an
optional `id` column. eyas.data.sources validates each row like a JSONL record, so bad rows are skipped and counted
by the same reasons. The schema is checked before anything is read, so a table without a turn column fails before a
stage writes anything.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Iterator

from eyas.errors import EyasError

TURN_COLUMNS = {"messages": ("role", "content"), "conversations": ("from", "value")}  # column -> its turns' keys
ID_COLUMN = "id"
EXTRA = "pip install 'eyas[datasets]'"
BATCH_ROWS = 1024   # rows converted to Python per step: bounded memory on large tables

# what `datasets.save_to_disk` writes: a Dataset's files, or a DatasetDict's index of split subdirectories
DATASET_FILES = ("state.json", "dataset_info.json")
DATASET_DICT_FILE = "dataset_dict.json"


def _require(module: str, what: str):
    """Import an optional dependency, or stop with the one line that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise EyasError(f"reading {what} needs the package {module!r}, which is not installed ({EXTRA})") from e


def is_dataset_dir(path: Path) -> bool:
    """Whether `path` looks like a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (path / DATASET_DICT_FILE).is_file() or all((path / f).is_file() for f in DATASET_FILES)


def check_dataset_dir(path: Path) -> None:
    """Refuse a directory that `datasets.save_to_disk` did not write, before any package is imported."""
    if is_dataset_dir(path):
        return
    hint = ("; it holds .parquet files: pass one of them" if any(path.glob("*.parquet"))
            else "")
    raise EyasError(f"{path}: a directory, but not one written by datasets.save_to_disk (no {DATASET_DICT_FILE}, "
                    f"nor {' and '.join(DATASET_FILES)}){hint}")


def _turn_columns(schema, what: str) -> list[str]:
    """The turn columns of an Arrow schema, each checked to hold lists of structs with its turns' keys."""
    pa = _require("pyarrow", what)
    present = [c for c in TURN_COLUMNS if c in schema.names]
    if not present:
        raise EyasError(f"{what}: no 'messages' or 'conversations' column (its columns: "
                        f"{', '.join(schema.names) or 'none'}); expected 'messages' as lists of {{role, content}} "
                        f"or 'conversations' as lists of {{from, value}}")
    for name in present:
        kind, keys = schema.field(name).type, TURN_COLUMNS[name]
        is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        if not (is_list and pa.types.is_struct(kind.value_type)
                and all(k in [f.name for f in kind.value_type] for k in keys)):
            raise EyasError(f"{what}: column {name!r} has type {kind}, expected a list of {{{', '.join(keys)}}}")
    return present


def _rows(batches, columns: list[str]) -> Iterator[dict]:
    """Row dicts from Arrow record batches; a null cell is left out, like a key missing from a JSONL record."""
    for batch in batches:
        for row in batch.to_pylist():
            yield {k: row[k] for k in columns if row.get(k) is not None}


# --------------------------------------------------------------------------- Parquet

def _parquet_file(path: Path):
    pa = _require("pyarrow", "Parquet files")
    import pyarrow.parquet as pq   # a submodule of the package just found

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise EyasError(f"{path}: not a readable Parquet file ({e})") from e


def check_parquet(path: Path) -> None:
    """Refuse a Parquet file without a usable turn column, naming the columns it has."""
    _turn_columns(_parquet_file(path).schema_arrow, str(path))


def iter_parquet(path: Path) -> Iterator[tuple[str, dict]]:
    """("FILE row N", row) of each row of a Parquet file, in file order (N counts from 0)."""
    pa = _require("pyarrow", "Parquet files")
    f = _parquet_file(path)
    schema = f.schema_arrow
    columns = _turn_columns(schema, str(path)) + ([ID_COLUMN] if ID_COLUMN in schema.names else [])
    i = 0
    try:
        for row in _rows(f.iter_batches(batch_size=BATCH_ROWS, columns=columns), columns):
            yield f"{path} row {i}", row
            i += 1
    except pa.ArrowException as e:
        raise EyasError(f"{path} row {i}: cannot read ({e})") from e


# --------------------------------------------------------------------------- datasets.save_to_disk

def _load_dataset(path: Path, *, say=None):
    """The Dataset saved in `path`: itself, or the "train" split of a DatasetDict (said through `say`)."""
    check_dataset_dir(path)
    datasets = _require("datasets", "a datasets.save_to_disk directory")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:   # a damaged directory: one line naming it, whichever of datasets' errors it raised
        raise EyasError(f"{path}: datasets.load_from_disk failed ({type(e).__name__}: {e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise EyasError(f"{path}: a DatasetDict without a 'train' split (its splits: {', '.join(ds) or 'none'}); "
                            f"save the split to use on its own: ds[SPLIT].save_to_disk(DIR)")
        if say is not None:
            say(f"eyas: {path} is a DatasetDict (splits {', '.join(ds)}): reading its 'train' split")
        return ds["train"], f"{path} split train"
    return ds, str(path)


def check_dataset(path: Path) -> None:
    """Refuse a save_to_disk directory (or its train split) without a usable turn column."""
    ds, what = _load_dataset(path)
    _turn_columns(ds.data.schema, what)


def iter_dataset(path: Path, *, say=None) -> Iterator[tuple[str, dict]]:
    """("DIR row N", row) of each row of a saved Dataset ("DIR split train row N" for a DatasetDict), in order."""
    ds, what = _load_dataset(path, say=say)
    schema = ds.data.schema
    columns = _turn_columns(schema, what) + ([ID_COLUMN] if ID_COLUMN in schema.names else [])
    # Arrow tables of BATCH_ROWS rows each, in the dataset's order, instead of one Python dict per row
    batches = ds.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS)
    for i, row in enumerate(_rows(batches, columns)):
        yield f"{what} row {i}", row
