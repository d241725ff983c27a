#!/bin/sh
# Installs colo-data and the user's requirements into /opt/venv (the Pathways base image's
# venv, or a new one on a plain python3 base) without changing the base image's jax and
# jaxlib. Usage (from the Dockerfile): install.sh SRC WHEELS REQUIREMENTS SERVER_CONSTRAINTS
# (SRC: the build context; WHEELS: a folder in it, or empty to use the package index)
set -eu
src=$1 wheels=$2 requirements=$3 server_constraints=$4
cd "$src"  # relative paths in the requirements are relative to the build context
venv=/opt/venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"

# Pin what the base image has installed of jax and jaxlib: a requirement that needs another
# version fails the build (naming jax) instead of replacing the base server's JAX.
constraints=$(mktemp)
"$venv/bin/python" - >"$constraints" <<'PY'
import importlib.metadata as metadata

for name in ("jax", "jaxlib"):
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
PY
if [ -n "$server_constraints" ] && [ -f "$server_constraints" ]; then
    cat "$server_constraints" >>"$constraints"
fi

# the Pathways base's jaxlib carries the colocated-Python CPU client: it must survive
patched() { "$venv/bin/python" -c "from jax._src.lib import _jax; _jax.colocated_python_cpu_client" 2>/dev/null; }
had_client=no
if patched; then had_client=yes; fi

if [ -n "$wheels" ]; then
    set -- --no-index --find-links "$src/$wheels" colo-data
else
    set -- "$src"
fi
# no byte-compiling of the whole venv (half the build time): the warm-up below compiles
# what the sidecar imports, the rest compiles on first use
if command -v uv >/dev/null 2>&1; then
    VIRTUAL_ENV=$venv uv pip install -c "$constraints" -r "$requirements" "$@"
else
    "$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check -q --no-compile \
        -c "$constraints" -r "$requirements" "$@"
fi
rm -f "$constraints"
if [ "$had_client" = yes ] && ! patched; then
    echo "install.sh: the base image's jaxlib lost its colocated-Python CPU client; a requirement replaced it" >&2
    exit 1
fi

# warm-up: import what `colo-data doctor` and `colo-data sidecar serve` use (writing their
# byte code), which also checks the install; and the console script is there
JAX_PLATFORMS=cpu "$venv/bin/python" -c "import colo_data.cli, colo_data.backends.sidecar.server, jax; jax.devices()"
test -x "$venv/bin/colo-data"
