"""What a Kubernetes deployment is made of: the manifests `colo-data manifest` renders from a
config (`manifest.py`, its YAML templates in `templates/`, package data) and the versions that
must agree across the trainer, the sidecar image and Pathways (`versions.py`)."""
