"""Windows whose length changes while training: schedules, "auto", the effective batch's target.

`callbacks` (`AccumulationSchedule`, `EpochWindows`), `auto_batch` (`AutoAccumulation`,
the window grown with the measured noise scale), `batch_target` (the effective batch a
schedule aims at), `lr_scaling` (the learning rate scaled with the window).

May import: core, rows, noise, window.
"""
