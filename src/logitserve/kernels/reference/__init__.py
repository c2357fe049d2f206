"""The torch reference backend: every op written plainly in torch, one module per op.

It is what ``backend="torch"`` runs (the default on a machine with no GPU) and what the tests
hold the Triton kernels to. It never imports triton.
"""
