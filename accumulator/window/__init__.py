"""The accumulation window: the state and the rule that turn N micro-batches into one update.

`state` (`WindowState`: the variables saved, `WindowVariables`, and what Python notes,
`WindowNotes`), `window` (`AccumulationWindow`, the one update), `readings` (what it
shows), `between_windows` (closing, a new length, rows' room, between windows),
`window_saving` (what a checkpoint holds),
`weighting` (each micro-batch's weight, samples or a summed loss), `forwarding` (the inner
optimizer's attributes seen through the wrapper), `custom_loop` and `loop_notes` (what a
custom training loop is told).

May import: core, rows, noise.
"""
