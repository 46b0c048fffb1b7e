#!/usr/bin/env bash
# A venv with verifiers' token-in-token-out client for test_verifiers_live.py (.ci/run makes one and passes its
# python as ROLLPOOL_VERIFIERS_PYTHON):   bash verifiers_venv.sh DIR [PYTHON]
#
# verifiers 0.3.1 is the last release with OpenAIChatCompletionsTokenClient (0.4 replaced it with a client of vLLM's
# /inference/v1/generate). Installed without its dependencies (datasets, mcp, prime-sandboxes, ... : minutes and
# ~600 MB, none of them imported by the client), plus the ones the client's imports need; ~25 s and ~200 MB.
set -euo pipefail
DIR="${1:?usage: verifiers_venv.sh DIR [PYTHON]}"
PY="${2:-python3}"
t0=$(date +%s)
"$PY" -m venv "$DIR"
"$DIR/bin/pip" install -q --disable-pip-version-check --no-deps verifiers==0.3.1
"$DIR/bin/pip" install -q --disable-pip-version-check --no-warn-conflicts openai==3.63.0 anthropic==2.17.0 renderers==0.1.12 tenacity==9.2.1 \
  rich==15.0.0 httpx==0.29.0
"$DIR/bin/python" -c 'from verifiers.legacy.clients.openai_chat_completions_token_client import OpenAIChatCompletionsTokenClient'
echo "verifiers_venv.sh: $DIR in $(( $(date +%s) - t0 )) s, $(du -sh "$DIR" | cut -f1)"
