"""The machinery calls run on: the device handle and its launch thread (``device.py``), the
batcher that puts compatible calls in one launch (``batcher.py``), CUDA graph replay
(``graphs.py``), host-to-device staging (``staging.py``), warm-up compilation
(``precompile.py``) and the event loop that busy-polls for a lone client (``busy_poll.py``,
``occupancy.py``). It knows nothing of the wire: the front doors (``server/api/``) and the
operators (``server/ops/``) sit above it.
"""
