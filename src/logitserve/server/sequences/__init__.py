"""Sequences: sampling state the server keeps per sequence, so that a frontend names its
sequences in each Sample instead of resending every parameter, prompt and output.

``sequence.py`` (one sequence's state), ``table.py`` (the server's table of them), ``bounds.py``
(what they may hold: --max-sequences, --max-sequence-bytes, each token's share), ``open.py``
(OpenSequences and CloseSequences), ``update.py`` (UpdateSequences), ``sample.py`` (Sample by
``sequence_ids``) and ``lists.py`` (their lists read on the device by the Triton kernels).
"""
