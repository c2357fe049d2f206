"""One-off probes, kept as they ran on the H100 host
(2026-11-25) so that the figures docs/PERFORMANCE.md quotes from them have their command:

    source scripts/device_env.sh; python3 bench/probes/gpu_probe.py   # the graph launch call's host time, GPU times
    source scripts/device_env.sh; python3 bench/probes/gpu_pool.py    # GPU time per request of the bench's pool
    source scripts/device_env.sh; python3 bench/probes/gpu_kernels.py # per-kernel GPU time of those graphs
    source scripts/device_env.sh; python3 bench/probes/gpu_cold.py    # the launch call after a 256 KB write
    source scripts/device_env.sh; python3 bench/probes/armed.py       # a graph launched ahead, let go by a flag
    source scripts/device_env.sh; python3 bench/probes/keep_warm.py   # a lone call after idle, kept warm or not
    source scripts/device_env.sh; python3 bench/probes/cold_call.py   # the same after sleep, epoll or spin: wall and CPU time
    source scripts/device_env.sh; python3 bench/probes/kernel_copy.py # graph copies by memcpy node or by kernel
    source scripts/device_env.sh; python3 bench/probes/http2_options.py 10 300 256551  # echo with HTTP/2 options
    source scripts/device_env.sh; python3 bench/probes/topp_walk.py OUT.json  # sample GPU times where the walk checks; tokens

and one of the CPU device's sampler (the dev machine, with this checkout on ``PYTHONPATH``):

    python3 bench/probes/ref_batch.py   # the torch reference: a batch of rows at once against row by row

Each prints JSON or a table; none is part of the service or its tests.
"""
