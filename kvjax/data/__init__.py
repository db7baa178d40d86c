"""Synthetic reasoning-trace testbed: vocabulary/tokenizer, seeded generator, metrics."""

from kvjax.data.batching import batch, collate, iter_batches, step_batches
from kvjax.data.config import TestbedConfig
from kvjax.data.metrics import (
    answer_accuracy,
    category_accuracy,
    category_counts,
    check_answer,
    dataset_statistics,
    parse_answer,
    predictions_from_logits,
)
from kvjax.data.testbed import (
    CATEGORIES,
    COMPUTE,
    COPY_NAME,
    COPY_OP,
    LINE_KINDS,
    LOOKUP_FAR,
    LOOKUP_NEAR,
    OTHER,
    SPLITS,
    Problem,
    apply_op,
    generate_problem,
)
from kvjax.data.vocab import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    VOCAB_SIZE,
    build_tokenizer,
    decode,
    save_tokenizer,
)

__all__ = [
    "BOS_ID", "CATEGORIES", "COMPUTE", "COPY_NAME", "COPY_OP", "EOS_ID", "LINE_KINDS", "LOOKUP_FAR", "LOOKUP_NEAR", "OTHER",
    "PAD_ID", "SPLITS", "UNK_ID", "VOCAB_SIZE", "Problem", "TestbedConfig", "answer_accuracy", "apply_op",
    "batch", "build_tokenizer", "category_accuracy", "category_counts", "check_answer", "collate",
    "dataset_statistics", "decode", "generate_problem", "iter_batches", "parse_answer", "step_batches",
    "predictions_from_logits", "save_tokenizer",
]
