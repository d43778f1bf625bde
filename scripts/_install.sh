# Sourced by scripts/setup.sh, install_vllm.sh and install_verl.sh (from the project root):
# `pkg_install ARGS...` and `pkg_uninstall NAMES...` change .venv with uv's pip interface.
# PKG_PYTHON=DIR/bin/python pkg_install ... installs into another environment (.venv-verifiers).
#
# uv resolves once and downloads and unpacks in parallel: on a 2-core machine the whole
# set-up takes well under a minute where pip took three. uv itself comes from PyPI through
# the venv's pip, once.
#
# uv reads none of pip's configuration, so it is handed the places pip is configured to use
# here (pip's config files and PIP_* variables: index-url, extra-index-url, find-links,
# constraint, cert), and considers every index for every package, as pip does. On this
# project's machines that is how torch's CPU build is found on local disk; elsewhere
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu works for both.

UV=.venv/bin/uv

uv_ready() {
  [ -x "$UV" ] || .venv/bin/pip install --quiet "uv>=0.9,<1"
}

# pip's configured sources as uv arguments, one per line; "cert FILE" for the CA bundle.
pip_sources() {
  .venv/bin/python - <<'PYEOF'
import re
import shlex
import subprocess

listed = subprocess.run([".venv/bin/pip", "config", "list"], capture_output=True, text=True)
# Later scopes override earlier ones, as in pip: files (global, user, site), then PIP_* vars.
rank = {"global": 0, "install": 0, "user": 1, "site": 2, ":env:": 3}
found: dict[str, tuple[int, str]] = {}
for line in listed.stdout.splitlines():
    match = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)='(.*)'", line.strip())
    if match and match.group(1) in rank:
        scope, key, value = match.groups()
        if rank[scope] >= found.get(key, (-1, ""))[0]:
            found[key] = (rank[scope], value)
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}
for key, flag in flags.items():
    for value in shlex.split(found.get(key, (0, ""))[1]):
        print(flag)
        print(value)
if "cert" in found:
    print("cert")
    print(found["cert"][1])
PYEOF
}

pkg_install() {
  uv_ready
  local sources=() line cert=""
  while IFS= read -r line; do
    if [ "$line" = "cert" ]; then
      IFS= read -r cert
    else
      sources+=("$line")
    fi
  done < <(pip_sources)
  if [ -n "$cert" ]; then export SSL_CERT_FILE="$cert"; fi
  # Bytecode: Python writes it lazily, on first import, for the modules a process uses (a
  # fraction of torch, transformers and vLLM). Where PYTHONDONTWRITEBYTECODE is set it never
  # would, and every process would compile them again on import (the suite took twice as
  # long), so there everything is compiled now (about 70 s on 2 cores; uv compiles the whole
  # environment each time it installs).
  local compile=()
  if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then compile=(--compile-bytecode); fi
  "$UV" pip install --python "${PKG_PYTHON:-.venv/bin/python}" "${compile[@]}" \
    --index-strategy unsafe-best-match "${sources[@]}" "$@"
}

pkg_uninstall() {
  uv_ready
  "$UV" pip uninstall --python .venv/bin/python "$@"
}
