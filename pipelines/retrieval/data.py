"""Synthetic user-item interactions with a known structure, written as CSV.

Users and items belong to latent clusters (`CLUSTERS` of them, `ITEMS_PER_CLUSTER`
items each). An interaction picks a user uniformly; with probability
`IN_CLUSTER` the item is drawn uniformly from the user's cluster, otherwise
uniformly from all items. So the best possible retrieval is known: the top
`ITEMS_PER_CLUSTER` items for a user are its cluster's, and a model that has
found the clusters reaches `oracle_recall_at_k` on held-out interactions, where
chance is k / ITEMS. Nothing here is downloaded; the seed fixes everything.

Columns: `user_id`, `item_id` (ints).
"""

import csv
import os

import numpy as np

USERS = 200
CLUSTERS = 20
ITEMS_PER_CLUSTER = 10
ITEMS = CLUSTERS * ITEMS_PER_CLUSTER
IN_CLUSTER = 0.8
INTERACTIONS = 10000
SEED = 0
USER_KEY = "user_id"
ITEM_KEY = "item_id"
FILE_NAME = "interactions.csv"


def clusters(seed: int = SEED) -> tuple:
    """The latent clusters: ids say nothing about them.

    Args:
        seed: the generator's seed.

    Returns:
        `(cluster of each user, cluster of each item)`, two int arrays.
    """
    rng = np.random.RandomState(seed)
    user_cluster = rng.randint(0, CLUSTERS, USERS)
    item_cluster = rng.permutation(np.arange(ITEMS) % CLUSTERS)
    return user_cluster, item_cluster


def probabilities(seed: int = SEED) -> np.ndarray:
    """The generating distribution.

    Args:
        seed: the generator's seed.

    Returns:
        P(item | user), a USERS x ITEMS matrix.
    """
    user_cluster, item_cluster = clusters(seed)
    same = (user_cluster[:, None] == item_cluster[None, :]).astype(np.float64)
    return IN_CLUSTER * same / ITEMS_PER_CLUSTER + (1.0 - IN_CLUSTER) / ITEMS


def interactions(count: int = INTERACTIONS, seed: int = SEED) -> tuple:
    """(user, item) pairs drawn from `probabilities`.

    Args:
        count: how many.
        seed: the generator's seed.

    Returns:
        `(users, items)`, two int arrays.
    """
    user_cluster, item_cluster = clusters(seed)
    members = [np.flatnonzero(item_cluster == c) for c in range(CLUSTERS)]
    rng = np.random.RandomState(seed + 1)
    users = rng.randint(0, USERS, count)
    in_cluster = rng.rand(count) < IN_CLUSTER
    anywhere = rng.randint(0, ITEMS, count)
    within = np.array([rng.choice(members[user_cluster[u]]) for u in users])
    return users, np.where(in_cluster, within, anywhere)


def oracle_recall_at_k(users, items, k: int = 10, seed: int = SEED) -> float:
    """Recall@k of ranking by the true `probabilities` (ties broken by item id).

    The most any model can expect on these interactions.

    Args:
        users: the interactions' user ids.
        items: their item ids.
        k: how many of the top-ranked items count.
        seed: the generator's seed (the data's).

    Returns:
        The share of interactions whose item is in the user's top k.
    """
    scores = probabilities(seed)[np.asarray(users)]
    return recall_at_k(scores, items, k)


def recall_at_k(scores: np.ndarray, items, k: int = 10) -> float:
    """Share of rows whose true item is among the k highest `scores`.

    Ties are broken towards lower item ids, the same for every scorer.

    Args:
        scores: one row per interaction, one column per item.
        items: each interaction's true item.
        k: how many of the top-scored items count.

    Returns:
        The share, a float in [0, 1].
    """
    items = np.asarray(items)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float(np.mean(np.any(top == items[:, None], axis=1)))


def write_interactions_csv(directory: str, count: int = INTERACTIONS, seed: int = SEED) -> str:
    """Writes `directory/interactions.csv` once (atomically).

    Args:
        directory: the folder (made if missing); an existing file is kept.
        count: the interactions to draw.
        seed: the generator's seed.

    Returns:
        The CSV's path.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILE_NAME)
    if os.path.exists(path):
        return path
    users, items = interactions(count, seed)
    partial = path + ".partial"
    with open(partial, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([USER_KEY, ITEM_KEY])
        writer.writerows(zip(users.tolist(), items.tolist()))
    os.replace(partial, path)
    return path
