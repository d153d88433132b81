"""The rows of sparse gradients: an `Embedding`'s lookups, kept as Keras' large batch keeps them.

`lookups` tells the kinds of lookup apart (a per-token table, a table looked up once per
batch); `window_rows` keeps a window's rows in growing buffers; `row_room` gives those
buffers their room under XLA.

May import: core.
"""
