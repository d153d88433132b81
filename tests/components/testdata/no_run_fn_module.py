"""A module file without `run_fn`: the executor must refuse it clearly."""


def train(fn_args):
    raise AssertionError("never called")
