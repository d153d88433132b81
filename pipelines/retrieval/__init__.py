"""Retrieval with in-batch negatives (synthetic user-item clusters): a two-tower pipeline."""
