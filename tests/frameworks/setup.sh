#!/usr/bin/env bash
# Installs the real upstream frameworks tests/route_agreement.rs runs (idempotent):
# a Python venv, Express 4 and 5, Go's net/http and Rails 6.1.
# Usage: setup.sh TARGET_DIR [python|node|go|rails]...  (no part named: all of them;
# tests/conformance.rs needs only the Python venv's Flask).
# Everything it makes lives under TARGET_DIR; a framework that cannot install fails it.
set -euo pipefail
target="${1:?usage: setup.sh TARGET_DIR [python|node|go|rails]...}"
shift
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(python node go rails)
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }
mkdir -p "$target"
target="$(cd "$target" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
# Test binaries run at once and more than one may set up: one at a time (apt-get
# and pip into one venv do not share), the others then find everything installed.
exec 9>"$target/frameworks-setup.lock"
flock 9

# Debian: Go 1.19 (net/http ServeMux) and Rails 6.1 on puma.
need_apt=()
if wants go; then command -v go >/dev/null 2>&1 || need_apt+=(golang-go); fi
if wants rails; then
  ruby -e 'require "action_controller/railtie"' >/dev/null 2>&1 || need_apt+=(ruby-railties)
  command -v puma >/dev/null 2>&1 || need_apt+=(puma)
fi
if wants node; then command -v npm >/dev/null 2>&1 || need_apt+=(npm); fi
if wants python; then command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-venv); fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== frameworks: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Python: Flask (werkzeug), FastAPI on uvicorn (httptools), aiohttp, Django + DRF.
if wants python; then
  venv="$target/frameworks-venv"
  py_pkgs=('flask==3.1.3' 'fastapi==0.165.*' 'uvicorn[standard]==0.55.*' 'aiohttp==3.14.5'
    'django==5.2.19' 'djangorestframework==3.18.3')
  py_check='import httptools
from importlib.metadata import version as v
want = {"flask": "3.1.3", "fastapi": "0.165.", "uvicorn": "0.55.", "aiohttp": "3.14.5", "django": "5.2.19", "djangorestframework": "3.18.3"}
for name, pin in want.items():
    assert v(name) == pin or (pin.endswith(".") and v(name).startswith(pin)), (name, v(name))'
  if ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "== frameworks: python3 -m venv $venv"
    python3 -m venv --clear "$venv"
  fi
  if ! "$venv/bin/python" -c "$py_check" >/dev/null 2>&1; then
    echo "== frameworks: pip install ${py_pkgs[*]}"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${py_pkgs[@]}"
    "$venv/bin/python" -c "$py_check"
  fi
fi

# Node: Express 4 and 5, each with method-override, in a directory of its own.
if wants node; then
  for major in 4 5; do
    dir="$target/frameworks-node/express$major"
    if ! node -e "const v=require('$dir/node_modules/express/package.json').version; if(!v.startsWith('$major.'))process.exit(1); require('$dir/node_modules/method-override')" >/dev/null 2>&1; then
      echo "== frameworks: npm install express@$major method-override into $dir"
      mkdir -p "$dir"
      [ -f "$dir/package.json" ] || echo '{"name":"agreement-express'"$major"'","private":true}' >"$dir/package.json"
      (cd "$dir" && npm install --silent --no-audit --no-fund "express@$major" method-override >/dev/null)
    fi
  done
fi

# Go: the ServeMux app, built once (GOCACHE under target/).
if wants go; then
  gobin="$target/frameworks-go/servemux"
  if [ ! -x "$gobin" ] || [ "$here/servemux.go" -nt "$gobin" ]; then
    echo "== frameworks: go build servemux.go"
    mkdir -p "$target/frameworks-go/cache"
    GOCACHE="$target/frameworks-go/cache" GO111MODULE=off GOFLAGS= go build -o "$gobin" "$here/servemux.go"
  fi
fi

# Rails: loads (the app itself is config.ru, run by puma).
if wants rails; then
  ruby -e 'require "action_controller/railtie"; require "puma"' >/dev/null
fi

echo "== frameworks: ready"
