"""Writes scikit-learn's bundled handwritten digits as CSV (no download).

1,797 images of 8x8 pixels with values 0..16, and their labels 0..9: columns
`pixel_00` .. `pixel_63` (floats) and `label` (int).
"""

import csv
import os

PIXELS = 64
FEATURE_KEYS = [f"pixel_{i:02d}" for i in range(PIXELS)]
LABEL_KEY = "label"
FILE_NAME = "digits.csv"


def write_digits_csv(directory: str) -> str:
    """Writes `directory/digits.csv` once (atomically).

    Args:
        directory: the folder (made if missing); an existing file is kept.

    Returns:
        The CSV's path.
    """
    from sklearn.datasets import load_digits

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILE_NAME)
    if os.path.exists(path):
        return path
    digits = load_digits()
    partial = path + ".partial"
    with open(partial, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(FEATURE_KEYS + [LABEL_KEY])
        for image, label in zip(digits.data, digits.target):
            writer.writerow([f"{v:.1f}" for v in image] + [int(label)])
    os.replace(partial, path)
    return path
