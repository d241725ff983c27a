"""`colo-data manifest CONFIG --target pathways|multi-controller`: print the Kubernetes
manifest that deploys CONFIG's pipeline, with `[deploy] ray_nodes` also a KubeRay
RayCluster for its Ray workers (see `colo_data.deploy.manifest`)."""

from __future__ import annotations

import click


@click.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--target", required=True, type=click.Choice(["pathways", "multi-controller"]),
    help="pathways: a JobSet, colo-data in the TPU hosts' colocated-Python sidecars; "
    "multi-controller: a Service and an Indexed Job, a trainer and a colo-data sidecar per pod. "
    "With [deploy] ray_nodes (--set ray_nodes=N), either also gets a KubeRay RayCluster whose actors do the "
    "host pipelines' work (docs/ray.md).",
)
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Set a [deploy] key, e.g. --set image=REGISTRY/colo-data-sidecar:TAG --set tpu_type=v6e (repeatable).",
)
def manifest(config: str, target: str, overrides: tuple[str, ...]) -> None:
    """Print CONFIG's deployment manifest for TARGET as YAML (kubectl apply -f -)."""
    from colo_data.config import load_config
    from colo_data.deploy import versions
    from colo_data.deploy.manifest import parse_override, render, to_yaml
    from colo_data.errors import ColoDataError

    try:
        objects = render(load_config(config), target, dict(parse_override(text) for text in overrides))
    except ColoDataError as e:
        raise click.ClickException(str(e)) from e
    header = f"colo-data manifest {config} --target {target} (colo-data {versions.COLO_DATA_VERSION}, JAX {versions.JAX_VERSION})"
    click.echo(to_yaml(objects, header), nl=False)
