"""Data: readers, normalisation to the canonical schema, splits, tokenizers, collation."""
