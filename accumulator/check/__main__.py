"""`python -m tfx_gradient_accumulator.accumulator.check module:function`: see `check.main`."""

import sys

from tfx_gradient_accumulator.accumulator.check import main

sys.exit(main())
