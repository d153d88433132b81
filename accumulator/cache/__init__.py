"""Gradient caching's mechanics: the two passes, and the gathering across replicas.

For losses that couple the batch (contrastive, in-batch negatives), `GradientCache` (the
class: `accumulator.gradient_cache`) runs `cache_passes` (representations first, then each
micro-batch's gradients from the cached ones); `across_replicas` gathers representations
across replicas; `contrastive` holds the losses its tests and guides use.

May import: core, rows.
"""
