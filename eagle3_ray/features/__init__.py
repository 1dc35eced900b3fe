"""Feature records and the offline feature store (docs/feature-store.md). No Ray in here."""

from eagle3_ray.features.preflight import PreflightReport, check_disk, projected_bytes
from eagle3_ray.features.record import (
    AUX_HIDDEN,
    INPUT_IDS,
    LAST_HIDDEN,
    LOSS_MASK,
    SAMPLE_ID,
    TENSOR_FIELDS,
    bf16_to_uint16,
    bytes_per_token,
    to_torch_record,
    uint16_to_bf16,
    validate_record,
)
from eagle3_ray.features.reader import FeatureStore, open_store
from eagle3_ray.features.shards import ShardInfo
from eagle3_ray.features.store import (
    FeatureStoreWriter,
    StoreMeta,
    append_reject,
    check_compatible,
    cleanup_orphans,
    completed_ids,
    create_store,
    manifest,
    read_meta,
)
from eagle3_ray.rejects import read_rejects, rejected_ids

__all__ = [
    "AUX_HIDDEN",
    "INPUT_IDS",
    "LAST_HIDDEN",
    "LOSS_MASK",
    "SAMPLE_ID",
    "TENSOR_FIELDS",
    "FeatureStore",
    "FeatureStoreWriter",
    "PreflightReport",
    "ShardInfo",
    "StoreMeta",
    "append_reject",
    "bf16_to_uint16",
    "bytes_per_token",
    "check_compatible",
    "check_disk",
    "cleanup_orphans",
    "completed_ids",
    "create_store",
    "manifest",
    "open_store",
    "projected_bytes",
    "read_meta",
    "read_rejects",
    "rejected_ids",
    "to_torch_record",
    "uint16_to_bf16",
    "validate_record",
]
