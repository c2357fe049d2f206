"""Sequences: sampling state the server keeps per sequence, so that a frontend names its
sequences in each Sample instead of resending every parameter, prompt and output.

``table.py`` (each sequence's state and the server's table of them), ``open.py``
(OpenSequences and CloseSequences), ``update.py`` (UpdateSequences), ``sample.py`` (Sample by
``sequence_ids``) and ``lists.py`` (their lists read on the device by the Triton kernels).
"""
