"""TFX components: `AccumulatingTrainer`, a drop-in Trainer with gradient accumulation.

`component.py` declares it, `trainer_options.py` holds `TrainerOptions` (its less
common options, one value) and how its values travel as execution properties,
`executor.py` runs it, `fn_args_utils.py` builds what the user's run_fn sees,
`settings.py` checks and resolves accumulation settings and
`noise_scale.py` records the gradient noise scale a run measured.
"""

if __name__ != "tfx_gradient_accumulator.components":   # `import components` from a checkout's root: a second copy
    raise ImportError(f"`import {__name__}` would load the library a second time under another name; "
                      "import tfx_gradient_accumulator.components instead.")

from tfx_gradient_accumulator.components.component import AccumulatingTrainer
from tfx_gradient_accumulator.components.trainer_options import TrainerOptions

__all__ = ["AccumulatingTrainer", "TrainerOptions"]
