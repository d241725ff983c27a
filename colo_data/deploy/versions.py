"""The versions that must agree across a deployment, in one place.

Under Pathways the host pipeline is cloudpickled by the trainer (the JAX client) and
unpickled inside the colocated-Python sidecar, and the client talks to the Pathways proxy,
resource manager and workers. So three things are coupled:

- JAX: the client, the colocated-Python sidecar base image and the Pathways server and
  proxy images (tagged `jax-<version>`) must run the same JAX release. The sidecar base
  image fixes it, so `JAX_VERSION` is the base image's JAX, and the trainer image must
  install exactly that JAX.
- pathwaysutils: the client's, which `colo_data.loader.loader` uses to detect Pathways; the
  sidecar image installs the same.
- colo-data: the sidecar image is tagged with colo-data's version, because the client's
  pipeline object is unpickled against the sidecar's copy of colo-data.

`sidecar_image/Dockerfile` (its `ARG BASE_IMAGE=` default) and pyproject.toml's pins are
checked against these constants by tests/test_manifest.py; change them here first.
"""

from __future__ import annotations

from importlib.metadata import version

# The Pathways colocated-Python sidecar base image; its tag names its Python and JAX.
SIDECAR_BASE_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways-colocated-python/sidecar:20260423-python_3.12-jax_0.10.0"
# The JAX of SIDECAR_BASE_IMAGE: what the client and every Pathways image must run.
JAX_VERSION = "0.10.0"
PATHWAYSUTILS_VERSION = "0.1.13"
PATHWAYS_SERVER_IMAGE = f"us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server:jax-{JAX_VERSION}"
PATHWAYS_PROXY_IMAGE = f"us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server:jax-{JAX_VERSION}"

COLO_DATA_VERSION = version("colo-data")
# What `sidecar_image/` builds on SIDECAR_BASE_IMAGE: colo-data and its dependencies, with
# `colo-data sidecar serve` behind `colo-data doctor` (target `serve`: multi-controller) or
# with the base image's colocated-Python server as it is (target `colocated`: Pathways).
SIDECAR_IMAGE = f"colo-data-sidecar:{COLO_DATA_VERSION}"
SIDECAR_COLOCATED_IMAGE = f"colo-data-sidecar:{COLO_DATA_VERSION}-colocated"
