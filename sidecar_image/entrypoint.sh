#!/bin/sh
# The sidecar image's entrypoint: run `colo-data doctor` (with $COLO_DATA_CONFIG it also
# sizes the config's shared-memory ring against the shm dir: $COLO_DATA_SHM_DIR, else the
# config's, else /dev/shm), print its report to the log, and refuse to start with the
# doctor's message on a fatal misconfiguration (exit 78);
# then exec the command: `colo-data sidecar serve` by default, or whatever the arguments say
# (on Pathways: the base image's colocated-Python server, see docs/deployment.md, "2. The image").
# COLO_DATA_SKIP_DOCTOR=1 skips the check.
set -eu
if [ "$#" -eq 0 ]; then
    set -- colo-data sidecar serve
fi
if [ -n "${COLO_DATA_SOCKET:-}" ]; then
    mkdir -p "$(dirname "${COLO_DATA_SOCKET#unix://}")"  # where serve will listen
fi
if [ "${COLO_DATA_SKIP_DOCTOR:-0}" != 1 ]; then
    # JAX on the CPU only: the check must not take a host's accelerators from the server
    if ! JAX_PLATFORMS=cpu colo-data doctor >&2; then
        echo "colo-data sidecar image: refusing to start: colo-data doctor found a fatal misconfiguration (its message is above)" >&2
        exit 78
    fi
fi
exec "$@"
