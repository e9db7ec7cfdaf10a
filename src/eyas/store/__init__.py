"""The hidden-state store: sharded safetensors + manifest.json, crash-safe, memory-mapped. See docs/store.md."""

from eyas.store.reader import SampleStream, Store, StoredSample, collate
from eyas.store.writer import StoreWriter

__all__ = ["SampleStream", "Store", "StoredSample", "StoreWriter", "collate"]
