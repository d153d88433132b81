"""Handwritten digits (scikit-learn's bundled 8x8 images): a small CNN pipeline."""
