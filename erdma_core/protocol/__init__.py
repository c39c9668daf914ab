"""The core's ground floor: the vocabulary every other package shares and that depends on nothing of the core.

- ``ops``: the one table of operations (wire codes, default algorithms, buffer sizes, bus factors);
- ``dtypes``: the dtypes eRDMA moves, with their wire codes;
- ``reduce_ops``: the reduction operators and the kernel that applies one;
- ``store``: the ``Store`` protocol a discovery method gives every rank;
- ``limits``: the bound on an encoded message's size.

Everything above imports from here; nothing here imports another package of the core
(``tests/test_layers.py`` checks both).
"""
