# Source this on the lent GPU machine (bash): makes `import logitserve.*` work from this
# checkout's src/ without pip (that machine has no network) and installs any wheels carried in .whl/;
# tritonclient's wheels carried in .whl-tc/ (tritonclient, protobuf < 7, python-rapidjson,
# ml-dtypes, packaging) go to a directory of their own, which tests/test_kserve.py's tritonclient
# process gets as its only PYTHONPATH (LOGITSERVE_TRITONCLIENT_PYTHONPATH).
#   source scripts/device_env.sh
site=/tmp/logitserve-site
mkdir -p "$site"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site/deps" .whl/*.whl || return 1
fi
if compgen -G ".whl-tc/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site-tritonclient" .whl-tc/*.whl || return 1
  export LOGITSERVE_TRITONCLIENT_PYTHONPATH="$site-tritonclient"
fi
export PYTHONPATH="$PWD/src:$site/deps:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
