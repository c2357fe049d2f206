"""One module per op, each exposing ``cases(device) -> Iterable[Case]`` for bench/kernels.py."""
