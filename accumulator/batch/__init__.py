"""The micro-batch: fit's batch split inside one step, its size found, out-of-memory survived.

`fit_micro_batches` (`micro_batch_size=b`: fit's batch trained as micro-batches in one
step), `fit_auto_micro_batch` and `micro_batch_changes` (`micro_batch_size="auto"` and its
records), `fit_auto_distributed` ("auto" under a strategy: the step split so that no
out-of-memory error comes while a collective waits), `auto_batches` (what both "auto" paths
share: the batch taken eagerly, its elements, the records), `micro_batch` and `micro_batch_workers` (`find_micro_batch`), `out_of_memory`
(`fit_with_out_of_memory_recovery`), `backup` (the state a failed step puts back).

May import: core, rows, noise, window, schedules.
"""
