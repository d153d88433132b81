"""Pipelines that use `AccumulatingTrainer`: `digits/` runs locally on shipped data."""

if __name__ != "tfx_gradient_accumulator.pipelines":   # `import pipelines` from a checkout's root: a second copy
    raise ImportError(f"`import {__name__}` would load the library a second time under another name; "
                      "import tfx_gradient_accumulator.pipelines instead.")
